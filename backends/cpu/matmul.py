"""Quantized matrix products on the CPU: weight bytes times quantized activations.

Weights arrive repacked at load into tiles of 8 rows (tiles.py, as llama.cpp's repacked
kernels). Shapes: w [tiles, tile bytes] uint8, xq [n, n_in] int8, xd
per-block activation scales, xs fp16-rounded scaled block sums (Q8_1), isum integer block
sums (Q8_0) or 16-value sums (Q8_K), out [n, n_out] (n_out a multiple of 8 for tiles: rows
past a weight's own are zero padding, which the backend slices off). Threads split the
tiles; each weight vector is unpacked once per 4 tokens (and once for the 1-3 left).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.extending import overload

from fastrun.backends.cpu.activations import quantize, quantize_32, quantize_k
from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.tiles import TILE_NAMES, TILE_PRODUCTS, TILE_ROWS, FormatSet

drop_stale_cache(
    "matmul", ("simd.py", "tiles.py", "activations.py", "../llamacpp_numerics.py")
)  # code it inlines

# fastmath off: Numba's fast-math pass flags every float instruction of the module, the
# tiles' own IR too, and LLVM then reassociates the sums llama.cpp's order fixes (tiles.py)
_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False, error_model="numpy")
# The overloads below do no arithmetic: compiled with the options of the kernels that inline
# them (stack.py, fused.py), the Numba functions they call (np.empty ...) are compiled once
# for both, not once per set of options.
_OVERLOAD_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)

# Quantized formats of the integer kernel, each multiplied as repacked tiles of 8 rows
# (tiles.py); `fmt` below indexes this tuple, and a FormatSet of its indices says which of them
# a compiled product holds.
FORMATS = TILE_NAMES
assert FORMATS[:7] == ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_TILE1, _TILE2, _TILE3, _TILE4 = (TILE_PRODUCTS[n] for n in (1, 2, 3, 4))


@nb.njit(inline="always", **_JIT)
def out_columns(w):
    """Outputs of tiles w: 8 per tile (the last tile's padding rows included)."""
    return w.shape[0] * TILE_ROWS


@nb.njit(inline="always", **_JIT)
def _unit(formats, fmt, w, u, xq, xd, xs, isum, out, n_blocks):
    """Tile u of weight w (8 output rows) times every activation row; 4 activation rows at
    a time share each unpacked weight vector, then the 1-3 left share one."""
    n = xq.shape[0]
    o0 = u * TILE_ROWS
    tile = w[u]
    t = 0
    while t + 4 <= n:
        _TILE4(formats, fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0)
        t += 4
    left = n - t
    if left == 3:
        _TILE3(formats, fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif left == 2:
        _TILE2(formats, fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0)
    elif left == 1:
        _TILE1(formats, fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0)


def format_set(names) -> FormatSet:
    """The FormatSet of these weight types (FORMATS names)."""
    return FormatSet(FORMATS.index(name) for name in names)


def _quantize_for(formats, x, q8k):
    """quantize(x, q8k), compiled with the branches of the activation formats `formats`
    pair with alone."""


@overload(_quantize_for, jit_options=_OVERLOAD_JIT)
def _quantize_for_impl(formats, x, q8k):
    q8_0, q8_k = FormatSet(formats.indices).q8k
    if not q8_k:
        return lambda formats, x, q8k: quantize_32(x)
    if not q8_0:
        return lambda formats, x, q8k: quantize_k(x)
    return lambda formats, x, q8k: quantize(x, q8k)


# The most weights that share one activation (Q, K and V). Every product runs through one
# parallel kernel over a tuple of this many weights, fewer padded with empty ones: one
# compiled instance of the tile loops, where a kernel per tuple length compiled three (a
# third of a cold start's compile time).
MANY = 3


def _padded(ws):
    """ws (a tuple of 1..MANY arrays) padded to MANY with empty views of its first."""


@overload(_padded, jit_options=_OVERLOAD_JIT)
def _padded_impl(ws):
    if ws.count == MANY:
        return lambda ws: ws
    if ws.count == 2:
        return lambda ws: (ws[0], ws[1], ws[0][:0])
    if ws.count == 1:
        return lambda ws: (ws[0], ws[0][:0], ws[0][:0])
    raise TypeError(f"{ws.count} weights: between 1 and {MANY} share one activation")


@nb.njit(parallel=True, **_JIT)
def matmul_q_many(formats, ws, fmts, xq, xd, xs, isum, outs, block_size):
    """MANY weights (a tuple; empty ones take no time) of one activation format times the
    same activations, in one thread launch. fmts int64 [MANY]: each one's FORMATS index,
    one of `formats`; outs a tuple of [n, out_columns(ws[i])]."""
    n_blocks = xq.shape[1] // block_size
    starts = np.zeros(MANY + 1, np.int64)  # first global unit of each weight
    for i in range(MANY):
        starts[i + 1] = starts[i] + ws[i].shape[0]
    for g in nb.prange(starts[MANY]):
        i = 0
        while g >= starts[i + 1]:
            i += 1
        _unit(formats, fmts[i], ws[i], g - starts[i], xq, xd, xs, isum, outs[i], n_blocks)


@nb.njit(inline="always", **_JIT)
def qmatmul_many(formats, ws, x, fmts, block_size, q8k):
    """Several weights (a tuple of 1..MANY) sharing one activation format: one quantization,
    one thread launch; a list of their outputs. fmts int64 [len(ws)], each one of the
    FormatSet `formats`."""
    xq, xd, xs, isum = _quantize_for(formats, x, q8k)
    w3 = _padded(ws)
    fmts3 = np.zeros(MANY, np.int64)
    for i in range(len(fmts)):  # a loop: a slice assignment compiles a shape-error path
        fmts3[i] = fmts[i]
    outs = (
        np.empty((x.shape[0], out_columns(w3[0])), np.float32),
        np.empty((x.shape[0], out_columns(w3[1])), np.float32),
        np.empty((x.shape[0], out_columns(w3[2])), np.float32),
    )
    matmul_q_many(formats, w3, fmts3, xq, xd, xs, isum, outs, block_size)
    return [outs[i] for i in range(len(ws))]


@nb.njit(inline="always", **_JIT)
def qmatmul(formats, w, x, fmt, block_size, q8k):
    """x float32 [n, n_in] times weight rows w of FORMATS[fmt] (one of `formats`): quantize,
    multiply, in one call from Python (a decode step makes hundreds of these)."""
    return qmatmul_many(formats, (w,), x, np.full(1, fmt, np.int64), block_size, q8k)[0]
