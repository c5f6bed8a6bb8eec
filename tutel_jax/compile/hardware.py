"""The accelerators `tutel-jax compile` targets: one table of their published per-device figures.

Units: bytes, bytes/s, FLOP/s, per device (one GPU, one TPU chip). Capacities and bandwidths are the vendor's
GB and GB/s taken as 10**9 (the documents state GB; where the physical memory is a binary size this is the
conservative reading). `peak_bf16_flops` is dense (no 2:4 sparsity). `interconnect_bytes_per_s` is the
bidirectional NVLink / ICI bandwidth of one device. `device_kind` is the string JAX reports for such a device
(for NVIDIA GPUs it also selects the compile target description inside the CUDA plugin).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Hardware", "HARDWARE", "hardware"]

GB = 10**9
TFLOPS = 10**12


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator model: `platform` 'gpu' or 'tpu'; `source` the document the figures come from."""

    name: str
    platform: str
    device_kind: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float
    interconnect_bytes_per_s: float
    source: str


HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("a100-40gb", "gpu", "NVIDIA A100-SXM4-40GB", 40 * GB, 1555 * GB, 312 * TFLOPS, 600 * GB,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 1,555 GB/s, BF16 312 TFLOPS, NVLink 600 GB/s)"),
    Hardware("a100-80gb", "gpu", "NVIDIA A100-SXM4-80GB", 80 * GB, 2039 * GB, 312 * TFLOPS, 600 * GB,
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 2,039 GB/s, BF16 312 TFLOPS, NVLink 600 GB/s)"),
    Hardware("h100", "gpu", "NVIDIA H100 80GB HBM3", 80 * GB, 3350 * GB, 989 * TFLOPS, 900 * GB,
             "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80GB, 3.35 TB/s, BF16 1,979 TFLOPS with "
             "sparsity = 989 dense, NVLink 900 GB/s)"),
    Hardware("h200", "gpu", "NVIDIA H200 141GB HBM3e", 141 * GB, 4800 * GB, 989 * TFLOPS, 900 * GB,
             "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141GB, 4.8 TB/s, BF16 1,979 TFLOPS with "
             "sparsity = 989 dense, NVLink 900 GB/s)"),
    Hardware("b200", "gpu", "NVIDIA B200", 180 * GB, 8000 * GB, 2250 * TFLOPS, 1800 * GB,
             "NVIDIA DGX B200 datasheet (8 GPUs: 1,440 GB, 64 TB/s HBM3e, FP8 training 72 PFLOPS dense = "
             "BF16 2.25 PFLOPS per GPU; NVLink 5: 1.8 TB/s per GPU)"),
    Hardware("v5e", "tpu", "TPU v5 lite", 16 * GB, 819 * GB, 197 * TFLOPS, 400 * GB,
             "Cloud TPU documentation, 'TPU v5e' (16 GB HBM2, 819 GBps, 197 TFLOPs bf16, ICI 400 GBps)"),
    Hardware("v5p", "tpu", "TPU v5", 95 * GB, 2765 * GB, 459 * TFLOPS, 1200 * GB,
             "Cloud TPU documentation, 'TPU v5p' (95 GB HBM2e, 2765 GBps, 459 TFLOPs bf16, ICI 1200 GBps)"),
    Hardware("v6e", "tpu", "TPU v6 lite", 32 * GB, 1638 * GB, 918 * TFLOPS, 800 * GB,
             "Cloud TPU documentation, 'TPU v6e' (32 GB HBM, 1638 GBps, 918 TFLOPs bf16, ICI 800 GBps)"),
)}


def hardware(name: str) -> Hardware:
    """The table's entry `name`; ValueError listing the known names."""
    if name not in HARDWARE:
        raise ValueError(f"unknown accelerator {name!r}: expected one of {', '.join(HARDWARE)}")
    return HARDWARE[name]
