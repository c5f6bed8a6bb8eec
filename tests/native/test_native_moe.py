"""The native CPU kernel (`tutel_jax.native.moe_experts`, C++ through XLA FFI) and `dropless_impl='native'`.

The kernel against a float64 NumPy re-implementation (float32 and bfloat16 weights; the few-row streaming form and
the register-tiled form, column tails, skipped assignments; tolerance 1e-5 of the output's scale); the MoE layer
against the 'ragged' path (outputs and gradients, 1e-5); the HF fixture models with every MoE layer native against
transformers' logits and greedy tokens (the fixtures' 1e-4); the build cache and the errors.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tutel_jax.cli import main
from tutel_jax.layer import make_config, init_params, moe_apply
from tutel_jax.models import context_from_mask, from_pretrained
from tutel_jax.native import NativeKernelError, _build as build, moe_experts
from tutel_jax.serving import generate
from support.paths import HF

SWIGLU_CASES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe"]
TOL = dict(rtol=1e-4, atol=1e-4)  # the fixtures' logits tolerance (tests/fixtures/README.md)

# The kernel is compiled here on first use; a machine without a C++ compiler cannot run it (reported as a skip
# with this reason; test_compiler_errors checks the error such a machine gets).
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the native kernel cannot be "
                                                                     "built on this machine")


def _reference(x, ids, enc, dec, gate, up, down):
    """float64: y[s] = sum_k dec * down_e . (silu(gate_e . r) * (up_e . r)) with r = enc * x[s]; weights
    [E, out, in]."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    y = np.zeros((x.shape[0], down.shape[1]))
    for k, s in np.ndindex(*ids.shape):
        e = int(ids[k, s])
        if 0 <= e < down.shape[0]:
            r = float(enc[k, s]) * x[s]
            g, u = gate[e] @ r, up[e] @ r
            y[s] += float(dec[k, s]) * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return y


def _inputs(seed, tokens, k, experts, model_dim, hidden, out_dim, weight_dtype=np.float32):
    """x [S, M], ids / enc / dec [k, S], and SwiGLU weights [E, out, in]: gate, up [E, I, M], down [E, Mo, I]."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, model_dim)).astype(np.float32)
    gate, up = ((rng.normal(size=(experts, hidden, model_dim)) * model_dim ** -0.5).astype(weight_dtype)
                for _ in range(2))
    down = (rng.normal(size=(experts, out_dim, hidden)) * hidden ** -0.5).astype(weight_dtype)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)], axis=1).astype(np.int32)  # [k, S]
    enc = rng.uniform(0.5, 1.5, size=ids.shape).astype(np.float32)
    dec = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    return x, ids, enc, dec, gate, up, down


def _swiglu(x, ids, enc, dec, gate, up, down, **kw):
    return moe_experts(x, ids, enc, dec, gate, down, up=up, **kw)


def _close(got, ref, tol=1e-5):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))


# Shapes: decode (each expert gets <= 8 rows: the streaming form), prefill-like (up to ~40 rows per expert: the
# register tiles), and widths that are not multiples of the 16-lane vectors or the 64-column tiles.
SHAPES = {"decode": (8, 4, 32, 64, 48, 64), "prefill": (80, 2, 4, 64, 64, 128), "tails": (37, 3, 5, 24, 21, 13)}


@needs_compiler
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_float64_reference(shape, weights):
    dtype = np.float32 if weights == "float32" else ml_dtypes.bfloat16
    x, ids, enc, dec, gate, up, down = _inputs(0, *SHAPES[shape], weight_dtype=dtype)
    ids[0, 0], ids[-1, -1] = -1, 2 ** 30  # not this device's experts: skipped
    enc[0, 1] = 0.0  # dropped assignments: skipped
    dec[-1, 0] = 0.0
    ref = _reference(x, ids, enc, dec, gate, up, down)
    y = jax.jit(_swiglu)(x, ids, enc, dec, gate, up, down)
    assert y.shape == ref.shape and y.dtype == jnp.float32
    _close(y, ref)
    # one worker (no thread pool) gives the same sums up to the order of the per-worker additions
    _close(jax.jit(lambda *a: _swiglu(*a, max_workers=1))(x, ids, enc, dec, gate, up, down), ref)


@needs_compiler
def test_kernel_fused_gate_up_and_no_assignments():
    """One W1 [E, 2I, M] (gate rows, then up rows) is the same as gate and up apart."""
    x, ids, enc, dec, gate, up, down = _inputs(1, *SHAPES["decode"])
    fused = np.concatenate([gate, up], axis=1)
    _close(moe_experts(x, ids, enc, dec, fused, down), _reference(x, ids, enc, dec, gate, up, down))
    nothing = _swiglu(x, np.full_like(ids, -1), enc, dec, gate, up, down)  # every assignment elsewhere
    np.testing.assert_array_equal(np.asarray(nothing), 0.0)


TOP4 = {"type": "top", "k": 4}
DEEPSEEK = {"type": "deepseek_v3", "k": 3, "n_group": 4, "topk_group": 2, "correction_bias": True,
            "routed_scaling_factor": 2.0}
SWIGLU = {"type": "swiglu", "count_per_node": 16, "hidden_size_per_expert": 40}


def _layers(gate, **kw):
    native = make_config(gate, 64, SWIGLU, dropless_impl="native", **kw)
    ragged = make_config(gate, 64, SWIGLU, dropless_impl="ragged", **kw)
    return native, ragged, init_params(native, jax.random.key(0))


@needs_compiler
@pytest.mark.parametrize("postscore", [True, False], ids=["postscore", "prescore"])
@pytest.mark.parametrize("gate", [TOP4, DEEPSEEK], ids=["top4", "deepseek_top3"])
def test_layer_equals_ragged_path(gate, postscore):
    native, ragged, params = _layers(gate, is_postscore=postscore)
    for tokens in (8, 300):  # decode-sized and prefill-sized
        x = jax.random.normal(jax.random.key(tokens), (tokens, 64))
        y, aux = jax.jit(lambda p, x: moe_apply(p, x, native, capacity_factor=0.0))(params, x)
        ref, ref_aux = jax.jit(lambda p, x: moe_apply(p, x, ragged, capacity_factor=0.0))(params, x)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        _close(y, np.asarray(ref))
        np.testing.assert_array_equal(aux.dispatch_count, ref_aux.dispatch_count)


@needs_compiler
def test_padding_tokens_skip_the_experts():
    """With a padding mask (`moe_apply(valid=...)`, what a padded prefill or a free decode row passes) the
    kernel gets no assignment for a padding token (its routed output is 0) and the real tokens' outputs are
    those of the unmasked call (to float32 rounding: a token's k expert outputs are summed in the order of the
    experts' first use in the batch) and of the ragged path under the same mask."""
    native, ragged, params = _layers(TOP4)
    x = jax.random.normal(jax.random.key(7), (3, 5, 64))
    valid = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)
    full, _ = moe_apply(params, x, native, capacity_factor=0.0)
    y, aux = moe_apply(params, x, native, capacity_factor=0.0, valid=valid)
    ref, _ = moe_apply(params, x, ragged, capacity_factor=0.0, valid=valid)
    v = np.asarray(valid)
    _close(np.asarray(y)[v], np.asarray(full)[v])
    assert np.all(np.asarray(y)[~v] == 0)
    _close(y, np.asarray(ref))
    assert int(np.sum(aux.dispatch_count)) == 4 * int(v.sum())  # k = 4 assignments per real token
    with pytest.raises(ValueError, match="valid must have shape"):
        moe_apply(params, x, native, capacity_factor=0.0, valid=valid[:, :4])


