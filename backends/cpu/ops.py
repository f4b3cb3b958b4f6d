"""Element-wise, normalization, rotary and attention kernels of the CPU backend.

The element-wise and norm kernels split their rows over the threads only from PARALLEL_ROWS
rows on (prefill): at decode a token's share is microseconds beside its products, and a
parallel loop's thread launch and barrier at every call cost more than they save. RoPE runs on
one thread (its work is a few heads a token); attention and the products are parallel."""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.simd import (
    FMA_HEADS_64,
    FMA_HEADS_128,
    dot_lanes,
    f16_round,
    fma32,
    fma_rows_64,
    fma_rows_128,
    fma_rows_256,
    fma_rows_heads_64,
    fma_rows_heads_128,
    pow2_f64,
)
from fastrun.backends.llamacpp_numerics import (
    EXPF_LIMIT,
    EXPF_LN2_HI,
    EXPF_LN2_LO,
    EXPF_LOG2E,
    EXPF_POLY,
    EXPF_ROUNDER,
    LANES,
)

drop_stale_cache("ops", ("simd.py", "../llamacpp_numerics.py"))  # code, constants it inlines

_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)
# Rows from which the element-wise and norm kernels run in parallel (Gemma-3-270M's pp256 lost
# a third of its speed with GELU, RMSNorm and the activation quantization on one thread)
PARALLEL_ROWS = 16


@nb.njit(inline="always", **_JIT)
def _rms_norm_row(x, weight, eps32, out, t):
    d = x.shape[1]
    ss = 0.0
    for i in range(d):
        ss += np.float64(x[t, i] * x[t, i])
    mean = np.float32(ss / d)
    scale = np.float32(1) / np.float32(math.sqrt(mean + eps32))
    for i in range(d):
        out[t, i] = (x[t, i] * scale) * weight[i]


@nb.njit(parallel=True, **_JIT)
def rms_norm(x, weight, eps, out):
    """out [n, d] = x / sqrt(mean(x^2) + eps) * weight, rounded where llama.cpp's ggml rounds:
    each square in float32, summed in float64; the mean, mean + eps and the scale in float32.
    (A float64 scale differs from it by an ulp for about half the rows; Gemma 3's logits move
    by up to ~0.1 nats from that alone.)"""
    n = x.shape[0]
    eps32 = np.float32(eps)
    if n < PARALLEL_ROWS:
        for t in range(n):
            _rms_norm_row(x, weight, eps32, out, t)
    else:
        for t in nb.prange(n):
            _rms_norm_row(x, weight, eps32, out, t)


@nb.njit(**_JIT)
def rope(x, positions, n_dims, freq_base, freq_scale, neox, freq_factors):
    """Rotate x [n, heads, hd] in place as llama.cpp does, bit for bit: theta of pair i is pos
    times base^(-2/n_dims), i times, each product rounded to float32 (its cache recurrence),
    divided by freq_factors[i] when given and times freq_scale; cos and sin from libm; each
    rotated value one fused multiply-add, x0's product fused (GCC contracts ggml's
    `x0*cos - x1*sin` and `x0*sin + x1*cos` so)."""
    n, heads, _ = x.shape
    half = n_dims // 2
    theta_scale = np.float32(freq_base) ** np.float32(-2.0 / n_dims)
    for t in range(n):
        cos = np.empty(half, np.float32)
        sin = np.empty(half, np.float32)
        theta_base = np.float32(positions[t])
        for i in range(half):
            theta = theta_base
            if freq_factors.size:
                theta = theta / freq_factors[i]
            theta = np.float32(freq_scale) * theta
            cos[i] = math.cos(theta)
            sin[i] = math.sin(theta)
            theta_base = theta_base * theta_scale
        for h in range(heads):
            for i in range(half):
                a_at, b_at = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a = x[t, h, a_at]
                b = x[t, h, b_at]
                x[t, h, a_at] = fma32(a, cos[i], -(b * sin[i]))
                x[t, h, b_at] = fma32(a, sin[i], b * cos[i])


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


