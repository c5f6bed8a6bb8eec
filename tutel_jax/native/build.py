"""Compile-on-first-use for the native CPU kernels (`*.cc` beside this file) and their XLA FFI registration.

A kernel's shared library is built once per machine with the system C++ compiler (`$CXX`, else `c++`, `g++` or
`clang++`) against the XLA FFI headers that jaxlib ships, with `-O3 -march=native` (the library is built where it
runs; a compiler that does not know it gets a second try without), and cached under `$TUTEL_JAX_CACHE` (default
`$XDG_CACHE_HOME/tutel_jax`, else `~/.cache/tutel_jax`), keyed by the source, the flags, the compiler, the jaxlib
version and the CPU (its model and feature flags: a home directory shared by different machines never hands one
a library built for another's instruction set). The headers beside the sources (`*.h`) are part of the key.
`TUTEL_JAX_NATIVE_PORTABLE=1` builds without the AVX-512 code paths (the portable C++ every CPU runs; tests use
it to check those paths on a machine that has AVX-512). The library is written to a temporary file and renamed into
place, so concurrent first uses (e.g. test workers) never load a half-written file.
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

__all__ = ["NativeKernelError", "cache_dir", "compiler", "load", "register"]

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
TUNE_FLAGS = ("-march=native",)  # dropped on a second try if the compiler rejects it

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}
_registered: set[str] = set()


class NativeKernelError(RuntimeError):
    """A native kernel cannot be built or loaded here (no C++ compiler, or the compiler failed)."""


def cache_dir() -> Path:
    """Where built kernels are kept: $TUTEL_JAX_CACHE, else $XDG_CACHE_HOME/tutel_jax, else ~/.cache/tutel_jax."""
    if os.environ.get("TUTEL_JAX_CACHE"):
        return Path(os.environ["TUTEL_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tutel_jax"


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else the first of c++, g++, clang++ on PATH), or None."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_fingerprint() -> str:
    """The machine type plus, on Linux, the first CPU's model name and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    lines.append(line.strip())
                elif not line.strip() and lines:
                    break  # the first processor's block is enough
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), *lines])


def _defines() -> tuple[str, ...]:
    return ("-DTUTEL_JAX_PORTABLE",) if os.environ.get("TUTEL_JAX_NATIVE_PORTABLE") == "1" else ()


def _library_path(source: Path, cxx: str) -> Path:
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    for part in (source.read_bytes(), *headers, " ".join(FLAGS + TUNE_FLAGS + _defines()).encode(), cxx.encode(),
                 jaxlib.__version__.encode(), _cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compile(source: Path, target: Path, cxx: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    def run(tune):
        cmd = [cxx, *FLAGS, *tune, *_defines(), "-I", jax.ffi.include_dir(), "-I", str(SOURCE_DIR), str(source),
               "-o", tmp]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    try:
        done = run(TUNE_FLAGS)
        if done.returncode != 0 and "march" in done.stderr:  # the compiler rejects the flag, not the code
            done = run(())
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
        target = _library_path(source, cxx)
        if not target.exists():
            _compile(source, target, cxx)
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
