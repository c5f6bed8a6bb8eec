"""The accelerators `tutel-jax compile` targets: one table of their published per-device figures.

Units: bytes, bytes/s, FLOP/s, per device (one GPU, one TPU chip). Capacities and bandwidths are the vendor's
GB and GB/s taken as 10**9 (where a document states GiB, or the physical memory is a binary size, this is the
conservative reading). `peak_bf16_flops` is dense (no 2:4 sparsity: NVIDIA's datasheets print BF16 Tensor Core
figures with sparsity, twice the dense rate). `interconnect_bytes_per_s` is the bidirectional NVLink / ICI
bandwidth of one device. `device_kind` is the string JAX reports for such a device; `target_description` names
the compile target description inside jax's CUDA plugin (its `device_description_str`), which for some GPUs is
spelled differently (an H200 reports 'NVIDIA H200'; the plugin's description is 'NVIDIA H200 141GB HBM3e').
"""

from __future__ import annotations

import dataclasses

__all__ = ["Hardware", "HARDWARE", "hardware"]

GB = 10**9
TFLOPS = 10**12

_A100 = ("NVIDIA A100 Tensor Core GPU datasheet: A100 SXM {gb}GB HBM2{e}, {bw} GB/s; BF16 Tensor Core 312 TFLOPS "
         "(624 with sparsity); NVLink 600 GB/s")
_HOPPER = ("NVIDIA {name} Tensor Core GPU datasheet: {name} SXM {mem}, {bw}; BF16 Tensor Core 1,979 TFLOPS with "
           "sparsity = 989 dense; NVLink 900 GB/s")
_CLOUD_TPU = "Cloud TPU documentation, 'TPU {v}' system architecture: "


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator model: `platform` 'gpu' or 'tpu'; `source` the document the figures come from;
    `target_description` the CUDA plugin's name of its compile target ('' for TPUs and where it equals
    `device_kind`)."""

    name: str
    platform: str
    device_kind: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float
    interconnect_bytes_per_s: float
    source: str
    target_description: str = ""

    @property
    def gpu_target(self) -> str:
        """The CUDA plugin's device_description_str of this GPU (see the module docstring)."""
        return self.target_description or self.device_kind


HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("a100-40gb", "gpu", "NVIDIA A100-SXM4-40GB", 40 * GB, 1555 * GB, 312 * TFLOPS, 600 * GB,
             _A100.format(gb=40, e="", bw="1,555")),
    Hardware("a100-80gb", "gpu", "NVIDIA A100-SXM4-80GB", 80 * GB, 2039 * GB, 312 * TFLOPS, 600 * GB,
             _A100.format(gb=80, e="e", bw="2,039")),
    Hardware("h100", "gpu", "NVIDIA H100 80GB HBM3", 80 * GB, 3350 * GB, 989 * TFLOPS, 900 * GB,
             _HOPPER.format(name="H100", mem="80 GB HBM3", bw="3.35 TB/s")),
    Hardware("h200", "gpu", "NVIDIA H200", 141 * GB, 4800 * GB, 989 * TFLOPS, 900 * GB,
             _HOPPER.format(name="H200", mem="141 GB HBM3e", bw="4.8 TB/s"),
             target_description="NVIDIA H200 141GB HBM3e"),
    Hardware("b200", "gpu", "NVIDIA B200", 180 * GB, 8000 * GB, 2250 * TFLOPS, 1800 * GB,
             "NVIDIA DGX B200 datasheet: 8 GPUs with 1,440 GB HBM3e in all (180 GB each) and 64 TB/s (8 TB/s "
             "each); NVIDIA HGX B200 specifications: FP16/BF16 Tensor Core 36 PFLOPS for 8 GPUs with sparsity = "
             "2.25 PFLOPS dense per GPU; NVLink 5: 1.8 TB/s per GPU"),
    Hardware("v5e", "tpu", "TPU v5 lite", 16 * GB, 819 * GB, 197 * TFLOPS, 400 * GB,
             _CLOUD_TPU.format(v="v5e") + "16 GB HBM2 (16 GiB in later revisions), 819 GBps, 197 TFLOPs bf16, "
             "bidirectional ICI 400 GBps per chip"),
    Hardware("v5p", "tpu", "TPU v5", 95 * GB, 2765 * GB, 459 * TFLOPS, 1200 * GB,
             _CLOUD_TPU.format(v="v5p") + "95 GB HBM2e (95 GiB in later revisions), 2765 GBps, 459 TFLOPs bf16, "
             "bidirectional ICI 1200 GBps per chip"),
    Hardware("v6e", "tpu", "TPU v6 lite", 32 * GB, 1638 * GB, 918 * TFLOPS, 800 * GB,
             _CLOUD_TPU.format(v="v6e") + "32 GB HBM, 1638 GBps, 918 TFLOPs bf16, bidirectional ICI 800 GBps "
             "per chip"),
)}


def hardware(name: str) -> Hardware:
    """The table's entry `name`; ValueError listing the known names."""
    if name not in HARDWARE:
        raise ValueError(f"unknown accelerator {name!r}: expected one of {', '.join(HARDWARE)}")
    return HARDWARE[name]