# ggml's vector expf, which llama.cpp's softmax and SiLU compute with (its constants and
# form: backends/llamacpp_numerics.py): at most 1.5 ulp from exp, so its own bits are what
# llama.cpp gets, and, without a call per value, a loop of it vectorizes.


@nb.njit(**_JIT)
def expf_ggml(x):
    """exp(x) in float32 as ggml_v_expf computes it, bit for bit (its fused multiply-adds
    as such; its scalef, j * 2^n, an exact float64 product rounded once)."""
    c5, c4, c3, c2, c1 = EXPF_POLY
    z = fma32(x, EXPF_LOG2E, EXPF_ROUNDER)
    n = z - EXPF_ROUNDER
    b = fma32(-n, EXPF_LN2_LO, fma32(-n, EXPF_LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(c5, b, c4), u, fma32(c3, b, c2)), u, fma32(c1, b, np.float32(1)))
    k = min(max(n, -EXPF_LIMIT), EXPF_LIMIT)  # in range for the exponent bits (NaN: the limit)
    scaled = np.float32(np.float64(j) * pow2_f64(np.int64(k)))
    if abs(n) > EXPF_LIMIT:
        return np.float32(0) if n <= 0 else np.float32(np.inf)
    return scaled


@nb.njit(inline="always", **_JIT)
def _silu_row(gate, up, out, t):
    for i in range(gate.shape[1]):
        g = gate[t, i]
        out[t, i] = g / (np.float32(1) + expf_ggml(-g)) * up[t, i]  # ggml_v_silu


@nb.njit(parallel=True, **_JIT)
def silu_mul(gate, up, out):
    n = gate.shape[0]
    if n < PARALLEL_ROWS:
        for t in range(n):
            _silu_row(gate, up, out, t)
    else:
        for t in nb.prange(n):
            _silu_row(gate, up, out, t)


@nb.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _dot_row(qf, k_cache, s, kv):
    """q . k of cache row s: reassociated so that it vectorizes (neither order is llama.cpp's
    fp16 SIMD one, and this one is the same at any thread count)."""
    dot = np.float32(0)
    for i in range(qf.size):
        dot += qf[i] * k_cache[s, kv, i]
    return dot


@nb.njit(inline="always", **_JIT)
def _gelu_row(gate, up, out, t):
    for i in range(gate.shape[1]):
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


@nb.njit(parallel=True, **_JIT)
def gelu_mul(gate, up, out):
    """out = gelu(gate) * up as llama.cpp's geglu: gate rounded to fp16, gelu (tanh form, in
    float32) rounded to fp16 as its lookup table holds it; 0 from -10 down, gate from 10 up."""
    n = gate.shape[0]
    if n < PARALLEL_ROWS:
        for t in range(n):
            _gelu_row(gate, up, out, t)
    else:
        for t in nb.prange(n):
            _gelu_row(gate, up, out, t)


@nb.njit(inline="always", **_JIT)
def _next_row(s, start, ring):
    """The cache row after row s: the next one, or on a ring (ring > 0 rows from start) its
    first one after its last."""
    s += 1
    if ring > 0 and s == start + ring:
        s = start
    return s


@nb.njit(inline="always", **_JIT)
def _balanced_token(i, n):
    """The token of task row i of n: 0, n-1, 1, n-2, ... A causal prefill's token t reads
    t + 1 keys; so each contiguous share of the rows that a parallel loop hands a thread
    holds short and long ones alike (token order gave one of two threads 3/4 of the work)."""
    return i // 2 if i % 2 == 0 else n - 1 - i // 2


