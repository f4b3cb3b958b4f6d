"""Products of quantized weights 8 output rows at a time, from weights repacked once at load.

The design of llama.cpp's repacked CPU kernels (`block_q4_Kx8` in ggml-cpu/repack.cpp):
a tile holds 8 weight rows block by block, their quantized values interleaved 4 bytes per
row, so one 32-byte vector holds 4 consecutive values of each of the 8 rows. Multiplied
(`vpmaddubsw`) by 4 activations broadcast to every 32-bit lane, it gives partial sums whose
lanes are output rows: no horizontal sums, one float conversion and one fused multiply-add
per 8 outputs and block, per-row scales as vectors straight from the tile. Each unpacked
weight vector is reused by up to 4 activation rows.

Every output is computed the same way whatever the number of activation rows or threads
(blocks in order, one fused multiply-add chain per output): products of 1 and of 16 rows
agree bit for bit, which batch invariance needs.

A tile format is the repacking (NumPy, once at load, from quant.reference's block layouts)
and the IR that multiplies one repacked block (`_block_*`); `TILE_FORMATS` lists them.
Integer partial sums stay in int16 only as far as they cannot overflow: 8 `vpmaddubsw`
pairs of 4-bit values (8 * 2 * 15 * 127 < 2**15), 4 of 5-bit, 2 of 6-bit, 1 of 8-bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fastrun.backends.cpu.rowdot import counted_loop
from fastrun.backends.cpu.simd import (
    I8,
    I16,
    I32,
    block_partials,
    lanes,
    pair_products,
    splat,
    vec,
    widen_pairs,
)
from fastrun.quant.formats import block_format
from fastrun.quant.reference import BLOCK_DTYPES, k_scales_mins

TILE_ROWS = 8

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V8F = vec(_F32, 8)
_V8I = vec(I32, 8)
_ONES16 = splat(I16, 16, 1)


def _c64(v):
    return ir.Constant(_I64, v)


def _load(builder, base, offset, ty):
    ptr = builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())
    return builder.load(ptr, align=1)


def _c64_mul(builder, i, scale, offset):
    """i * scale + offset (i64)."""
    return builder.add(builder.mul(i, _c64(scale)), _c64(offset))


def _lshr_bytes(builder, v, amount):
    """<32 x i8> shifted right by an i16 amount the same in every lane, as 16-bit lanes
    (vpsrlw): bits from the next byte come in at the top; callers mask them off."""
    words = builder.bitcast(v, vec(I16, 16))
    shifted = builder.lshr(words, _splat_val(builder, amount, 16))
    return builder.bitcast(shifted, vec(I8, 32))


def _at(builder, base, k):
    return builder.add(base, _c64(k))


def _splat_val(builder, value, n=8):
    undef = ir.Constant(ir.VectorType(value.type, n), ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(vec(I32, n), [0] * n))


def _f16x8(builder, tile, at):
    """The 8 rows' fp16 scales at tile[at] as <8 x float> (vcvtph2ps)."""
    return builder.fpext(_load(builder, tile, at, vec(ir.HalfType(), 8)), _V8F)


