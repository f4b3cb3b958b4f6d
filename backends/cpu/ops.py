"""Element-wise, normalization, rotary and attention kernels of the CPU backend."""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from fastrun.quant.fast import f16_round

_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)


@nb.njit(parallel=True, **_JIT)
def rms_norm(x, weight, eps, out):
    """out [n, d] = x / sqrt(mean(x^2) + eps) * weight; the sum of squares in float64."""
    n, d = x.shape
    for t in nb.prange(n):
        ss = 0.0
        for i in range(d):
            ss += np.float64(x[t, i]) * np.float64(x[t, i])
        scale = np.float32(1.0 / math.sqrt(ss / d + eps))
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
                x = f16_round(g)
                # the sums with 1 widen to float64 (Numba's int + float32); measured against
                # llama.cpp's Gemma 3 logits, this form agrees best of the float32/float64
                # variants tried (they differ only where a value rounds to the next fp16)
                inner = np.float32(0.7978845608028654) * x * (1 + np.float32(0.044715) * x * x)
                gelu = f16_round(np.float32(0.5) * x * (1 + np.tanh(inner)))
            out[t, i] = gelu * up[t, i]


@nb.njit(parallel=True, **_JIT)
def attention(q, k_cache, v_cache, positions, starts, scale, window, softcap, ring, offsets, out):
    """Causal attention over the cache, one (token, head) pair per task, online softmax.

    q [n, h, hd], k_cache/v_cache [c, hk, hd], positions and starts (each query's first cache
    row) int32 [n], out [n, h, hd]; window > 0: only the last `window` positions; softcap >
    0: scores -> softcap * tanh(score / softcap); ring > 0: position p of query t's sequence
    is row starts[t] + (p + offsets[t]) % ring (a sliding-window layer's ring), else
    starts[t] + p. Positions are visited in order either way (the same sums). Memory is
    O(hd) per task: no n x n score matrix, whatever the prompt length.
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
        acc = np.zeros(hd, np.float32)
        m = -np.inf
        total = np.float32(0)
        lo = max(0, positions[t] - window + 1) if window > 0 else 0
        s = starts[t] + (lo if ring <= 0 else (lo + offsets[t]) % ring)
        for _ in range(lo, positions[t] + 1):
            score = _dot_row(qf, k_cache, s, kv) * scale
            if softcap > 0:
                score = softcap * np.float32(math.tanh(score / softcap))
            if score > m:
                rescale = np.float32(np.exp(m - score))
                total *= rescale
                for i in range(hd):
                    acc[i] *= rescale
                m = score
            p = np.float32(np.exp(score - m))
            total += p
            for i in range(hd):
                acc[i] += p * v_cache[s, kv, i]
            s += 1
            if ring > 0 and s == starts[t] + ring:  # the ring's end: on from its first row
                s = starts[t]
        for i in range(hd):
            out[t, j, i] = acc[i] / total
