"""Offline GPU compile of the Pallas kernels: no GPU needed.

Each kernel is lowered with `jax.export` for CUDA or ROCm under a target (targets.py), its Triton module is taken
out of the exported program (_extract.py), and the pip `triton` package compiles it for sm_80, sm_90 or gfx942
in its own environment (_compile.py, _worker.py). The compile checks what lowering cannot: that the Triton
compiler accepts the kernel for that architecture (A100 has no FP8 conversion instructions), that its shared
memory fits the target (MI300 has 64 KiB of LDS per workgroup), and whether it spills registers.
XLA builds its kernels with its own fork of Triton, so this is a close stand-in for the GPU's compile, not proof.
_cases.py lists what is compiled: the kernels of real model families at decode and prefill sizes, and every
tiling the selection tables hold. `python -m pallas_kernels.offline` prints the report.
"""

from ._cases import FAMILIES, Case, ModelFamily, all_cases, model_cases, tiling_cases
from ._compile import TRITON_PYTHON_ENV, TRITON_VERSION, CompileResult, compile_kernels, find_triton_python
from ._extract import TRITON_CALL, TritonKernel, export_for, kernels_of, triton_kernels
from ._report import KernelReport, compile_report, lower_cases, report_markdown

__all__ = ["FAMILIES", "Case", "ModelFamily", "all_cases", "model_cases", "tiling_cases", "TRITON_PYTHON_ENV",
           "TRITON_VERSION", "CompileResult", "compile_kernels", "find_triton_python", "TRITON_CALL", "TritonKernel",
           "export_for", "kernels_of", "triton_kernels", "KernelReport", "compile_report", "lower_cases",
           "report_markdown"]
