"""GPU targets: which one a trace uses, and the per-target tiling tables the kernels choose from."""

from __future__ import annotations

import dataclasses
import importlib
import types

import jax.numpy as jnp
import pytest

import pallas_kernels as pk

# the modules (the package exports functions of the same names)
gating, gmm, quant, dispatch = (importlib.import_module(f"pallas_kernels.{m}")
                                for m in ("gating", "gmm", "quant", "dispatch"))


def _device(platform, capability="", kind=""):
    return types.SimpleNamespace(platform=platform, compute_capability=capability, device_kind=kind)


@pytest.mark.parametrize("device, expected", [
    (_device("gpu", "8.0", "NVIDIA A100-SXM4-80GB"), "sm_80"),
    (_device("gpu", "8.6", "NVIDIA A10"), "sm_80"),
    (_device("gpu", "9.0", "NVIDIA H100 80GB HBM3"), "sm_90"),
    (_device("gpu", "10.0", "NVIDIA B200"), "sm_100"),
    (_device("gpu", "10.3", "NVIDIA GB300"), "sm_100"),
    (_device("gpu", "gfx942", "AMD Instinct MI300X"), "gfx942"),
    (_device("rocm", "", "gfx942"), "gfx942"),
])
def test_target_of_a_gpu_device(device, expected):
    assert pk.targets.target_of_device(device).name == expected


@pytest.mark.parametrize("kind, expected", [
    ("NVIDIA B200", "sm_100"), ("NVIDIA GB200", "sm_100"), ("NVIDIA B100", "sm_100"),
    ("NVIDIA H100 80GB HBM3", "sm_90"), ("NVIDIA H200", "sm_90"), ("NVIDIA A100-SXM4-80GB", "sm_80"),
])
def test_target_of_a_device_kind(kind, expected):
    assert pk.targets.target_of_kind(kind).name == expected


def test_sm100_target_is_blackwell():
    """B200: compute capability 10.0, the same 227 KiB opt-in shared memory per block as H100, fp8 in
    hardware, 148 SMs."""
    t = pk.TARGETS["sm_100"]
    assert (t.platform, t.arch, t.warp_size, t.shared_bytes, t.num_sms, t.fp8_convert) == (
        "cuda", 100, 32, 232_448, 148, True)


def test_cpu_has_no_target_and_traces_for_the_default():
    assert pk.targets.target_of_device(_device("cpu")) is None
    assert pk.current_target().name == pk.DEFAULT_TARGET  # this CPU host


def test_use_target_nests_and_restores():
    with pk.use_target("sm_80") as outer:
        assert outer is pk.TARGETS["sm_80"] and pk.current_target().name == "sm_80"
        with pk.use_target(pk.TARGETS["gfx942"]):
            assert pk.current_target().name == "gfx942"
        assert pk.current_target().name == "sm_80"
    assert pk.current_target().name == pk.DEFAULT_TARGET


def test_unknown_target_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown kernel target 'sm_75'.*gfx942"):
        with pk.use_target("sm_75"):
            pass


def test_every_table_covers_every_target():
    for table in (gmm.GMM_TILINGS, gmm.TGMM_TILINGS, quant.QUANT_TILINGS, gating.GATING_TILINGS,
                  dispatch.DISPATCH_TILINGS):
        assert set(table) == set(pk.TARGETS)
    assert not pk.TARGETS["sm_80"].fp8_convert and pk.TARGETS["sm_90"].fp8_convert
    assert pk.TARGETS["sm_100"].fp8_convert


def test_defaults_follow_the_target():
    """The same shape picks each target's tiling: MI300 pipelines two stages (64 KiB LDS), the NVIDIA targets
    three; A100's prefill quantized tile is narrower (no register spills)."""
    with pk.use_target("gfx942"):
        assert gmm.default_gmm_config(4096, 1024, 1024, 8, jnp.bfloat16).num_stages == 2
    with pk.use_target("sm_90"):
        assert gmm.default_gmm_config(4096, 1024, 1024, 8, jnp.bfloat16).num_stages == 3
    assert quant.default_quant_config(4096, 1024, 1024, 8, target="sm_80").block_n == 64
    assert quant.default_quant_config(4096, 1024, 1024, 8, target="sm_90").block_n == 128


@pytest.mark.parametrize("target", sorted(pk.TARGETS))
def test_candidates_hold_every_default(target):
    """What the defaults pick at the model families' shapes is among the tilings the compile gate builds."""
    gmm_candidates = set(gmm.tiling_candidates(target, "gmm").values())
    quant_candidates = {c for c in quant.tiling_candidates(target).values()}
    for rows in (8, 64, 512, 4096, 16384):
        for groups in (8, 32, 128, 256):
            for dtype in (jnp.bfloat16, jnp.float32):
                cfg = gmm.default_gmm_config(rows, 4096, 4096, groups, dtype, target=target)
                assert cfg in gmm_candidates, (rows, groups, dtype, cfg)
                q = quant.default_quant_config(rows, 4096, 4096, groups, dtype, target=target)
                assert dataclasses.replace(q, split_k=1) in quant_candidates, (rows, groups, dtype, q)
