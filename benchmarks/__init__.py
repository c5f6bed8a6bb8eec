"""Benchmarks of tutel_jax; run each module as a script (see its docstring)."""