@nb.njit(parallel=True, **_JIT)
def attention(
    q, k_cache, v_cache, positions, starts, scale, window, softcap, ring, offsets, threads, out
):
    """Causal attention over the cache, one (token, KV head) pair per task: its query heads
    share each key and value row read (dot_lanes, fma_rows_heads_*); one (token, head) a
    task only where the pairs would leave some of the `threads` idle (threads: how many the
    parallel loop runs on; numba.get_num_threads() in here would keep the kernel out of
    Numba's cache).

    q [n, h, hd], k_cache/v_cache [c, hk, hd], positions and starts (each query's first cache
    row) int32 [n], out [n, h, hd]; window > 0: only the last `window` positions; softcap >
    0: scores -> softcap * tanh(score / softcap); ring > 0: position p of query t's sequence
    is row starts[t] + (p + offsets[t]) % ring (a sliding-window layer's ring), else
    starts[t] + p, positions visited in order either way (the same sums). A two-pass
    softmax rounded as llama.cpp's graph rounds it: exponentials summed in float64, the
    probabilities normalized in float32 and rounded to fp16 (it multiplies them by the fp16
    V cache), never renormalized. Each head's arithmetic is the same whatever the batch.
    Memory is one score per key per head: no n x n matrix, whatever the prompt length.
    """
    n, h, hd = q.shape
    # Qwen2.5-1.5B's decode attention at 512 cached tokens, 2 threads, 28 layers: 5.1 ms one
    # head a task, 3.3 the heads of a KV head, 2.8 with their dot products interleaved and
    # their V rows shared
    group = h // k_cache.shape[1] if n * k_cache.shape[1] >= threads else 1
    n_groups = h // group
    for task in nb.prange(n * n_groups):
        t = _balanced_token(task // n_groups, n)
        head0 = (task % n_groups) * group  # its first query head
        kv = head0 // (h // k_cache.shape[1])
        qf = np.empty((group, hd), np.float32)
        for g in range(group):
            for i in range(hd):
                qf[g, i] = f16_round(q[t, head0 + g, i])  # fp16 K times fp16 Q
        lo = max(0, positions[t] - window + 1) if window > 0 else 0
        first = starts[t] + (lo if ring <= 0 else (lo + offsets[t]) % ring)  # row of lo
        length = positions[t] - lo + 1
        scores = np.empty((group, length), np.float32)
        m = np.full(group, -np.inf, np.float32)
        dots = np.empty(group, np.float32)
        s = first
        for at in range(length):
            if hd % LANES == 0:
                dot_lanes(qf, k_cache, s, kv, dots)
            else:  # tinyBLAS takes no such K: ggml's own fp16 dot (another order)
                for g in range(group):
                    dots[g] = _dot_row(qf[g], k_cache, s, kv)
            for g in range(group):
                score = dots[g] * scale
                if softcap > 0:
                    score = softcap * np.float32(math.tanh(score / softcap))
                scores[g, at] = score
                m[g] = max(m[g], score)
            s = _next_row(s, starts[t], ring)
        lanes = np.empty((group, LANES, hd), np.float32)
        for g in range(group):
            inv = np.float32(1.0 / _exps_and_sum(scores[g], m[g], lo, lanes[g]))
            for at in range(length):
                scores[g, at] = f16_round(scores[g, at] * inv)
        _weighted_lanes(scores, lo, v_cache, first, starts[t], ring, kv, lanes)
        for g in range(group):
            for i in range(hd):
                out[t, head0 + g, i] = _lane_tree(lanes[g], i)


@nb.njit(**_JIT)
def _exps_and_sum(row, m, first, lanes):
    """row: the scores of positions first, first + 1, ... -> exp(score - m) each, in place;
    returns their sum as llama.cpp's AVX-512 softmax adds them up over its KV cells (a cell
    per position, from 0): each 16 positions' float32 sum in its vector reduction's order
    (_lane_tree), those added in order in float64. Positions outside the row count 0.
    lanes: scratch, [16, >= 1]."""
    length = row.size
    for i in range(length):
        row[i] = expf_ggml(row[i] - m)
    total = 0.0
    for start in range(first - first % LANES, first + length, LANES):
        for lane in range(LANES):
            at = start + lane - first
            lanes[lane, 0] = row[at] if 0 <= at < length else np.float32(0)
        total += np.float64(_lane_tree(lanes, 0))
    return total


@nb.njit(**_JIT)
def _weighted_lanes(probs, first, v_cache, row, start, ring, kv, lanes):
    """lanes [G, 16, hd] = for each query head g of one KV head, the sums over its row of
    probs[g, at] * v_cache[row of position first + at, kv] as llama.cpp's tinyBLAS
    multiplies its fp16 probabilities by the fp16 V cache on AVX-512: lane j the fused
    multiply-add chain over the positions p = j (mod 16), in order; the rows from row on, to
    the end of a ring of `ring` rows from start and on from its start (ring 0: no ring). The
    sum of a head's lanes is each output's (_lane_tree)."""
    lanes[:] = 0
    length = probs.shape[1]
    run = min(length, start + ring - row) if ring > 0 else length  # rows before the wrap
    _lane_run(probs, 0, run, first, v_cache, row, kv, lanes)
    _lane_run(probs, run, length - run, first + run, v_cache, start, kv, lanes)


@nb.njit(**_JIT)
def _lane_run(probs, at0, n, position, v_cache, row0, kv, lanes):
    """_weighted_lanes over n consecutive rows from row0: probs[:, at0:], positions from
    `position` on. The heads share each V row's loads in groups of FMA_HEADS_* where the head
    size has such a kernel (64, 128), the rest one by one."""
    group, _, hd = lanes.shape
    together = FMA_HEADS_128 if hd == 128 else FMA_HEADS_64 if hd == 64 else 1
    whole = group - group % together if together > 1 else 0  # heads the shared kernels take
    for lane in range(LANES):
        skip = (lane - position) % LANES  # the run's first row of this lane
        if skip >= n:
            continue
        count = (n - skip + LANES - 1) // LANES
        at, row, step = np.int64(at0 + skip), np.int64(row0 + skip), np.int64(LANES)
        args = (np.int64(count), step, np.int64(kv))
        for g0 in range(0, whole, together):
            if hd == 128:
                fma_rows_heads_128(probs, at, v_cache, row, *args, np.int64(0), lanes,
                                   np.int64(lane), np.int64(g0))  # fmt: skip
            else:
                fma_rows_heads_64(probs, at, v_cache, row, *args, np.int64(0), lanes,
                                  np.int64(lane), np.int64(g0))  # fmt: skip
        for g in range(whole, group):  # one by one
            col0, g_ = np.int64(0), np.int64(g)
            if hd == 128:
                fma_rows_128(probs, at, v_cache, row, *args, col0, lanes, np.int64(lane), g_)
            elif hd == 256:
                fma_rows_256(probs, at, v_cache, row, *args, col0, lanes, np.int64(lane), g_)
            elif hd % 64 == 0:  # 64, or 64 columns at a time
                for col in range(0, hd, 64):
                    fma_rows_64(probs, at, v_cache, row, *args, np.int64(col), lanes,
                                np.int64(lane), g_)  # fmt: skip
            else:
                for r in range(count):
                    p = probs[g, at + r * LANES]
                    for i in range(hd):
                        lanes[g, lane, i] = fma32(
                            v_cache[row + r * LANES, kv, i], p, lanes[g, lane, i]
                        )


@nb.njit(inline="always", **_JIT)
def _lane_tree(lanes, i):
    """The sum of lanes[0..15, i] as _mm512_reduce_add_ps adds 16 lanes (simd.lane_tree)."""
    a0, a1 = lanes[8, i] + lanes[0, i], lanes[9, i] + lanes[1, i]
    a2, a3 = lanes[10, i] + lanes[2, i], lanes[11, i] + lanes[3, i]
    a4, a5 = lanes[12, i] + lanes[4, i], lanes[13, i] + lanes[5, i]
    a6, a7 = lanes[14, i] + lanes[6, i], lanes[15, i] + lanes[7, i]
    return ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))
