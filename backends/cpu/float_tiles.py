"""Products of float weights (F32, F16, BF16) as float32 tiles of 32 rows.

A tile holds 32 weight rows column by column: at column i, the 32 rows' values i as four
8-float vectors. Multiplied by activation i of a token broadcast to every lane, each vector
gives 8 outputs' next term in one fused multiply-add: no horizontal sums, and every output
is one chain of fused multiply-adds over the columns in order. So a row's product has the
same bits whatever the number of rows or threads (batch invariance), while 4 tokens times
the 4 vectors of a tile keep 16 chains in flight (a prefill runs at the FMA units' rate);
a single token still has 4 (a decode step stays bound by memory, not by FMA latency).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.simd import counted_loop, vec

drop_stale_cache("float_tiles", ("simd.py",))

FLOAT_TILE_ROWS = 32
_VECTORS = FLOAT_TILE_ROWS // 8  # 8-float vectors per tile column
_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V8F = vec(_F32, 8)


def to_float_tiles(dense: np.ndarray) -> np.ndarray:
    """float32 [n_out, n_in] -> tiles [ceil(n_out / 32), n_in, 32]; rows past n_out are
    zeros (their outputs, sliced off by the caller, are 0)."""
    n_out, n_in = dense.shape
    n_tiles = -(-n_out // FLOAT_TILE_ROWS)
    tiles = np.zeros((n_tiles * FLOAT_TILE_ROWS, n_in), np.float32)
    tiles[:n_out] = dense
    return np.ascontiguousarray(tiles.reshape(n_tiles, FLOAT_TILE_ROWS, n_in).transpose(0, 2, 1))


def _make_float_tile_product(n_tok: int):
    @intrinsic
    def float_tile_product(typingctx, tiles, u, x, t, out):
        """out[t:t+n_tok, 32u:32u+32] = tile u times activation rows t.. (n_tok)."""

        def codegen(context, builder, sig, args):
            tiles_a = context.make_array(sig.args[0])(context, builder, args[0])
            x_a = context.make_array(sig.args[2])(context, builder, args[2])
            out_a = context.make_array(sig.args[4])(context, builder, args[4])
            u_v, t_v = args[1], args[3]
            n_in = cgutils.unpack_tuple(builder, x_a.shape, 2)[1]
            out_cols = cgutils.unpack_tuple(builder, out_a.shape, 2)[1]
            tile = builder.gep(tiles_a.data, [builder.mul(u_v, builder.mul(n_in, _c64(32)))])
            rows = [builder.add(t_v, _c64(k)) for k in range(n_tok)]
            xs = [builder.gep(x_a.data, [builder.mul(r, n_in)]) for r in rows]
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32"
            )

            def column(i, accs):
                at = builder.gep(tile, [builder.mul(i, _c64(32))])
                ws = [_load_v8(builder, builder.gep(at, [_c64(8 * j)])) for j in range(_VECTORS)]
                new = []
                for k in range(n_tok):
                    xv = _splat(builder, builder.load(builder.gep(xs[k], [i])))
                    new.extend(builder.call(fma, [w, xv, accs[k * _VECTORS + j]])
                               for j, w in enumerate(ws))  # fmt: skip
                return new

            zero = ir.Constant(_V8F, [0.0] * 8)
            accs = counted_loop(builder, _c64(0), n_in, 1, [zero] * (n_tok * _VECTORS), column)
            o0 = builder.mul(u_v, _c64(FLOAT_TILE_ROWS))
            for k in range(n_tok):
                row_out = builder.gep(out_a.data, [builder.add(builder.mul(rows[k], out_cols), o0)])
                for j in range(_VECTORS):
                    ptr = builder.bitcast(builder.gep(row_out, [_c64(8 * j)]), _V8F.as_pointer())
                    builder.store(accs[k * _VECTORS + j], ptr, align=4)
            return context.get_dummy_value()

        return types.void(tiles, u, x, t, out), codegen

    return float_tile_product


def _c64(v):
    return ir.Constant(_I64, v)


def _load_v8(builder, ptr):
    return builder.load(builder.bitcast(ptr, _V8F.as_pointer()), align=4)


def _splat(builder, value):
    undef = ir.Constant(_V8F, ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, ir.Constant(vec(ir.IntType(32), 8), [0] * 8))


_TILE1, _TILE4 = _make_float_tile_product(1), _make_float_tile_product(4)


@nb.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def matmul_float_tiles(tiles, x, out):
    """tiles float32 [units, n_in, 32] (to_float_tiles) times x float32 [n, n_in] (C order):
    out [n, 32 * units]; threads split the tiles, 4 tokens share each loaded column."""
    n = x.shape[0]
    for u in nb.prange(tiles.shape[0]):
        t = 0
        while t + 4 <= n:
            _TILE4(tiles, u, x, t, out)
            t += 4
        while t < n:
            _TILE1(tiles, u, x, t, out)
            t += 1
