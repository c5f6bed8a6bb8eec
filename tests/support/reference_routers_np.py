"""Float64 NumPy re-implementations of today's MoE routers, experts and blocks, written token by token from the
Hugging Face transformers 5.24 formulas (not from tutel_jax). Every top-k breaks ties towards the lower index."""

from __future__ import annotations

import numpy as np


def order_desc(values) -> list[int]:
    """Indices by descending value, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def softmax(z, axis=-1):
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_topk(logits, k, normalize):
    """Mixtral (normalize=True) / Qwen3-MoE (norm_topk_prob) / Switch (k=1). Returns ids, weights [S, k]."""
    S = logits.shape[0]
    p = softmax(logits)
    ids = np.array([order_desc(p[s])[:k] for s in range(S)])
    w = np.take_along_axis(p, ids, axis=1)
    if normalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w


def topk_softmax(logits, k):
    """GPT-OSS: top-k of the logits, softmax over those k."""
    S = logits.shape[0]
    ids = np.array([order_desc(logits[s])[:k] for s in range(S)])
    return ids, softmax(np.take_along_axis(logits, ids, axis=1))


def sigmoid_group_topk(logits, k, bias, n_group, topk_group, normalize=True, scaling=1.0, mask_value=0.0):
    """DeepSeek-V3: selection on sigmoid + bias inside the best groups (group score = sum of its top-2)."""
    S, E = logits.shape
    gs = E // n_group
    s_all = sigmoid(logits)
    ids, weights = [], []
    for t in range(S):
        b = s_all[t] + (0.0 if bias is None else bias)
        group_scores = [sum(sorted(b[g * gs:(g + 1) * gs], reverse=True)[:2]) for g in range(n_group)]
        keep = set(order_desc(group_scores)[:topk_group])
        masked = [b[e] if e // gs in keep else mask_value for e in range(E)]
        chosen = order_desc(masked)[:k]
        w = s_all[t, chosen]
        if normalize:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        weights.append(w * scaling)
    return np.array(ids), np.array(weights)


def expert_choice(probs, capacity):
    """Each expert's top-C tokens: [E, C] token ids (ties to the lower token)."""
    S, E = probs.shape
    return np.array([order_desc(probs[:, e])[:capacity] for e in range(E)])


def slots(ids_kS, E):
    """Tutel's slots: every first choice before any second, token order within. Returns locations [k, S], counts."""
    k, S = ids_kS.shape
    counts = np.zeros(E, np.int64)
    loc = np.zeros((k, S), np.int64)
    for j in range(k):
        for s in range(S):
            loc[j, s] = counts[ids_kS[j, s]]
            counts[ids_kS[j, s]] += 1
    return loc, counts


def capacity(counts, S, E, k, cf):
    spe = -(-S // E)
    if cf > 0:
        return k * int(cf * spe)
    if cf == 0:
        return int(counts.max())
    return min(int(counts.max()), k * int(-cf * spe))


def swiglu(x, w_gate, w_up, w_down):
    """HF layout: w_gate, w_up [I, M], w_down [M, I]; down(silu(gate(x)) * up(x))."""
    g = x @ w_gate.T
    return ((g * sigmoid(g)) * (x @ w_up.T)) @ w_down.T


def gpt_oss_expert(x, gate_up, gate_up_bias, down, down_bias, alpha=1.702, limit=7.0):
    """GPT-OSS: gate_up [M, 2I] interleaved (gate even, up odd), down [I, M]."""
    h = x @ gate_up + gate_up_bias
    gate, up = h[..., ::2], h[..., 1::2]
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return ((up + 1) * (gate * sigmoid(gate * alpha))) @ down + down_bias


def moe_block(x, ids, weights, expert):
    """y[s] = sum_j weights[s, j] * expert(ids[s, j], x[s]), token by token. ids, weights [S, k]."""
    y = None
    for s in range(x.shape[0]):
        row = sum(weights[s, j] * expert(int(ids[s, j]), x[s:s + 1])[0] for j in range(ids.shape[1]))
        if y is None:
            y = np.zeros((x.shape[0], row.shape[-1]))
        y[s] = row
    return y


def switch_load_loss(probs, ids_Sk):
    S, E = probs.shape
    frac = np.zeros(E)
    for s in range(S):
        for e in ids_Sk[s]:
            frac[e] += 1.0 / S
    return E * float(np.sum(frac * probs.mean(axis=0)))


def z_loss(logits):
    m = logits.max(axis=1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
    return float(np.mean(lse ** 2))


def sequence_aux_loss(probs, ids_Sk, seq_len):
    S, E = probs.shape
    k = ids_Sk.shape[1]
    total = []
    for b in range(S // seq_len):
        rows = range(b * seq_len, (b + 1) * seq_len)
        f = np.zeros(E)
        for s in rows:
            for e in ids_Sk[s]:
                f[e] += E / (k * seq_len)
        P = probs[list(rows)].mean(axis=0)
        total.append(np.sum(f * P))
    return float(np.mean(total))
