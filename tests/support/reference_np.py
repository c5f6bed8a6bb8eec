"""An independent float64 NumPy re-implementation of Tutel's MoE layer, written loop-by-loop from the
semantics (not from tutel_jax), used as the oracle for cases the Tutel fixtures do not cover."""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr  # normal CDF


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def top_logits(x: np.ndarray, wg: np.ndarray) -> np.ndarray:
    return x @ wg.T


def cosine_logits(x, proj_w, proj_b, sim, temperature) -> np.ndarray:
    proj = x @ proj_w.T + proj_b
    proj = proj / np.maximum(np.linalg.norm(proj, axis=1, keepdims=True), 1e-12)
    sim = sim / np.maximum(np.linalg.norm(sim, axis=0, keepdims=True), 1e-12)
    return (proj @ sim) * np.exp(min(float(temperature[0]), math.log(100.0)))


def route(scores: np.ndarray, k: int, cf: float, *, batch_prioritized=False, normalize_gate=True, alignment=1):
    """Returns ids [k,S], locations [k,S], gates [k,S], counts [E], capacity (int)."""
    S, E = scores.shape
    k = min(k, E)
    ids = np.zeros((k, S), np.int64)
    for s in range(S):
        order = sorted(range(E), key=lambda e: (-scores[s, e], e))  # descending, ties to the lower index
        ids[:, s] = order[:k]
    gates = np.take_along_axis(scores.T, ids, axis=0).astype(np.float64)
    if batch_prioritized:
        placement = sorted(range(S), key=lambda s: (-scores[s].max(), s))
    else:
        placement = list(range(S))
    counts = np.zeros(E, np.int64)
    locations = np.zeros((k, S), np.int64)
    for j in range(k):  # every first choice before any second choice
        for s in placement:
            e = ids[j, s]
            locations[j, s] = counts[e]
            counts[e] += 1
    if k > 1 and normalize_gate:
        denom = np.maximum(gates.sum(axis=0, keepdims=True), np.finfo(np.float32).eps)
        gates = gates / denom
    spe = -(-S // E)
    if cf > 0:
        cap = k * int(cf * spe)
    elif cf == 0:
        cap = int(counts.max())
    else:
        cap = min(int(counts.max()), k * int(-cf * spe))
    a = 128 if alignment > 256 else alignment
    cap = -(-cap // a) * a
    return ids, locations, gates, counts, cap


def encode(x, ids, locations, weights, E, C):
    D = np.zeros((E, C, x.shape[1]))
    k, S = ids.shape
    for j in range(k):
        for s in range(S):
            if locations[j, s] < C:
                D[ids[j, s], locations[j, s]] = weights[j, s] * x[s]
    return D


def decode(O, ids, locations, weights):
    k, S = ids.shape
    C = O.shape[1]
    y = np.zeros((S, O.shape[2]))
    for s in range(S):
        for j in range(k):
            if locations[j, s] < C:
                y[s] += weights[j, s] * O[ids[j, s], locations[j, s]]
    return y


def ffn(D, w1, b1, w2, b2, act=lambda h: np.maximum(h, 0.0)):
    h = np.einsum("ecm,ehm->ech", D, w1)
    if b1 is not None:
        h = h + b1[:, None, :]
    y = np.einsum("ech,ehm->ecm", act(h), w2)
    if b2 is not None:
        y = y + b2[:, None, :]
    return y


def gshard_loss(scores, first_ids):
    S, E = scores.shape
    frac = np.bincount(first_ids, minlength=E) / S
    return E * np.sum(scores.mean(axis=0) * frac)


def cv2(v):
    return np.var(v, ddof=1) / (np.mean(v) ** 2 + 1e-10)


def load_importance_loss(clean_scores, noisy_top_logits, E, gate_noise):
    importance = cv2(clean_scores.sum(axis=0))
    threshold = noisy_top_logits[:, -1:]
    load = cv2(ndtr((clean_scores - threshold) / (gate_noise / E)).sum(axis=0))
    return (importance + load) / 2


def layer(x, params, k, cf, *, is_postscore=True, batch_prioritized=False, normalize_gate=True, logits=None):
    """Whole layer in float64 with a `top` gate (or given logits). Returns y [S, M], l_aux (GShard), plan."""
    x = np.asarray(x, np.float64)
    if logits is None:
        logits = top_logits(x, np.asarray(params["wg"], np.float64))
    scores = softmax(logits)
    ids, loc, gates, counts, cap = route(scores, k, cf, batch_prioritized=batch_prioritized,
                                         normalize_gate=normalize_gate)
    E = scores.shape[1]
    enc_w = np.ones_like(gates) if is_postscore else gates
    dec_w = gates if is_postscore else np.ones_like(gates)
    D = encode(x, ids, loc, enc_w, E, cap)
    O = ffn(D, *(np.asarray(params[n], np.float64) if params.get(n) is not None else None
                 for n in ("batched_fc1_w", "batched_fc1_bias", "batched_fc2_w", "batched_fc2_bias")))
    y = decode(O, ids, loc, dec_w)
    return y, gshard_loss(scores, ids[0]), (ids, loc, gates, counts, cap)