def _fma(builder, a, b, c):
    """a * b + c rounded once: an explicit FMA, so that no compiler choice changes results."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32"
    )
    return builder.call(fn, [a, b, c])


def _widen_bytes(builder, tile, at, signed=False):
    """16 bytes at tile[at] as <16 x i16>."""
    raw = _load(builder, tile, at, vec(I8, 16))
    return (builder.sext if signed else builder.zext)(raw, vec(I16, 16))


def _pick_pairs(builder, v16, which):
    """<16 x i16> whose lanes 2r, 2r+1 hold two values of row r -> both lanes = value `which`
    (the layout vpmaddwd wants for one scale per row)."""
    return builder.shuffle_vector(v16, v16, lanes([2 * (i // 2) + which for i in range(16)]))


class _Tok:
    """One activation row: pointers to its int8 values, scales, sums (as rowdot.py's)."""

    def __init__(self, x, xd, xs, isum):
        self.x, self.xd, self.xs, self.isum = x, xd, xs, isum

    def x4(self, builder, offset):
        """4 activations at offset in every 32-bit lane (a vpbroadcastd load)."""
        word = _load(builder, self.x, offset, I32)
        return builder.bitcast(_splat_val(builder, word), vec(I8, 32))

    def scale(self, builder, b):
        return _splat_val(builder, builder.load(builder.gep(self.xd, [b])))


def _sum_groups(builder, toks, weight, x_at, per_i16, scale16=_ONES16):
    """Per token, per-row int32 sums (<8 x i32>) of weight vectors weight(g) (<32 x i8>, 4
    values of each row; emitted once, used by every token) times the token's activations at
    x_at[g]; pair products summed in int16 `per_i16` at a time, then widened with one scale
    per row (scale16, lane pairs equal). Groups outer, tokens inner: few vectors live."""
    totals = [None] * len(toks)
    for start in range(0, len(x_at), per_i16):
        acc16 = [None] * len(toks)
        for g in range(start, start + per_i16):
            w = weight(g)
            for k, tok in enumerate(toks):
                p = pair_products(builder, w, tok.x4(builder, x_at[g]))
                acc16[k] = p if acc16[k] is None else builder.add(acc16[k], p)
        for k in range(len(toks)):
            part = widen_pairs(builder, acc16[k], scale16)
            totals[k] = part if totals[k] is None else builder.add(totals[k], part)
    return totals


def _add_all(builder, totals, parts):
    return [p if t is None else builder.add(t, p) for t, p in zip(totals, parts, strict=True)]


def _times_sum(builder, tok, b, factor, stride=1):
    """factor * the token's integer block sum (<8 x i32> splat): the weight offset's share."""
    s = builder.load(builder.gep(tok.isum, [builder.mul(b, _c64(stride))]))
    return _splat_val(builder, builder.mul(s, ir.Constant(I32, factor)))


# -- formats of 32-value blocks (activations Q8_0 / Q8_1) -----------------------------------------


def _nibble_groups(builder, tile, qs_at, fifth_bits_at=None):
    """The 8 weight vectors of a nibble block (values 4g..4g+3, then 16+4g..): 4 packed
    groups of low and high nibbles; with fifth_bits_at, bit g (low) or 4+g (high) of the
    byte at the same lane holds the fifth bit (Q5_0)."""
    lows, highs = [], []
    hb = _load(builder, tile, fifth_bits_at, vec(I8, 32)) if fifth_bits_at is not None else None
    for g in range(4):
        packed = _load(builder, tile, _at(builder, qs_at, 32 * g), vec(I8, 32))
        lo = builder.and_(packed, splat(I8, 32, 15))
        hi = builder.lshr(packed, splat(I8, 32, 4))
        if hb is not None:
            for bit, v, out in ((g, lo, lows), (4 + g, hi, highs)):
                five = builder.and_(builder.lshr(hb, splat(I8, 32, bit)), splat(I8, 32, 1))
                out.append(builder.or_(v, builder.shl(five, splat(I8, 32, 4))))
        else:
            lows.append(lo)
            highs.append(hi)
    return lows + highs


def _b32_block(offset=0, has_min=False, fifth_bit=False):
    """Q4_0 (offset 8), Q4_1 (min), Q5_0 (fifth bit, offset 16): d[8], then m[8] or the
    fifth bits (32 bytes), then 4 groups of 32 packed bytes."""
    qs_at = 16 + (16 if has_min else 0) + (32 if fifth_bit else 0)

    def block(builder, tile, base, b, toks, accs):
        d = _f16x8(builder, tile, base)
        m = _f16x8(builder, tile, _at(builder, base, 16)) if has_min else None
        weights = _nibble_groups(
            builder, tile, _at(builder, base, qs_at), _at(builder, base, 16) if fifth_bit else None
        )
        x0 = builder.mul(b, _c64(32))
        x_at = [_at(builder, x0, 4 * g) for g in range(4)] + [
            _at(builder, x0, 16 + 4 * g) for g in range(4)
        ]
        totals = _sum_groups(builder, toks, weights.__getitem__, x_at, 4 if fifth_bit else 8)
        out = []
        for k, tok in enumerate(toks):
            total = totals[k]
            if offset:  # stored as q + offset: subtract offset * (the activations' sum)
                total = builder.sub(total, _times_sum(builder, tok, b, offset))
            acc = _fma(
                builder, builder.sitofp(total, _V8F), builder.fmul(d, tok.scale(builder, b)),
                accs[k][0],
            )  # fmt: skip
            if has_min:  # Q4_1: + m * s, s the activation block's fp16 scaled sum
                xs = _splat_val(builder, builder.load(builder.gep(tok.xs, [b])))
                out.append((acc, _fma(builder, m, xs, accs[k][1])))
            else:
                out.append((acc,))
        return out

    return block


def _q8_0_block(builder, tile, base, b, toks, accs):
    """Q8_0: d[8], then 8 groups of 32 signed bytes (llama.cpp's sign trick per group)."""
    d = _f16x8(builder, tile, base)
    weights = [_load(builder, tile, _at(builder, base, 16 + 32 * g), vec(I8, 32)) for g in range(8)]
    x0 = builder.mul(b, _c64(32))
    out = []
    for k, tok in enumerate(toks):
        total = None
        for g, w in enumerate(weights):
            part = block_partials(builder, w, tok.x4(builder, _at(builder, x0, 4 * g)), True)
            total = part if total is None else builder.add(total, part)
        scale = builder.fmul(d, tok.scale(builder, b))
        out.append((_fma(builder, builder.sitofp(total, _V8F), scale, accs[k][0]),))
    return out


# -- K-quant super-blocks of 256 values (activation Q8_K) ---------------------------------------


def _sub_block_sums(builder, tok, b, pairs: bool):
    """The token's Q8_K 16-value sums of block b as int16 lane pairs in <8 x i32> words:
    word i = sums (2i, 2i+1) of 16 values, or with pairs of 32 values (sums of 2i..2i+3
    paired): the operand vpmaddwd multiplies with a row's two scales or mins."""
    sums = _load(builder, tok.isum, builder.mul(b, _c64(16)), vec(I32, 16))
    if pairs:
        even = builder.shuffle_vector(sums, sums, lanes(range(0, 16, 2)))
        sums = builder.add(even, builder.shuffle_vector(sums, sums, lanes(range(1, 16, 2))))
    narrow = builder.trunc(sums, vec(I16, sums.type.count))
    return builder.bitcast(narrow, vec(I32, sums.type.count // 2))


def _scaled_sums(builder, tile, at, n_words, sums, signed):
    """sum_i vpmaddwd(row pairs of scales at tile[at + 16 i], sums word i): per row,
    sum_j scale_j * s_j (the K-quant min or offset term, in int32)."""
    total = None
    for i in range(n_words):
        s = builder.extract_element(sums, ir.Constant(I32, i))
        words = builder.bitcast(_splat_val(builder, s), vec(I16, 16))
        scales = _widen_bytes(builder, tile, _at(builder, at, 16 * i), signed)
        part = widen_pairs(builder, scales, words)
        total = part if total is None else builder.add(total, part)
    return total


def _q4_k_block(builder, tile, base, b, toks, accs):
    """Q4_K: d[8], dmin[8], scales and mins (each [4 pairs][8 rows][2]), then per pair p of
    sub-blocks 8 groups of 32 bytes: low nibbles sub-block 2p, high 2p + 1."""
    d = _f16x8(builder, tile, base)
    dmin = _f16x8(builder, tile, _at(builder, base, 16))
    x0 = builder.mul(b, _c64(256))

    def pair_of_sub_blocks(p, totals):
        # a loop, not unrolled: in one long block LLVM hoists every unpacked vector and
        # spills them all
        scales = _widen_bytes(builder, tile, builder.add(base, _c64_mul(builder, p, 16, 32)))
        qs = builder.add(base, _c64_mul(builder, p, 256, 160))
        xp = builder.add(x0, _c64_mul(builder, p, 64, 0))
        for half in range(2):  # low nibbles: sub-block 2p, high: 2p + 1

            def weight(g, half=half):
                packed = _load(builder, tile, _at(builder, qs, 32 * g), vec(I8, 32))
                if half:
                    return builder.lshr(packed, splat(I8, 32, 4))
                return builder.and_(packed, splat(I8, 32, 15))

            x_at = [_at(builder, xp, 32 * half + 4 * g) for g in range(8)]
            scale16 = _pick_pairs(builder, scales, half)
            totals = _add_all(builder, totals, _sum_groups(builder, toks, weight, x_at, 8, scale16))
        return totals

    zero = ir.Constant(_V8I, [0] * 8)
    totals = counted_loop(builder, _c64(0), _c64(4), 1, [zero] * len(toks), pair_of_sub_blocks)
    out = []
    for k, tok in enumerate(toks):
        xd = tok.scale(builder, b)
        mins = _scaled_sums(builder, tile, _at(builder, base, 96), 4, _sub_block_sums(
            builder, tok, b, pairs=True), signed=False)  # fmt: skip
        acc = _fma(builder, builder.sitofp(totals[k], _V8F), builder.fmul(d, xd), accs[k][0])
        acc_min = _fma(builder, builder.sitofp(mins, _V8F), builder.fmul(dmin, xd), accs[k][1])
        out.append((acc, acc_min))
    return out


def _q6_k_block(builder, tile, base, b, toks, accs):
    """Q6_K: d[8], int8 scales [8 pairs][8 rows][2], then per half h and group g the 32
    bytes of ql[64h + 4g..], ql[64h + 32 + 4g..], qh[32h + 4g..]; values stored as q + 32."""
    d = _f16x8(builder, tile, base)
    x0 = builder.mul(b, _c64(256))

    def quarter_block(pair, totals):
        # values 128h + 32q + 0..31 with scales 16 + 2 pair + 0/1, pair = 4h + q; a loop
        # with shifts by q, not unrolled (see _q4_k_block)
        h, q = builder.lshr(pair, _c64(2)), builder.and_(pair, _c64(3))
        quants = builder.add(base, _c64_mul(builder, h, 768, 144))
        low_at = builder.add(quants, _c64_mul(builder, builder.and_(q, _c64(1)), 32, 0))
        low_shift = builder.trunc(builder.mul(builder.lshr(q, _c64(1)), _c64(4)), I16)
        high_shift = builder.trunc(builder.mul(q, _c64(2)), I16)

        def weight(g):
            low = _load(builder, tile, _at(builder, low_at, 96 * g), vec(I8, 32))
            low = builder.and_(_lshr_bytes(builder, low, low_shift), splat(I8, 32, 15))
            high = _load(builder, tile, _at(builder, quants, 96 * g + 64), vec(I8, 32))
            high = builder.and_(_lshr_bytes(builder, high, high_shift), splat(I8, 32, 3))
            return builder.or_(low, builder.shl(high, splat(I8, 32, 4)))

        scales_at = builder.add(base, _c64_mul(builder, pair, 16, 16))
        scales = _widen_bytes(builder, tile, scales_at, signed=True)
        xq = builder.add(x0, _c64_mul(builder, pair, 32, 0))  # 128h + 32q = 32 pair
        for e in range(2):  # sub-blocks of 16 values: groups 4e..4e+3
            x_at = [_at(builder, xq, 16 * e + 4 * g) for g in range(4)]
            parts = _sum_groups(
                builder, toks, lambda g, e=e: weight(4 * e + g), x_at, 2,
                _pick_pairs(builder, scales, e),
            )  # fmt: skip
            totals = _add_all(builder, totals, parts)
        return totals

    zero = ir.Constant(_V8I, [0] * 8)
    totals = counted_loop(builder, _c64(0), _c64(8), 1, [zero] * len(toks), quarter_block)
    out = []
    for k, tok in enumerate(toks):
        # the +32 offset, in the integer lanes as llama.cpp subtracts it
        sums = _sub_block_sums(builder, tok, b, pairs=False)
        offset = _scaled_sums(builder, tile, _at(builder, base, 16), 8, sums, signed=True)
        total = builder.sub(totals[k], builder.shl(offset, splat(I32, 8, 5)))
        scale = builder.fmul(d, tok.scale(builder, b))
        out.append((_fma(builder, builder.sitofp(total, _V8F), scale, accs[k][0]),))
    return out


# -- repacking (NumPy, once per weight) ---------------------------------------------------------


def _interleave(field: np.ndarray, n_tiles: int, group: int) -> np.ndarray:
    """[rows, nb, L] bytes of a field -> [tiles, nb, L * 8] with `group` bytes of row 0, of
    row 1, ..., of row 7, then the next group."""
    _, nb, length = field.shape
    tiled = field.reshape(n_tiles, TILE_ROWS, nb, length // group, group)
    return tiled.transpose(0, 2, 3, 1, 4).reshape(n_tiles, nb, length * TILE_ROWS)


def _bytes(a: np.ndarray) -> np.ndarray:
    """[rows, nb, ...] of any dtype -> [rows, nb, bytes]."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[0], a.shape[1], -1)


def _fields_b32(blocks, name):
    fields = [(_bytes(blocks["d"]), 2)]
    if name == "Q4_1":
        fields.append((_bytes(blocks["m"]), 2))
    if name == "Q5_0":  # bit g / 4 + g of byte i: fifth bit of value 4g + i / 16 + 4g + i
        bits = (blocks["qh"][..., None] >> np.arange(32, dtype=np.uint32)) & 1
        bits = bits.reshape(*blocks.shape, 2, 4, 4).astype(np.uint8)  # [half, g, i]
        shifts = (4 * np.arange(2)[:, None] + np.arange(4)[None, :]).astype(np.uint8)
        fifth = (bits << shifts[..., None]).sum(axis=(2, 3), dtype=np.uint8)
        fields.append((fifth, 4))
    qs = blocks["qs"].view(np.uint8)
    fields.append((qs, 4))
    return fields


def _fields_q4_k(blocks, name):
    scales, mins = k_scales_mins(blocks["scales"].reshape(-1, 12))
    shape = (*blocks.shape, 8)
    return [
        (_bytes(blocks["d"]), 2),
        (_bytes(blocks["dmin"]), 2),
        (scales.astype(np.uint8).reshape(shape), 2),
        (mins.astype(np.uint8).reshape(shape), 2),
        (blocks["qs"], 4),
    ]


def _fields_q6_k(blocks, name):
    rows, nb = blocks.shape
    ql = blocks["ql"].reshape(rows, nb, 2, 2, 8, 4)  # [h, ql half, g, i]
    qh = blocks["qh"].reshape(rows, nb, 2, 1, 8, 4)
    quants = np.concatenate([ql, qh], axis=3).transpose(0, 1, 2, 4, 3, 5)  # [h, g, 3, i]
    return [
        (_bytes(blocks["d"]), 2),
        (blocks["scales"].view(np.uint8), 2),
        (quants.reshape(rows, nb, 192), 4),
    ]


class TileFormat(NamedTuple):
    block: Callable  # IR of one repacked block times the tokens: new accumulators per token
    fields: Callable  # (blocks [rows, nb] of BLOCK_DTYPES, name) -> [(bytes, group)]
    second: str = ""  # a second accumulator per output ("add": Q4_1's min, "sub": Q4_K's)


TILE_FORMATS = {
    "Q4_0": TileFormat(_b32_block(offset=8), _fields_b32),
    "Q4_1": TileFormat(_b32_block(has_min=True), _fields_b32, "add"),
    "Q5_0": TileFormat(_b32_block(offset=16, fifth_bit=True), _fields_b32),
    "Q8_0": TileFormat(_q8_0_block, _fields_b32),
    "Q4_K": TileFormat(_q4_k_block, _fields_q4_k, "sub"),
    "Q6_K": TileFormat(_q6_k_block, _fields_q6_k),
}


def tile_block_bytes(name: str) -> int:
    """Bytes of one repacked block of 8 rows (the raw blocks' bytes, more for Q4_K's
    unpacked scales and mins)."""
    return {"Q4_K": 1184}.get(name, TILE_ROWS * block_format(name).block_bytes)


def tiled_shape(name: str, n_out: int, n_in: int) -> tuple[int, int]:
    """[tiles, bytes per tile] of a repacked [n_out, n_in] weight (rows padded to 8)."""
    n_blocks = n_in // block_format(name).block_size
    return -(-n_out // TILE_ROWS), n_blocks * tile_block_bytes(name)


def repack(raw: np.ndarray, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """Raw rows [n_out, row_bytes] of format name -> tiles [ceil(n_out / 8), tile bytes]
    (into out when given); rows past n_out are zero blocks, which add nothing."""
    n_out = raw.shape[0]
    n_tiles = -(-n_out // TILE_ROWS)
    fmt = block_format(name)
    nb = raw.shape[1] // fmt.block_bytes
    padded = np.zeros((n_tiles * TILE_ROWS, raw.shape[1]), np.uint8)
    padded[:n_out] = raw
    blocks = padded.view(BLOCK_DTYPES[name]).reshape(n_tiles * TILE_ROWS, nb)
    parts = [
        _interleave(field, n_tiles, group)
        for field, group in TILE_FORMATS[name].fields(blocks, name)
    ]
    if out is None:
        out = np.empty(tiled_shape(name, n_out, nb * fmt.block_size), np.uint8)
    np.concatenate(parts, axis=2, out=out.reshape(n_tiles, nb, -1))
    return out


# -- the tile loop ------------------------------------------------------------------------------


def _make_tile_product(name: str, n_tok: int):
    spec = TILE_FORMATS[name]
    block, n_acc = spec.block, 2 if spec.second else 1
    block_bytes = tile_block_bytes(name)

    @intrinsic
    def tile_product(typingctx, tile, xq, xd, xs, isum, t, n_blocks, out, o0):
        """out[t:t+n_tok, o0:o0+8] = the tile's 8 rows times activation rows t.. (n_tok)."""

        def codegen(context, builder, sig, args):
            tile_p = context.make_array(sig.args[0])(context, builder, args[0]).data
            t_v, nb_v, o0_v = args[5], args[6], args[8]
            arrays = [
                context.make_array(ty)(context, builder, v)
                for ty, v in zip(sig.args[1:5], args[1:5], strict=True)
            ]
            out_a = context.make_array(sig.args[7])(context, builder, args[7])
            out_cols = cgutils.unpack_tuple(builder, out_a.shape, 2)[1]
            toks, outs = [], []
            for k in range(n_tok):
                tk = builder.add(t_v, _c64(k))
                ptrs = []
                for a in arrays:  # C-contiguous 2-D: row tk starts at tk * shape[1]
                    cols = cgutils.unpack_tuple(builder, a.shape, 2)[1]
                    ptrs.append(builder.gep(a.data, [builder.mul(tk, cols)]))
                toks.append(_Tok(*ptrs))
                outs.append(builder.gep(out_a.data, [builder.add(builder.mul(tk, out_cols), o0_v)]))

            def step(bi, carried):
                accs = [carried[n_acc * k : n_acc * (k + 1)] for k in range(n_tok)]
                base = builder.mul(bi, _c64(block_bytes))
                new = block(builder, tile_p, base, bi, toks, accs)
                return [v for per_tok in new for v in per_tok]

            zero = ir.Constant(_V8F, [0.0] * 8)
            carried = counted_loop(builder, _c64(0), nb_v, 1, [zero] * (n_acc * n_tok), step)
            for k in range(n_tok):
                result = carried[n_acc * k]
                if spec.second:  # min terms, summed apart as llama.cpp does, at the end
                    combine = builder.fsub if spec.second == "sub" else builder.fadd
                    result = combine(result, carried[n_acc * k + 1])
                ptr = builder.bitcast(outs[k], _V8F.as_pointer())
                builder.store(result, ptr, align=4)
            return context.get_dummy_value()

        return types.void(tile, xq, xd, xs, isum, t, n_blocks, out, o0), codegen

    return tile_product


# name -> (one-token, four-token tile product)
TILE_PRODUCTS = {
    name: (_make_tile_product(name, 1), _make_tile_product(name, 4)) for name in TILE_FORMATS
}
