"""Element-wise, normalization, rotary and attention kernels of the CPU backend."""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from fastrun.quant.fast import f16_round

_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)


@nb.njit(parallel=True, **_JIT)
def rms_norm(x, weight, eps, out):
    """out [n, d] = x / sqrt(mean(x^2) + eps) * weight, rounded where llama.cpp's ggml rounds:
    each square in float32, summed in float64; the mean, mean + eps and the scale in float32.
    (A float64 scale differs from it by an ulp for about half the rows; Gemma 3's logits move
    by up to ~0.1 nats from that alone.)"""
    n, d = x.shape
    eps32 = np.float32(eps)
    for t in nb.prange(n):
        ss = 0.0
        for i in range(d):
            ss += np.float64(x[t, i] * x[t, i])
        mean = np.float32(ss / d)
        scale = np.float32(1) / np.float32(math.sqrt(mean + eps32))
        for i in range(d):
            out[t, i] = (x[t, i] * scale) * weight[i]


@nb.njit(parallel=True, **_JIT)
def rope(x, positions, n_dims, freq_base, freq_scale, neox, freq_factors):
    """Rotate x [n, heads, hd] in place; theta = pos * base^(-2i/n_dims) as llama.cpp's float32
    recurrence computes it; freq_factors [n_dims/2] divides theta when non-empty."""
    n, heads, _ = x.shape
    half = n_dims // 2
    theta_scale = np.float32(freq_base) ** np.float32(-2.0 / n_dims)
    for t in nb.prange(n):
        cos = np.empty(half, np.float32)
        sin = np.empty(half, np.float32)
        power = np.float32(1)
        for i in range(half):
            theta = np.float32(positions[t]) * power
            if freq_factors.size:
                theta = theta / freq_factors[i]
            theta = theta * np.float32(freq_scale)
            cos[i] = math.cos(theta)
            sin[i] = math.sin(theta)
            power = power * theta_scale
        for h in range(heads):
            for i in range(half):
                a_at, b_at = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a = x[t, h, a_at]
                b = x[t, h, b_at]
                x[t, h, a_at] = a * cos[i] - b * sin[i]
                x[t, h, b_at] = a * sin[i] + b * cos[i]


@nb.njit(**_JIT)
def kv_store(k_cache, v_cache, k, v, slots):
    """k, v [n, hk, hd] into cache rows `slots`, rounded to fp16 as llama.cpp's f16 cache."""
    n, hk, hd = k.shape
    for t in range(n):
        s = slots[t]
        for h in range(hk):
            for i in range(hd):
                k_cache[s, h, i] = f16_round(k[t, h, i])
                v_cache[s, h, i] = f16_round(v[t, h, i])


@nb.njit(parallel=True, **_JIT)
def silu_mul(gate, up, out):
    n, f = gate.shape
    for t in nb.prange(n):
        for i in range(f):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1) + np.exp(-g)) * up[t, i]


@nb.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _dot_row(qf, k_cache, s, kv):
    """q . k of cache row s: reassociated so that it vectorizes (neither order is llama.cpp's
    fp16 SIMD one, and this one is the same at any thread count)."""
    dot = np.float32(0)
    for i in range(qf.size):
        dot += qf[i] * k_cache[s, kv, i]
    return dot


@nb.njit(parallel=True, **_JIT)
def gelu_mul(gate, up, out):
    """out = gelu(gate) * up as llama.cpp's geglu: gate rounded to fp16, gelu (tanh form, in
    float32) rounded to fp16 as its lookup table holds it; 0 from -10 down, gate from 10 up."""
    n, f = gate.shape
    for t in nb.prange(n):
        for i in range(f):
            g = gate[t, i]
            if g <= np.float32(-10):
                gelu = np.float32(0)
            elif g >= np.float32(10):
                gelu = g
            else:
                # as reference.gelu_tanh: llama.cpp's table entry, bit for bit
                x = f16_round(g)
                ax = np.float32(0.044715) * x
                poly = np.float32(np.float64(ax) * np.float64(x) + 1.0)  # fma(a*x, x, 1)
                inner = np.float32(0.7978845608028654) * x * poly
                tanh = np.float32(np.tanh(np.float64(inner)))
                gelu = f16_round(np.float32(0.5) * x * (np.float32(1) + tanh))
            out[t, i] = gelu * up[t, i]


@nb.njit(inline="always", **_JIT)
def _next_row(s, start, ring):
    """The cache row after row s: the next one, or on a ring (ring > 0 rows from start) its
    first one after its last."""
    s += 1
    if ring > 0 and s == start + ring:
        s = start
    return s


@nb.njit(parallel=True, **_JIT)
def attention(q, k_cache, v_cache, positions, starts, scale, window, softcap, ring, offsets, out):
    """Causal attention over the cache, one (token, head) pair per task.

    q [n, h, hd], k_cache/v_cache [c, hk, hd], positions and starts (each query's first cache
    row) int32 [n], out [n, h, hd]; window > 0: only the last `window` positions; softcap >
    0: scores -> softcap * tanh(score / softcap); ring > 0: position p of query t's sequence
    is row starts[t] + (p + offsets[t]) % ring (a sliding-window layer's ring), else
    starts[t] + p, positions visited in order either way (the same sums). A two-pass
    softmax rounded as llama.cpp's graph rounds it: exponentials summed in float64, the
    probabilities normalized in float32 and rounded to fp16 (it multiplies them by the fp16
    V cache), never renormalized. Memory is one score per key per task: no n x n matrix,
    whatever the prompt length.
    """
    n, h, hd = q.shape
    group = h // k_cache.shape[1]
    for task in nb.prange(n * h):
        t = task // h
        j = task % h
        kv = j // group
        qf = np.empty(hd, np.float32)
        for i in range(hd):
            qf[i] = f16_round(q[t, j, i])  # llama.cpp multiplies fp16 K by fp16 Q
        lo = max(0, positions[t] - window + 1) if window > 0 else 0
        first = starts[t] + (lo if ring <= 0 else (lo + offsets[t]) % ring)  # row of lo
        scores = np.empty(positions[t] - lo + 1, np.float32)
        m = -np.inf
        s = first
        for at in range(scores.size):
            score = _dot_row(qf, k_cache, s, kv) * scale
            if softcap > 0:
                score = softcap * np.float32(math.tanh(score / softcap))
            scores[at] = score
            m = max(m, score)
            s = _next_row(s, starts[t], ring)
        total = 0.0
        for i in range(scores.size):
            e = np.float32(np.exp(scores[i] - m))
            scores[i] = e
            total += np.float64(e)
        inv = np.float32(1.0 / total)
        acc = np.zeros(hd, np.float32)
        s = first
        for at in range(scores.size):
            p = f16_round(scores[at] * inv)
            for i in range(hd):
                acc[i] += p * v_cache[s, kv, i]
            s = _next_row(s, starts[t], ring)
        for i in range(hd):
            out[t, j, i] = acc[i]
