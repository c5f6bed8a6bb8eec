"""Pallas GPU kernels for tutel-jax (gating, dispatch/combine, grouped and quantized matmul).

Each op pairs a plain-JAX reference with its kernels; tutel-jax runs the plain-XLA path on CPU. No kernel ships
yet: every op currently resolves to its XLA reference in `tutel_jax`.
"""
