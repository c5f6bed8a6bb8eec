"""The Mosaic GPU grouped matmul (tokamax) against XLA's ragged_dot and the Triton kernel, on a GPU.

    python benchmarks/mosaic_gpu_gmm.py        # needs an sm_90 / sm_100 GPU and tokamax

For each shape: gmm, tgmm and the gmm gradients of each implementation against the XLA reference (error relative
to the largest reference value; bfloat16 operands, float32 outputs, both at "highest" precision), and gmm's time
(median of 5 loops of 20 calls). Results of the H200 run: benchmarks/results/mosaic_gpu_gmm_h200.txt.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
from pallas_kernels.gmm import _pallas_mosaic_gpu as mg
print(jax.__version__, jax.devices(), pk.current_target().name, "tokamax:", mg.unavailable_reason() or "ok", flush=True)
BF = jnp.bfloat16

def sizes(t, g, seed):
    rng = np.random.default_rng(seed)
    s = rng.multinomial(t - 5, np.ones(g) / g).astype(np.int32); s[1] += s[0]; s[0] = 0
    return jnp.asarray(s)

def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))

def bench(f, *args, n=20):
    f(*args).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): out = f(*args)
        out.block_until_ready(); ts.append((time.perf_counter() - t) / n)
    return float(np.median(ts))

for (t, k, n, g) in [(1031, 512, 384, 6), (16384, 4096, 1536, 64)]:
    ks = jax.random.split(jax.random.key(t), 3)
    lhs = jax.random.normal(ks[0], (t, k), BF); rhs = jax.random.normal(ks[1], (g, k, n), BF)
    cot = jax.random.normal(ks[2], (t, n), BF); gs = sizes(t, g, t)
    for impl in ("mosaic_gpu", "pallas"):
        try:
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(lambda a, b: pk.gmm_reference(a, b, gs, preferred_element_type=jnp.float32))(lhs, rhs)
                tref = jax.jit(lambda a, c: pk.tgmm_reference(a, c, gs, preferred_element_type=jnp.float32))(lhs, cot)
            f = jax.jit(lambda a, b: pk.gmm(a, b, gs, preferred_element_type=jnp.float32, implementation=impl))
            got = f(lhs, rhs)
            tf = jax.jit(lambda a, c: pk.tgmm(a, c, gs, preferred_element_type=jnp.float32, implementation=impl))
            tgot = tf(lhs, cot)
            gf = jax.jit(jax.grad(lambda a, b: jnp.sum(pk.gmm(a, b, gs, implementation=impl).astype(jnp.float32) * cot.astype(jnp.float32)), (0, 1)))
            gx = jax.jit(jax.grad(lambda a, b: jnp.sum(pk.gmm(a, b, gs, implementation="xla").astype(jnp.float32) * cot.astype(jnp.float32)), (0, 1)))
            g1, g2 = gf(lhs, rhs), gx(lhs, rhs)
            ms = bench(f, lhs, rhs) * 1e3
            flops = 2 * float(jnp.sum(gs)) * k * n
            print(f"T={t} K={k} N={n} G={g} {impl:<10} gmm rel err {rel(got, ref):.2e}  tgmm {rel(tgot, tref):.2e}  "
                  f"grad {rel(g1[0], g2[0]):.2e}/{rel(g1[1], g2[1]):.2e}  gmm {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s",
                  flush=True)
        except Exception as e:
            print(f"T={t} {impl} FAILED: {type(e).__name__}: {str(e)[:800]}", flush=True)
