"""The user's cache directory and the persistent cache of compiled XLA programs that the `tutel-jax` commands use.

    user_cache_dir()              -> $TUTEL_JAX_CACHE, else $XDG_CACHE_HOME/tutel_jax, else ~/.cache/tutel_jax
    cpu_fingerprint()             -> the machine type and the first CPU's model and feature flags
    enable_compile_cache(setting) -> the folder jax now keeps compiled programs in (None: 'off')

A command's programs (a model's prefill and decode steps, the server's warmup batches) compile in seconds to
minutes on a CPU; with the cache a second run of the same command on the same checkpoint loads them instead.
Compiled CPU programs use the instructions of the CPU they were compiled on, so each machine, jax version and
platform gets its own folder (`machine_key`): a program is never loaded on a CPU that cannot run it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform as _platform
from pathlib import Path

__all__ = ["COMPILE_CACHE_ENV", "COMPILE_CACHE_MAX_BYTES", "cpu_fingerprint", "enable_compile_cache", "machine_key",
           "user_cache_dir"]

#: the environment's default for the commands' --compile-cache: a directory, or 'off'
COMPILE_CACHE_ENV = "TUTEL_JAX_COMPILE_CACHE"
#: jax evicts the least recently used programs beyond this size
COMPILE_CACHE_MAX_BYTES = 4 << 30


def user_cache_dir() -> Path:
    """Where tutel-jax keeps what it builds (native kernels, compiled programs): $TUTEL_JAX_CACHE, else
    $XDG_CACHE_HOME/tutel_jax, else ~/.cache/tutel_jax."""
    if os.environ.get("TUTEL_JAX_CACHE"):
        return Path(os.environ["TUTEL_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tutel_jax"


@functools.lru_cache(maxsize=None)  # the CPU does not change under a running process
def cpu_fingerprint() -> str:
    """The machine type plus, on Linux, the first CPU's model name and feature flags: what keys the caches of
    things built for this CPU (native kernels, compiled programs)."""
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
    return "\n".join([_platform.machine(), _platform.processor(), *lines])


def machine_key() -> str:
    """A folder name for this machine's compiled programs: jax and jaxlib versions, OS, architecture, and a hash of
    the CPU's model and features."""
    import jax
    import jaxlib

    cpu = hashlib.sha256(cpu_fingerprint().encode()).hexdigest()[:12]
    return f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{_platform.system()}-{_platform.machine()}-{cpu}".lower()


def enable_compile_cache(setting: str | os.PathLike | None) -> Path | None:
    """Turns jax's persistent compilation cache on in `setting`/`machine_key()` (None: the environment's
    COMPILE_CACHE_ENV, else user_cache_dir()/xla; 'off': leaves it off and returns None). Programs that compile in
    a second or more are kept (jax's threshold), at most COMPILE_CACHE_MAX_BYTES in all. Call it before the
    process compiles anything: jax decides at its first compile whether a cache is used. ValueError (naming the
    folder) when the folder cannot be created or written."""
    import jax

    if setting is None:
        setting = os.environ.get(COMPILE_CACHE_ENV) or str(user_cache_dir() / "xla")
    if str(setting).strip().lower() == "off":
        return None
    folder = Path(setting).expanduser() / machine_key()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache {setting}: cannot create {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"compile cache {setting}: {folder} is not writable")
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    return folder