@needs_compiler
def test_layer_gradients_equal_ragged_path():
    """The native forward with the 'loop' path's VJP: gradients for every parameter (gate included) and the input."""
    native, ragged, params = _layers(DEEPSEEK)
    x = jax.random.normal(jax.random.key(3), (12, 64))

    def loss(config):
        return lambda p, x: jnp.sum(jnp.sin(moe_apply(p, x, config, capacity_factor=0.0)[0]))

    got = jax.jit(jax.grad(loss(native), argnums=(0, 1)))(params, x)
    ref = jax.jit(jax.grad(loss(ragged), argnums=(0, 1)))(params, x)
    got_leaves, ref_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
    assert len(got_leaves) == len(ref_leaves) > 3
    for a, b in zip(got_leaves, ref_leaves):
        _close(a, np.asarray(b))


@needs_compiler
@pytest.mark.parametrize("case", SWIGLU_CASES)
def test_hf_models_with_native_experts(case):
    """Every MoE layer native: logits and greedy tokens of the transformers fixtures; a ragged batch row equals
    the prompt alone."""
    model = from_pretrained(HF / case, dropless_impl="native")
    assert {c.dropless_impl for c in model.moe_configs if c is not None} == {"native"}
    e = dict(np.load(HF / case / "expected.npz"))
    ids = jnp.asarray(e["input_ids"])
    logits = model.apply(model.params, ids, context_from_mask(jnp.ones(ids.shape, bool)))[0]
    np.testing.assert_allclose(np.asarray(logits), e["logits"], **TOL)
    out = generate(model, e["input_ids"], 8, return_logits=True)
    np.testing.assert_array_equal(out.sequences, e["greedy"])
    np.testing.assert_allclose(out.logits, e["greedy_logits"], **TOL)
    mask = np.ones_like(e["input_ids"])
    mask[0, 7:] = 0
    got = generate(model, e["input_ids"], 8, attention_mask=mask, on_device=True)
    alone = generate(model, e["input_ids"][:1, :7], 8)
    np.testing.assert_array_equal(got.tokens[0], alone.tokens[0])
    np.testing.assert_array_equal(got.tokens[1], e["greedy"][1, e["input_ids"].shape[1]:])


