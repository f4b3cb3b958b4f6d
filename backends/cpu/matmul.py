"""Quantized matrix products on the CPU: raw GGUF weight bytes times quantized activations.

Each kernel reads the weight rows straight from the memory-mapped file (no repacking, no copy)
and, per block, takes the integer dot product with the int8 activations (simd.py) and applies
the scales, as llama.cpp's vec_dot kernels do. Shapes: w [n_out, row_bytes] uint8, xq
[n, n_in] int8, xd per-block activation scales, xs fp16-rounded scaled block sums (Q8_1),
isum integer block sums (Q8_0) or 16-value sums (Q8_K), out [n, n_out]. Threads split the
output rows; each weight row is reused for all n tokens while it is in L1.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.backends.cpu.simd import (
    dot_k4_32,
    dot_k5_32,
    dot_k6_16,
    dot_q4_32,
    dot_q5_32,
    dot_q8_32,
    load_f16,
)

_JIT = dict(nogil=True, cache=True, fastmath=True, boundscheck=False, error_model="numpy")


@nb.njit(parallel=True, **_JIT)
def matmul_q4_0(w, xq, xd, xs, isum, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        row = w[o]
        for t in range(n):
            x = xq[t]
            acc = np.float32(0)
            for b in range(n_in // 32):
                s = dot_q4_32(row, b * 18 + 2, x, b * 32) - 8 * isum[t, b]  # nibbles are q + 8
                acc += load_f16(row, b * 18) * xd[t, b] * np.float32(s)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q4_1(w, xq, xd, xs, isum, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        row = w[o]
        for t in range(n):
            x = xq[t]
            acc = np.float32(0)
            for b in range(n_in // 32):
                p = b * 20
                s = dot_q4_32(row, p + 4, x, b * 32)
                acc += load_f16(row, p) * xd[t, b] * np.float32(s) + load_f16(row, p + 2) * xs[t, b]
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q5_0(w, xq, xd, xs, isum, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        row = w[o]
        for t in range(n):
            x = xq[t]
            acc = np.float32(0)
            for b in range(n_in // 32):
                p = b * 22
                s = dot_q5_32(row, p + 6, p + 2, x, b * 32) - 16 * isum[t, b]  # values are q + 16
                acc += load_f16(row, p) * xd[t, b] * np.float32(s)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q8_0(w, xq, xd, xs, isum, out):
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        row = w[o]
        for t in range(n):
            x = xq[t]
            acc = np.float32(0)
            for b in range(n_in // 32):
                s = dot_q8_32(row, b * 34 + 2, x, b * 32)
                acc += load_f16(row, b * 34) * xd[t, b] * np.float32(s)
            out[t, o] = acc


@nb.njit(inline="always", **_JIT)
def _k_scale_min(row, p, j):
    """6-bit scale and min of sub-block j; the 12 scale bytes start at row[p]."""
    if j < 4:
        return np.int32(row[p + j] & 63), np.int32(row[p + j + 4] & 63)
    sc = (row[p + j + 4] & 15) | ((row[p + j - 4] >> 6) << 4)
    mn = (row[p + j + 4] >> 4) | ((row[p + j] >> 6) << 4)
    return np.int32(sc), np.int32(mn)


@nb.njit(parallel=True, **_JIT)
def matmul_q45_k(w, xq, xd, bsums, out, block_bytes, fifth_bit):
    """Q4_K (144-byte blocks) and Q5_K (176 bytes, a fifth bit in qh) times Q8_K."""
    n, n_in = xq.shape
    qs_at = 48 if fifth_bit else 16
    for o in nb.prange(w.shape[0]):
        row = w[o]
        for t in range(n):
            x = xq[t]
            acc = np.float32(0)
            for b in range(n_in // 256):
                p = b * block_bytes
                sum_q = np.int32(0)
                sum_m = np.int32(0)
                for j in range(8):
                    sc, mn = _k_scale_min(row, p + 4, j)
                    at = p + qs_at + 32 * (j // 2)
                    if fifth_bit:
                        s = dot_k5_32(row, at, 4 * (j % 2), p + 16, j, x, b * 256 + 32 * j)
                    else:
                        s = dot_k4_32(row, at, 4 * (j % 2), x, b * 256 + 32 * j)
                    sum_q += sc * s
                    sum_m += mn * (bsums[t, b * 16 + 2 * j] + bsums[t, b * 16 + 2 * j + 1])
                scale = xd[t, b]
                acc += load_f16(row, p) * scale * np.float32(sum_q)
                acc -= load_f16(row, p + 2) * scale * np.float32(sum_m)
            out[t, o] = acc


@nb.njit(parallel=True, **_JIT)
def matmul_q6_k(w, xq, xd, bsums, out):
    """Q6_K (210-byte blocks: ql[128], qh[64], int8 scales[16], d) times Q8_K."""
    n, n_in = xq.shape
    for o in nb.prange(w.shape[0]):
        row = w[o]
        for t in range(n):
            x = xq[t]
            acc = np.float32(0)
            for b in range(n_in // 256):
                p = b * 210
                total = np.int32(0)
                for half in range(2):
                    for quarter in range(4):
                        lo_at = p + 64 * half + (32 if quarter % 2 else 0)
                        lo_shift = 4 if quarter >= 2 else 0
                        for g in range(2):  # two 16-value groups, each with its own scale
                            y = b * 256 + 128 * half + 32 * quarter + 16 * g
                            s = dot_k6_16(
                                row, lo_at + 16 * g, lo_shift, p + 128 + 32 * half + 16 * g,
                                2 * quarter, x, y,
                            )  # fmt: skip
                            s -= 32 * bsums[t, y // 16]  # stored values are q + 32
                            sc = np.int32(np.int8(row[p + 192 + 8 * half + 2 * quarter + g]))
                            total += sc * s
                acc += load_f16(row, p + 208) * xd[t, b] * np.float32(total)
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
