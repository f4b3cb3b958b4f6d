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
from fastrun.backends.cpu.simd import counted_loop, f16_round, vec

drop_stale_cache("float_tiles", ("simd.py", "../llamacpp_numerics.py"))

FLOAT_TILE_ROWS = 32
_VECTORS = FLOAT_TILE_ROWS // 8  # 8-float vectors per tile column
_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V8F = vec(_F32, 8)


@intrinsic
def _widen(typingctx, bits, kind):
    """A uint16 F16 (kind 0) or BF16 (kind 1) value, or a uint32 F32 one, as float32."""

    def codegen(context, builder, sig, args):
        value, is_bf16 = args
        if value.type.width == 32:
            return builder.bitcast(value, _F32)
        half = builder.fpext(builder.bitcast(value, ir.HalfType()), _F32)
        shifted = builder.shl(builder.zext(value, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.select(
            builder.icmp_signed("!=", is_bf16, ir.Constant(is_bf16.type, 0)),
            builder.bitcast(shifted, _F32),
            half,
        )

    return types.float32(bits, kind), codegen


@nb.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _widen_into_tiles(raw, kind, out):
    """raw [n_out, n_in] of F16/BF16 (uint16, kind 0/1) or F32 (uint32) bits -> out float32
    [tiles, n_in, 32], row r of tile u at out[u, :, r]; rows past n_out zero."""
    n_out, n_in = raw.shape
    for u in nb.prange(out.shape[0]):
        rows = min(FLOAT_TILE_ROWS, n_out - u * FLOAT_TILE_ROWS)
        for i in range(n_in):  # the tile written in order, its 32 rows read side by side
            for r in range(rows):
                out[u, i, r] = _widen(raw[u * FLOAT_TILE_ROWS + r, i], kind)
            for r in range(rows, FLOAT_TILE_ROWS):
                out[u, i, r] = 0


_BITS = {"F16": (np.uint16, 0), "BF16": (np.uint16, 1), "F32": (np.uint32, 0)}


def to_float_tiles(raw: np.ndarray, qtype: str, n_out: int, n_in: int) -> np.ndarray:
    """Raw F32/F16/BF16 rows [n_out, row bytes] -> float32 tiles [ceil(n_out / 32), n_in, 32],
    in one parallel pass; rows past n_out are zeros (outputs the caller slices off)."""
    dtype, kind = _BITS[qtype]
    bits = np.ascontiguousarray(raw).view(dtype).reshape(n_out, n_in)
    shape = (-(-n_out // FLOAT_TILE_ROWS), n_in, FLOAT_TILE_ROWS)
    out = np.empty(shape, np.float32)
    _widen_into_tiles(bits, np.int64(kind), out)
    return out


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


@nb.njit(nogil=True, cache=True, boundscheck=False)
def matmul_float(tiles, x, round_f16):
    """x float32 [n, n_in] times the tiles: [n, 32 * units]; round_f16: the activations
    rounded to fp16 first, as llama.cpp multiplies fp16 weights."""
    if round_f16:
        x = _rounded_f16(x)
    out = np.empty((x.shape[0], tiles.shape[0] * FLOAT_TILE_ROWS), np.float32)
    matmul_float_tiles(tiles, x, out)
    return out


@nb.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _rounded_f16(x):
    out = np.empty_like(x)
    for t in nb.prange(x.shape[0]):
        for i in range(x.shape[1]):
            out[t, i] = f16_round(x[t, i])
    return out


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