@needs_compiler
def test_generate_command_with_native_experts(capsys):
    e = np.load(HF / "qwen3_moe" / "expected.npz")
    argv = ["generate", str(HF / "qwen3_moe"), "--max-new-tokens", "8", "--dropless-impl", "native"]
    for row in e["input_ids"]:
        argv += ["--ids", ",".join(map(str, row))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for b in range(2):
        assert f"prompt {b}: {e['input_ids'][b].tolist()} -> {e['greedy'][b, 12:].tolist()}" in out
    # GPT-OSS experts (clamped SwiGLU with biases) and packed MXFP4 ones run native as well
    for case in ("gpt_oss", "gpt_oss_mxfp4"):
        e = np.load(HF / case / "expected.npz")
        argv = ["generate", str(HF / case), "--max-new-tokens", "8", "--dropless-impl", "native",
                "--ids", ",".join(map(str, e["input_ids"][0]))]
        assert main(argv) == 0
        n = e["input_ids"].shape[1]
        assert f"prompt 0: {e['input_ids'][0].tolist()} -> {e['greedy'][0, n:].tolist()}" in capsys.readouterr().out


@pytest.mark.parametrize("experts, match", [
    ({"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 8},
     "dropless_impl='native' runs SwiGLU (silu) or GPT-OSS experts, float or packed; got FFNExperts"),
    ({"type": "swiglu", "count_per_node": 4, "hidden_size_per_expert": 8, "activation_fn": "gelu"},
     "dropless_impl='native' cannot run SwiGLUExperts with the activation"),
])
def test_unsupported_experts_fail_at_config_time(experts, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make_config(TOP4, 64, experts, dropless_impl="native")


def test_bad_kernel_arguments():
    x, ids, enc, dec, gate, up, down = _inputs(2, *SHAPES["decode"])
    f16 = (a.astype(np.float16) for a in (gate, up, down))
    with pytest.raises(ValueError, match=r"cannot read float16 weights \(float32, bfloat16 or packed only\)"):
        _swiglu(x, ids, enc, dec, *f16)
    with pytest.raises(ValueError, match=r"W1 must map M=64 to 2I=94 outputs \(W2 is \[I=47"):
        _swiglu(x, ids, enc, dec, gate, up, down[:, :, :-1])
    with pytest.raises(ValueError, match=r"expected expert weights \[E=32, out, in\]"):
        _swiglu(x, ids, enc, dec, gate, up, down[:, :, :, None])
    with pytest.raises(ValueError, match=r"must be \[K, S=8\]"):
        _swiglu(x, ids[:, :4], enc, dec, gate, up, down)
    with pytest.raises(ValueError, match="max_workers must be an integer >= 1"):
        _swiglu(x, ids, enc, dec, gate, up, down, max_workers=0)


@needs_compiler
def test_build_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTEL_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_libraries", {})
    build.load("moe_cpu")  # compiled into the new cache
    built = list((tmp_path / "cache").glob("moe_cpu-*.so"))
    assert len(built) == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("a cached library was compiled again"))
    build.load("moe_cpu")
    # another CPU (a home directory shared between machines) gets its own library
    source, cxx = build.SOURCE_DIR / "moe_cpu.cc", build.compiler()
    flags = build._flag_sets(build.isa_in_effect())
    here = build._library_path(source, cxx, flags)
    # another ISA gets its own library
    assert build._library_path(source, cxx, build._flag_sets("portable")) != here
    monkeypatch.setattr(build, "_cpu_fingerprint", lambda: "another cpu")
    assert build._library_path(source, cxx, flags) != here


@needs_compiler
def test_compiler_without_march_native(tmp_path, monkeypatch):
    """A compiler that rejects -march=native: the second try without it builds a working library."""
    fake = tmp_path / "cxx"
    calls = tmp_path / "calls"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                    'for a in "$@"; do [ "$a" = "-march=native" ] && { echo "unknown: $a" >&2; exit 1; }; done\n'
                    f'exec {build.compiler()} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("TUTEL_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_libraries", {})
    assert hasattr(build.load("moe_cpu"), "TutelJaxMoeExperts")
    tries = calls.read_text().splitlines()
    assert len(tries) == 2 and "-march=native" in tries[0] and "-march=native" not in tries[1]


def test_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTEL_JAX_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(NativeKernelError, match="compiling moe_cpu.cc with .*false failed"):
        build.load("moe_cpu")
    assert not (tmp_path / "other").exists() or not list((tmp_path / "other").iterdir())  # nothing half-written
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(NativeKernelError, match="need a C\\+\\+ compiler"):
        build.load("moe_cpu")
