"""Quantized matrix products on the CPU: raw GGUF weight bytes times quantized activations.

Each kernel reads the weight rows straight from the memory-mapped file (no repacking, no copy),
multiplies integers per block and applies the block scales, as llama.cpp's vec_dot kernels do.
Shapes: w [n_out, row_bytes] uint8, xq [n, n_in] int8, xd/xs per-block activation scales,
out [n, n_out]. Threads split the output rows; each weight row is reused for all n tokens.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.quant.fast import f16_to_f32

_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)


@nb.njit(parallel=True, **_JIT)
def matmul_q4_0(w, xq, xd, xs, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for b in range(n_in // 32):
                p = b * 18
                s = np.int32(0)
                for j in range(16):
                    q = w[o, p + 2 + j]
                    s += (np.int32(q & 15) - 8) * np.int32(xq[t, b * 32 + j])
                    s += (np.int32(q >> 4) - 8) * np.int32(xq[t, b * 32 + 16 + j])
                acc += f16_to_f32(w[o, p], w[o, p + 1]) * xd[t, b] * np.float32(s)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q4_1(w, xq, xd, xs, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for b in range(n_in // 32):
                p = b * 20
                s = np.int32(0)
                for j in range(16):
                    q = w[o, p + 4 + j]
                    s += np.int32(q & 15) * np.int32(xq[t, b * 32 + j])
                    s += np.int32(q >> 4) * np.int32(xq[t, b * 32 + 16 + j])
                d = f16_to_f32(w[o, p], w[o, p + 1])
                m = f16_to_f32(w[o, p + 2], w[o, p + 3])
                acc += d * xd[t, b] * np.float32(s) + m * xs[t, b]
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q5_0(w, xq, xd, xs, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for b in range(n_in // 32):
                p = b * 22
                qh = np.uint32(w[o, p + 2]) | (np.uint32(w[o, p + 3]) << 8)
                qh |= (np.uint32(w[o, p + 4]) << 16) | (np.uint32(w[o, p + 5]) << 24)
                s = np.int32(0)
                for j in range(16):
                    q = w[o, p + 6 + j]
                    lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
                    hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
                    s += (lo - 16) * np.int32(xq[t, b * 32 + j])
                    s += (hi - 16) * np.int32(xq[t, b * 32 + 16 + j])
                acc += f16_to_f32(w[o, p], w[o, p + 1]) * xd[t, b] * np.float32(s)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q8_0(w, xq, xd, xs, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for b in range(n_in // 32):
                p = b * 34
                s = np.int32(0)
                for j in range(32):
                    s += np.int32(np.int8(w[o, p + 2 + j])) * np.int32(xq[t, b * 32 + j])
                acc += f16_to_f32(w[o, p], w[o, p + 1]) * xd[t, b] * np.float32(s)
            out[t, o] = acc


@nb.njit(inline="always", **_JIT)
def _k_scale_min(w, o, p, j):
    """6-bit scale and min of sub-block j; the 12 scale bytes start at w[o, p]."""
    if j < 4:
        return np.int32(w[o, p + j] & 63), np.int32(w[o, p + j + 4] & 63)
    sc = (w[o, p + j + 4] & 15) | ((w[o, p + j - 4] >> 6) << 4)
    mn = (w[o, p + j + 4] >> 4) | ((w[o, p + j] >> 6) << 4)
    return np.int32(sc), np.int32(mn)


@nb.njit(parallel=True, **_JIT)
def matmul_q45_k(w, xq, xd, bsums, out, block_bytes, fifth_bit):
    """Q4_K (144-byte blocks) and Q5_K (176 bytes, a fifth bit in qh) times Q8_K."""
    n, n_in = xq.shape
    qs_at = 48 if fifth_bit else 16
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for b in range(n_in // 256):
                p = b * block_bytes
                x0 = b * 256
                sum_q = np.int32(0)
                sum_m = np.int32(0)
                for j in range(8):
                    c, shift = j // 2, 4 * (j % 2)
                    sc, mn = _k_scale_min(w, o, p + 4, j)
                    s = np.int32(0)
                    for l in range(32):
                        q = np.int32((w[o, p + qs_at + 32 * c + l] >> shift) & 15)
                        if fifth_bit:
                            q |= np.int32((w[o, p + 16 + l] >> j) & 1) << 4
                        s += q * np.int32(xq[t, x0 + 32 * j + l])
                    sum_q += sc * s
                    sum_m += mn * (bsums[t, b * 16 + 2 * j] + bsums[t, b * 16 + 2 * j + 1])
                d = f16_to_f32(w[o, p], w[o, p + 1]) * xd[t, b]
                dmin = f16_to_f32(w[o, p + 2], w[o, p + 3]) * xd[t, b]
                acc += d * np.float32(sum_q) - dmin * np.float32(sum_m)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q6_k(w, xq, xd, bsums, out):
    """Q6_K (210-byte blocks: ql[128], qh[64], int8 scales[16], d) times Q8_K."""
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for b in range(n_in // 256):
                p = b * 210
                total = np.int32(0)
                for half in range(2):
                    ql = p + 64 * half
                    qh = p + 128 + 32 * half
                    y = b * 256 + 128 * half
                    for quarter in range(4):
                        lo_at = ql + (32 if quarter % 2 else 0)
                        lo_shift = 4 if quarter >= 2 else 0
                        hi_shift = 2 * quarter
                        for g in range(2):  # two 16-value groups, each with its own scale
                            s = np.int32(0)
                            for l in range(16 * g, 16 * g + 16):
                                q = np.int32((w[o, lo_at + l] >> lo_shift) & 15)
                                q |= np.int32((w[o, qh + l] >> hi_shift) & 3) << 4
                                s += (q - 32) * np.int32(xq[t, y + 32 * quarter + l])
                            sc = np.int32(np.int8(w[o, p + 192 + 8 * half + 2 * quarter + g]))
                            total += sc * s
                acc += f16_to_f32(w[o, p + 208], w[o, p + 209]) * xd[t, b] * np.float32(total)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_f32(w, x, out):
    """w float32 [n_out, n_in] times x [n, n_in]; fp16 weights arrive already widened."""
    n, n_in = x.shape
    for o in nb.prange(w.shape[0]):
        for t in range(n):
            acc = np.float32(0)
            for i in range(n_in):
                acc += w[o, i] * x[t, i]
            out[t, o] = acc
