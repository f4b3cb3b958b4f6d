"""Quantized matrix products on the CPU: weight bytes times quantized activations.

Weights arrive repacked at load into tiles of 8 rows (tiles.py, as llama.cpp's repacked
kernels). Shapes: w [tiles, tile bytes] uint8, xq [n, n_in] int8, xd
per-block activation scales, xs fp16-rounded scaled block sums (Q8_1), isum integer block
sums (Q8_0) or 16-value sums (Q8_K), out [n, n_out] (n_out a multiple of 8 for tiles: rows
past a weight's own are zero padding, which the backend slices off). Threads split the
tiles; each weight vector is unpacked once per 4 tokens.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.backends.cpu.activations import quantize
from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.tiles import TILE_FORMATS, TILE_PRODUCTS, TILE_ROWS

drop_stale_cache("matmul", ("simd.py", "tiles.py", "activations.py"))  # code it inlines

_JIT = dict(nogil=True, cache=True, fastmath=True, boundscheck=False, error_model="numpy")

# Quantized formats of the integer kernel, each multiplied as repacked tiles of 8 rows
# (tiles.py); `fmt` below indexes this tuple, the order of the branches of _tile1/_tile4.
FORMATS = tuple(TILE_FORMATS)
assert FORMATS == ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
(_Q40_1, _Q40_4), (_Q41_1, _Q41_4), (_Q50_1, _Q50_4), (_Q80_1, _Q80_4) = (
    TILE_PRODUCTS[name] for name in FORMATS[:4]
)
(_Q4K_1, _Q4K_4), (_Q5K_1, _Q5K_4), (_Q6K_1, _Q6K_4) = (TILE_PRODUCTS[n] for n in FORMATS[4:])


@nb.njit(inline="always", **_JIT)
def out_columns(w):
    """Outputs of tiles w: 8 per tile (the last tile's padding rows included)."""
    return w.shape[0] * TILE_ROWS


@nb.njit(inline="always", **_JIT)
def _tile1(fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0):
    if fmt == 0:
        _Q40_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 1:
        _Q41_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 2:
        _Q50_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 3:
        _Q80_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 4:
        _Q4K_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 5:
        _Q5K_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    else:
        _Q6K_1(tile, xq, xd, xs, isum, t, n_blocks, out, o0)


@nb.njit(inline="always", **_JIT)
def _tile4(fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0):
    if fmt == 0:
        _Q40_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 1:
        _Q41_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 2:
        _Q50_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 3:
        _Q80_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 4:
        _Q4K_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif fmt == 5:
        _Q5K_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    else:
        _Q6K_4(tile, xq, xd, xs, isum, t, n_blocks, out, o0)


@nb.njit(inline="always", **_JIT)
def _unit(fmt, w, u, xq, xd, xs, isum, out, n_blocks):
    """Tile u of weight w (8 output rows) times every activation row; 4 activation rows at
    a time share each unpacked weight vector."""
    n = xq.shape[0]
    o0 = u * TILE_ROWS
    tile = w[u]
    t = 0
    while t + 4 <= n:
        _tile4(fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0)
        t += 4
    while t < n:
        _tile1(fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0)
        t += 1


@nb.njit(parallel=True, **_JIT)
def matmul_q(w, xq, xd, xs, isum, out, fmt, block_size):
    """Quantized weight tiles of format FORMATS[fmt] times quantized
    activations; out [n, out_columns(w)]."""
    n_blocks = xq.shape[1] // block_size
    for u in nb.prange(w.shape[0]):
        _unit(fmt, w, u, xq, xd, xs, isum, out, n_blocks)


@nb.njit(parallel=True, **_JIT)
def matmul_q_many(ws, fmts, xq, xd, xs, isum, outs, block_size):
    """Several weights (a tuple) of one activation format times the same activations: one
    thread launch for, say, Q, K and V. fmts int64 [len(ws)]; outs a tuple of [n, n_out_i]."""
    n_blocks = xq.shape[1] // block_size
    starts = np.zeros(len(ws) + 1, np.int64)  # first global unit of each weight
    for i in range(len(ws)):
        starts[i + 1] = starts[i] + ws[i].shape[0]
    for g in nb.prange(starts[len(ws)]):
        i = 0
        while g >= starts[i + 1]:
            i += 1
        _unit(fmts[i], ws[i], g - starts[i], xq, xd, xs, isum, outs[i], n_blocks)


@nb.njit(**_JIT)
def qmatmul(w, x, fmt, block_size, q8k):
    """x float32 [n, n_in] times weight rows w of FORMATS[fmt]: quantize, multiply, in one
    call from Python (a decode step makes hundreds of these)."""
    xq, xd, xs, isum = quantize(x, q8k)
    out = np.empty((x.shape[0], out_columns(w)), np.float32)
    matmul_q(w, xq, xd, xs, isum, out, fmt, block_size)
    return out


@nb.njit(**_JIT)
def qmatmul_many(ws, x, fmts, block_size, q8k):
    """Several weights sharing one activation format: one quantization, one thread launch."""
    xq, xd, xs, isum = quantize(x, q8k)
    outs = [np.empty((x.shape[0], out_columns(ws[i])), np.float32) for i in range(len(ws))]
    matmul_q_many(ws, fmts, xq, xd, xs, isum, outs, block_size)
    return outs
