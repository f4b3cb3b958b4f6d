"""Quantized matrix products on the CPU: raw GGUF weight bytes times quantized activations.

The kernels read weight rows straight from the memory-mapped file (no repacking, no copy);
rowdot.py does the arithmetic of one row against 1 or 4 activation rows, as llama.cpp's
vec_dot kernels do. Shapes: w [n_out, row_bytes] uint8, xq [n, n_in] int8, xd per-block
activation scales, xs fp16-rounded scaled block sums (Q8_1), isum integer block sums (Q8_0)
or 16-value sums (Q8_K), out [n, n_out]. Threads split the output rows; each weight row is
unpacked once per 4 tokens.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.backends.cpu.activations import quantize
from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.rowdot import ROWDOT

drop_stale_cache("matmul", ("rowdot.py", "simd.py", "activations.py"))  # code it inlines

_JIT = dict(nogil=True, cache=True, fastmath=True, boundscheck=False, error_model="numpy")

# Quantized formats of the integer kernel; `fmt` below indexes this tuple.
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_, _Q40_1, _Q40_4 = ROWDOT["Q4_0"]
_, _Q41_1, _Q41_4 = ROWDOT["Q4_1"]
_, _Q50_1, _Q50_4 = ROWDOT["Q5_0"]
_, _Q80_1, _Q80_4 = ROWDOT["Q8_0"]
_, _Q4K_1, _Q4K_4 = ROWDOT["Q4_K"]
_, _Q5K_1, _Q5K_4 = ROWDOT["Q5_K"]
_, _Q6K_1, _Q6K_4 = ROWDOT["Q6_K"]


@nb.njit(inline="always", **_JIT)
def _row1(fmt, row, xq, xd, xs, isum, t, n_blocks):
    if fmt == 0:
        return _Q40_1(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 1:
        return _Q41_1(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 2:
        return _Q50_1(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 3:
        return _Q80_1(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 4:
        return _Q4K_1(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 5:
        return _Q5K_1(row, xq, xd, xs, isum, t, n_blocks)
    return _Q6K_1(row, xq, xd, xs, isum, t, n_blocks)


@nb.njit(inline="always", **_JIT)
def _row4(fmt, row, xq, xd, xs, isum, t, n_blocks):
    if fmt == 0:
        return _Q40_4(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 1:
        return _Q41_4(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 2:
        return _Q50_4(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 3:
        return _Q80_4(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 4:
        return _Q4K_4(row, xq, xd, xs, isum, t, n_blocks)
    if fmt == 5:
        return _Q5K_4(row, xq, xd, xs, isum, t, n_blocks)
    return _Q6K_4(row, xq, xd, xs, isum, t, n_blocks)


@nb.njit(parallel=True, **_JIT)
def matmul_q(w, xq, xd, xs, isum, out, fmt, block_size):
    """Quantized rows of format FORMATS[fmt] times quantized activations."""
    n, n_in = xq.shape
    n_blocks = n_in // block_size
    for o in nb.prange(w.shape[0]):
        row = w[o]
        t = 0
        while t + 4 <= n:
            r = _row4(fmt, row, xq, xd, xs, isum, t, n_blocks)
            out[t, o], out[t + 1, o], out[t + 2, o], out[t + 3, o] = r
            t += 4
        while t < n:
            out[t, o] = _row1(fmt, row, xq, xd, xs, isum, t, n_blocks)
            t += 1


@nb.njit(parallel=True, **_JIT)
def matmul_q_many(ws, fmts, xq, xd, xs, isum, outs, block_size):
    """Several weights (a tuple) of one activation format times the same activations: one
    thread launch for, say, Q, K and V. fmts int64 [len(ws)]; outs a tuple of [n, n_out_i]."""
    n, n_in = xq.shape
    n_blocks = n_in // block_size
    starts = np.zeros(len(ws) + 1, np.int64)  # first global row of each weight
    for i in range(len(ws)):
        starts[i + 1] = starts[i] + ws[i].shape[0]
    for g in nb.prange(starts[len(ws)]):
        i = 0
        while g >= starts[i + 1]:
            i += 1
        o = g - starts[i]
        row = ws[i][o]
        out = outs[i]
        fmt = fmts[i]
        t = 0
        while t + 4 <= n:
            r = _row4(fmt, row, xq, xd, xs, isum, t, n_blocks)
            out[t, o], out[t + 1, o], out[t + 2, o], out[t + 3, o] = r
            t += 4
        while t < n:
            out[t, o] = _row1(fmt, row, xq, xd, xs, isum, t, n_blocks)
            t += 1


@nb.njit(**_JIT)
def qmatmul(w, x, fmt, block_size, q8k):
    """x float32 [n, n_in] times weight rows w of FORMATS[fmt]: quantize, multiply, in one
    call from Python (a decode step makes hundreds of these)."""
    xq, xd, xs, isum = quantize(x, q8k)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    matmul_q(w, xq, xd, xs, isum, out, fmt, block_size)
    return out


@nb.njit(**_JIT)
def qmatmul_many(ws, x, fmts, block_size, q8k):
    """Several weights sharing one activation format: one quantization, one thread launch."""
    xq, xd, xs, isum = quantize(x, q8k)
    outs = [np.empty((x.shape[0], ws[i].shape[0]), np.float32) for i in range(len(ws))]
    matmul_q_many(ws, fmts, xq, xd, xs, isum, outs, block_size)
    return outs


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
