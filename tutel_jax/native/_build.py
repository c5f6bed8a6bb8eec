"""Compile-on-first-use for the native CPU kernels (`*.cc` beside this file) and their XLA FFI registration.

A kernel's shared library is built once per machine with the system C++ compiler (`$CXX`, else `c++`, `g++` or
`clang++`) against the XLA FFI headers that jaxlib ships, for one instruction set (`ISAS`, see simd.h): `avx512`,
`avx2` (AVX2 + FMA), `neon` (AArch64) or `portable` (C++ only). The ISA in effect is the best this CPU runs, or the
one `TUTEL_JAX_NATIVE_ISA` names (it must be one the CPU runs: tests force each in turn); the flags are `-O3
-march=native` (the library is built where it runs) narrowed to that ISA, with explicit `-m` flags as a second try
for a compiler that does not know `-march=native`, and the source checks at compile time that the flags gave the
ISA asked for. `TUTEL_JAX_NATIVE_CXXFLAGS` (space-separated options) adds to them: a variant of an ISA the CPU
runs, e.g. `-mno-avx512bf16` for AVX-512 without its BF16 dot products (tests build it). Libraries are cached under
`$TUTEL_JAX_CACHE` (default `$XDG_CACHE_HOME/tutel_jax`, else `~/.cache/tutel_jax`), keyed by the source, the
headers beside it (`*.h`), the flags, the compiler, the jaxlib version and the CPU (its model and feature flags: a
home directory shared by different machines never hands one a library built for another's instruction set). The
library is written to a temporary file and renamed into place, so concurrent first uses (e.g. test workers) never
load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

from ..core import cpu_fingerprint as _cpu_fingerprint, user_cache_dir  # (tests patch the name here)

__all__ = ["ISAS", "NativeKernelError", "can_register", "compiler", "cpu_isas", "isa", "isa_in_effect",
           "load", "register"]

SOURCE_DIR = Path(__file__).resolve().parent
# -ffp-contract=fast: a * b + c in the vector code is one fused multiply-add
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast", "-Wno-psabi")
ISAS = ("portable", "avx2", "avx512", "neon")  # index = simd.h's Isa id
# per ISA: the flags, then a second try for a compiler that rejects -march=native
_ISA_FLAGS = {
    "avx512": (("-march=native",), ("-mavx512f", "-mavx512bw", "-mfma", "-mf16c")),
    "avx2": (("-march=native", "-mno-avx512f"), ("-mavx2", "-mfma", "-mf16c")),
    "neon": (("-march=native",), ()),  # Advanced SIMD is part of AArch64
    "portable": (("-march=native", "-DTUTEL_JAX_PORTABLE"), ("-DTUTEL_JAX_PORTABLE",)),
}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}
_registered: set[str] = set()


class NativeKernelError(RuntimeError):
    """A native kernel cannot be built or loaded here (no C++ compiler, or the compiler failed)."""


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else the first of c++, g++, clang++ on PATH), or None."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    for line in _cpu_fingerprint().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_isas() -> tuple[str, ...]:
    """The instruction sets of `ISAS` this CPU runs, best first (`portable` always last)."""
    machine = platform.machine().lower()
    found = []
    if machine in ("x86_64", "amd64"):
        flags = _cpu_flags()
        if "avx512f" in flags:
            found.append("avx512")
        if {"avx2", "fma"} <= flags:
            found.append("avx2")
    elif machine in ("aarch64", "arm64"):
        found.append("neon")
    return (*found, "portable")


def isa_in_effect() -> str:
    """The ISA the kernels are built for: $TUTEL_JAX_NATIVE_ISA when set (one this CPU runs), else the best the
    CPU runs. Raises NativeKernelError for an unknown name or one this CPU cannot run."""
    runs = cpu_isas()
    asked = os.environ.get("TUTEL_JAX_NATIVE_ISA", "").strip()
    if not asked:
        return runs[0]
    if asked not in ISAS:
        raise NativeKernelError(f"TUTEL_JAX_NATIVE_ISA={asked!r}: expected one of {', '.join(ISAS)}")
    if asked not in runs:
        raise NativeKernelError(f"TUTEL_JAX_NATIVE_ISA={asked!r}: this CPU ({platform.machine()}) cannot run it; it "
                                f"runs {', '.join(runs)}")
    return asked


def extra_flags() -> tuple[str, ...]:
    """$TUTEL_JAX_NATIVE_CXXFLAGS split at whitespace: compiler options added to the ISA's (NativeKernelError for
    a word that is not an option)."""
    words = tuple(os.environ.get("TUTEL_JAX_NATIVE_CXXFLAGS", "").split())
    bad = [w for w in words if not w.startswith("-")]
    if bad:
        raise NativeKernelError(f"TUTEL_JAX_NATIVE_CXXFLAGS: expected compiler options (each starting with '-'), "
                                f"got {bad[0]!r}")
    return words


def _flag_sets(isa_name: str) -> tuple[tuple[str, ...], ...]:
    require = f"-DTUTEL_JAX_REQUIRE_ISA={ISAS.index(isa_name)}"
    return tuple((*flags, *extra_flags(), require) for flags in _ISA_FLAGS[isa_name])


def _library_path(source: Path, cxx: str, flag_sets: tuple[tuple[str, ...], ...]) -> Path:
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    flags = " | ".join(" ".join(FLAGS + f) for f in flag_sets)
    for part in (source.read_bytes(), *headers, flags.encode(), cxx.encode(),
                 jaxlib.__version__.encode(), _cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    return user_cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compile(source: Path, target: Path, cxx: str, flag_sets: tuple[tuple[str, ...], ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    def run(flags):
        cmd = [cxx, *FLAGS, *flags, "-I", jax.ffi.include_dir(), "-I", str(SOURCE_DIR), str(source), "-o", tmp]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    try:
        done = run(flag_sets[0])
        if done.returncode != 0 and "march" in done.stderr:  # the compiler rejects the flag, not the code
            done = run(flag_sets[1])
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-20:])
            raise NativeKernelError(f"compiling {source.name} with {cxx} failed (exit {done.returncode}):\n{tail}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeKernelError(f"compiling {source.name} with {cxx} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str) -> ctypes.CDLL:
    """The shared library built from `<name>.cc` (compiled on first use, then taken from the cache)."""
    with _lock:
        if name in _libraries:
            return _libraries[name]
        source = SOURCE_DIR / f"{name}.cc"
        cxx = compiler()
        if cxx is None:
            raise NativeKernelError("the native CPU kernels need a C++ compiler (set $CXX, or install g++ or "
                                    "clang++); without one use another dropless_impl")
        flag_sets = _flag_sets(isa_in_effect())
        target = _library_path(source, cxx, flag_sets)
        if not target.exists():
            _compile(source, target, cxx, flag_sets)
        try:
            _libraries[name] = ctypes.cdll.LoadLibrary(str(target))
        except OSError as e:
            raise NativeKernelError(f"loading {target} failed: {e}") from None
        return _libraries[name]


def register(name: str, symbol: str, target: str) -> None:
    """Register `symbol` of library `name` as the CPU FFI target `target` (once per process)."""
    with _lock:
        if target in _registered:
            return
    handler = getattr(load(name), symbol)
    with _lock:
        if target not in _registered:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
            _registered.add(target)


def can_register(name: str, symbol: str, target: str) -> bool:
    """`register(name, symbol, target)`, True when it succeeds and False when the kernel cannot be built here (no
    C++ compiler, a failed build). A TUTEL_JAX_NATIVE_ISA that this CPU cannot run raises NativeKernelError
    instead: a forced ISA is never silently replaced by another path."""
    isa_in_effect()
    try:
        register(name, symbol, target)
    except NativeKernelError:
        return False
    return True


def isa() -> str:
    """The instruction set of the native kernels in effect in this process (`ISAS`), as the built library reports
    it (building it on first use)."""
    return ISAS[load("moe_cpu").TutelJaxIsa()]


def dot_instruction() -> bool:
    """Whether the built kernels' int8 dot product (`dot4` in simd.h) is one instruction: AVX-512 VNNI, AVX-VNNI
    or NEON's dot-product extension."""
    return bool(load("moe_cpu").TutelJaxDotInstruction())


def bf16_dot() -> bool:
    """Whether the built dense kernel multiplies a few exactly-bfloat16 rows by bfloat16 weight rows in AVX-512
    BF16 dot products (`bf16_rows.h`; else float32 FMAs, the same sums up to their order)."""
    return bool(load("dense_cpu").TutelJaxBf16Dot())


def int8_pays_off() -> bool:
    """Whether 'auto' multiplies FP4 weights by int8 activations here: every ISA but the portable C++, whose byte
    dot products are a scalar loop (half its float path's speed; benchmarks/results/native_isa.md)."""
    return isa() != "portable"
