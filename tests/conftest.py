"""Test session set-up: tests run on CPU, meshes use 8 fake host devices. Shared fixtures: the Tutel oracle
cases, the qwen3_moe model and its prompts. Shared helpers live in tests/support/."""

from __future__ import annotations

import os

from support.paths import HF, TUTEL
from support.xla_flags import with_fast_compile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 fake CPU devices for mesh tests; must be set before JAX initialises its backend
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = with_fast_compile(os.environ["XLA_FLAGS"])
# the commands' persistent compile cache stays off (tests/test_compile_cache.py turns it on in a folder of its own):
# the suite writes nothing into the user's cache
os.environ.setdefault("TUTEL_JAX_COMPILE_CACHE", "off")

import numpy as np  # noqa: E402 - after the flags (numpy does not read them; kept with the other imports)
import pytest  # noqa: E402
from support.tutel_cases import TutelCase  # noqa: E402

TUTEL_CASES = sorted(p.name for p in TUTEL.iterdir() if p.is_dir())


@pytest.fixture(autouse=True, scope="module")
def fresh_compile_caches():
    """Drops JAX's compiled programs after each test module. A worker runs hundreds of modules, and every
    compiled CPU program holds a few memory mappings of its code: past the kernel's limit (vm.max_map_count,
    65530 by default) a new program cannot be mapped and XLA aborts the process."""
    yield
    import jax  # after the XLA flags above are set
    jax.clear_caches()


@pytest.fixture(params=TUTEL_CASES)
def tutel_case(request) -> TutelCase:
    return TutelCase(request.param)


@pytest.fixture(scope="module")
def model():
    """The qwen3_moe HF fixture (tests/fixtures/hf/qwen3_moe) as `from_pretrained` loads it, once per module."""
    from tutel_jax.models import from_pretrained  # after the XLA flags above are set
    return from_pretrained(HF / "qwen3_moe")


@pytest.fixture(scope="module")
def prompts():
    """The qwen3_moe fixture's prompts [2, 12] (its expected.npz)."""
    return np.load(HF / "qwen3_moe" / "expected.npz")["input_ids"]


def pytest_generate_tests(metafunc):
    """Op test classes (`support.kernels.KernelTestBase`) run every test once per backend of their BACKENDS."""
    if metafunc.cls is not None and "kernel_impl" in metafunc.fixturenames:
        metafunc.parametrize("kernel_impl", metafunc.cls.BACKENDS)
