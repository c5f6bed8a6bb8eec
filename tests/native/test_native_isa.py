"""Which instruction set the native kernels are built for: the best this CPU runs, `TUTEL_JAX_NATIVE_ISA` forcing
one it runs (anything else is one clear error), `native.isa()` reading it back from the built library, and the
AArch64 NEON build compiled by a cross compiler (ziglang's, from the test extra) with the compile-time check that
its flags really target NEON."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tutel_jax import native
from tutel_jax.experts._dropless import native_available
from tutel_jax.layer import make_config
from tutel_jax.native import _build as build
from tutel_jax.native import NativeKernelError
from tutel_jax.native._dense import available as dense_available

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the native kernels cannot "
                                                                     "be built on this machine")


@needs_compiler
def test_isa_is_the_best_this_cpu_runs(monkeypatch):
    monkeypatch.delenv("TUTEL_JAX_NATIVE_ISA", raising=False)
    assert build.isa_in_effect() == build.cpu_isas()[0]
    assert native.isa() == build.isa_in_effect()  # what the library built for it reports
    # the int8 dot product is one instruction exactly where the CPU has one (the library is built for this CPU)
    vnni = {"avx512": "avx512_vnni", "avx2": "avx_vnni", "neon": "asimddp"}.get(native.isa())
    assert build.dot_instruction() == (vnni is not None and vnni in build._cpu_flags())
    assert build.int8_pays_off() == (native.isa() != "portable")
    # bfloat16 dot products exactly where the AVX-512 build runs on a CPU that has them
    assert build.bf16_dot() == (native.isa() == "avx512" and "avx512_bf16" in build._cpu_flags())


def test_forced_isa_must_be_known_and_runnable(monkeypatch):
    monkeypatch.setenv("TUTEL_JAX_NATIVE_ISA", "avx9")
    with pytest.raises(NativeKernelError, match=r"TUTEL_JAX_NATIVE_ISA='avx9': expected one of portable, avx2, "
                                                r"avx512, neon"):
        build.isa_in_effect()
    missing = [isa for isa in build.ISAS if isa not in build.cpu_isas()]
    assert missing, "no CPU runs both x86 and AArch64 code"
    monkeypatch.setenv("TUTEL_JAX_NATIVE_ISA", missing[0])
    with pytest.raises(NativeKernelError, match=f"TUTEL_JAX_NATIVE_ISA='{missing[0]}': this CPU .* cannot run it"):
        build.isa_in_effect()
    monkeypatch.setenv("TUTEL_JAX_NATIVE_ISA", "portable")
    assert build.isa_in_effect() == "portable"


def test_cpu_isas_from_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    for flags, expected in (("fpu avx2 fma avx512f", ("avx512", "avx2", "portable")),
                            ("fpu avx2 fma", ("avx2", "portable")), ("fpu avx", ("portable",))):
        monkeypatch.setattr(build, "_cpu_fingerprint", lambda flags=flags: f"x86_64\nflags\t: {flags}")
        assert build.cpu_isas() == expected
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.cpu_isas() == ("neon", "portable")


NEON_CPUS = ("cortex_a53", "neoverse_n1")  # ARMv8.0-A; ARMv8.2-A with the dot-product extension


@pytest.mark.skipif(importlib.util.find_spec("ziglang") is None,
                    reason="the ziglang cross compiler (in the [test] extra) is not installed")
@pytest.mark.parametrize("source", ["moe_cpu", "dense_cpu", "attention_cpu", "read_bandwidth"])
def test_neon_build_compiles_for_aarch64(tmp_path, source):
    """The kernels compiled for AArch64 (base ARMv8-A, and with the dot-product extension) with the flags the
    build uses there: the NEON code, not the portable one (TUTEL_JAX_REQUIRE_ISA fails the compile otherwise)."""
    import jax

    for cpu in NEON_CPUS:
        cmd = [sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu", f"-mcpu={cpu}",
               *[f for f in build.FLAGS if f not in ("-shared",)], f"-DTUTEL_JAX_REQUIRE_ISA={build.ISAS.index('neon')}",
               "-I", jax.ffi.include_dir(), "-I", str(build.SOURCE_DIR), "-c",
               str(build.SOURCE_DIR / f"{source}.cc"), "-o", str(tmp_path / f"{source}.o")]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, ZIG_GLOBAL_CACHE_DIR=str(tmp_path / "zig")))
        assert done.returncode == 0, f"{cpu}: {done.stderr[-3000:]}"
        assert (tmp_path / f"{source}.o").read_bytes()[:4] == b"\x7fELF"


def test_auto_paths_do_not_hide_a_forced_isa_the_cpu_cannot_run(monkeypatch):
    """'auto' falls back from the native kernels where none can be built, but a forced ISA this CPU cannot run is
    the user's error: it is raised, not replaced by a slower path."""
    missing = next(isa for isa in build.ISAS if isa not in build.cpu_isas())
    monkeypatch.setenv("TUTEL_JAX_NATIVE_ISA", missing)
    experts = make_config({"type": "top", "k": 2}, 64, {"type": "swiglu", "count_per_node": 4,
                                                        "hidden_size_per_expert": 32, "weight_format": "mxfp4"}).experts
    with pytest.raises(NativeKernelError, match="cannot run it"):
        native_available(experts)
    with pytest.raises(NativeKernelError, match="cannot run it"):
        dense_available()
