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

A tile format is its repacking (once at load, from quant.reference's block layouts) and the
IR that multiplies one repacked block (`_*_block`); `TILE_FORMATS` lists them. A compiled
product holds the tile loops of the formats of its FormatSet argument alone.
Integer partial sums stay in int16 only as far as they cannot overflow: 8 `vpmaddubsw`
pairs of 4-bit values (8 * 2 * 15 * 127 < 2**15), 4 of 5-bit, 2 of 6-bit, 1 of 8-bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import (
    NativeValue,
    intrinsic,
    models,
    register_model,
    typeof_impl,
    unbox,
)

from fastrun.backends.cpu.simd import (
    HAS_AVX512,
    HAS_VNNI,
    HAS_VNNI512,
    I8,
    I16,
    I32,
    block_partials,
    counted_loop,
    dot_accumulate,
    dot_accumulate_512,
    lanes,
    pair_products,
    prefetch,
    splat,
    vec,
    widen_pairs,
)
from fastrun.quant.fast import k_scale_min
from fastrun.quant.formats import block_format
from fastrun.quant.reference import BLOCK_DTYPES

TILE_ROWS = 8
# How far ahead of the block being multiplied a product asks for the tile bytes (the rest of
# this tile, then the next, which follows it in memory). The hardware prefetcher alone keeps
# one-row products at the memory's speed but falls behind once each block is applied to
# 3-4 activation rows: Qwen2.5-1.5B's checking pass of 5 tokens took 70 ms against 49 with
# this, 8 tokens 98 against 69 (one token: 28-32 ms either way; 4-16 KB measured alike).
PREFETCH_BYTES = 8192

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V8F = vec(_F32, 8)
_V16F = vec(_F32, 16)
_V8I = vec(I32, 8)
_V16I = vec(I32, 16)
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
    ty = a.type
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ty, [ty] * 3), f"llvm.fma.v{ty.count}f32"
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
    """One activation row: pointers to its int8 values, block scales and sums."""

    def __init__(self, x, xd, xs, isum, group_sums):
        self.x, self.xd, self.xs, self.isum = x, xd, xs, isum
        self.group_sums = group_sums  # isum's GROUP_OFFSET-scaled sums (Q8_0 activations)

    def x4(self, builder, offset):
        """4 activations at offset in every 32-bit lane (a vpbroadcastd load)."""
        word = _load(builder, self.x, offset, I32)
        return builder.bitcast(_splat_val(builder, word), vec(I8, 32))

    def x8(self, builder, offset):
        """8 activations at offset in every 64-bit lane (a vpbroadcastq load): 32-bit lane
        2i holds the first 4, lane 2i + 1 the next 4."""
        word = _load(builder, self.x, offset, _I64)
        return builder.bitcast(_splat_val(builder, word), vec(I8, 64))

    def scale(self, builder, b):
        return _splat_val(builder, builder.load(builder.gep(self.xd, [b])))

    def offsets(self, builder, b, group, wide):
        """GROUP_OFFSET times the sum of group `group` of block b in every lane (<8 x i32>),
        or (wide) of groups group and group + 1 in lanes 2r and 2r + 1 (<16 x i32>, a
        vpbroadcastq load)."""
        at = _c64_mul(builder, b, 8, group)
        if wide:
            return builder.bitcast(
                _splat_val(builder, _load(builder, self.group_sums, at, _I64)), _V16I
            )
        return _splat_val(builder, builder.load(builder.gep(self.group_sums, [at])))


def _sum_groups(builder, toks, weight, x_at, per_i16, scale16=_ONES16):
    """Per token, per-row int32 sums (<8 x i32>) of weight vectors weight(g) (<32 x i8>, 4
    unsigned values of each row; emitted once, used by every token) times the token's
    activations at x_at[g], times one scale per row (scale16, lane pairs equal): pair
    products summed in int16 `per_i16` at a time, then widened with the scale; where the host
    has vpdpbusd, the groups summed in int32 by it and the sum multiplied by the scale (the
    same integers: callers keep the int16 sums from saturating). Groups outer, tokens inner:
    few vectors live."""
    if HAS_VNNI:
        return _sum_groups_vnni(builder, toks, weight, x_at, scale16)
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


def _sum_groups_vnni(builder, toks, weight, x_at, scale16):
    totals = [splat(I32, 8, 0)] * len(toks)
    for g in range(len(x_at)):
        w = weight(g)
        for k, tok in enumerate(toks):
            totals[k] = dot_accumulate(builder, totals[k], w, tok.x4(builder, x_at[g]))
    if scale16 is _ONES16:
        return totals
    per_row = builder.shuffle_vector(scale16, scale16, lanes(range(0, 16, 2)))
    scale = builder.sext(per_row, _V8I)
    return [builder.mul(total, scale) for total in totals]


def _add_all(builder, totals, parts):
    return [p if t is None else builder.add(t, p) for t, p in zip(totals, parts, strict=True)]


def _times_sum(builder, tok, b, factor, stride=1, n=8):
    """factor * the token's integer block sum (<n x i32> splat): the weight offset's share."""
    s = builder.load(builder.gep(tok.isum, [builder.mul(b, _c64(stride))]))
    return _splat_val(builder, builder.mul(s, ir.Constant(I32, factor)), n)


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


def _q4_0_block(builder, tile, base, b, toks, accs):
    """Q4_0: d[8], then 4 groups of 32 packed bytes; values stored as q + 8."""
    d = _f16x8(builder, tile, base)
    weights = _nibble_groups(builder, tile, _at(builder, base, 16))
    x0 = builder.mul(b, _c64(32))
    x_at = [_at(builder, x0, 4 * g) for g in range(8)]  # low nibbles 0..15, high 16..31
    totals = _sum_groups(builder, toks, weights.__getitem__, x_at, 8)
    out = []
    for k, tok in enumerate(toks):
        # stored as q + 8: subtract 8 * (the activations' sum)
        total = builder.sub(totals[k], _times_sum(builder, tok, b, 8))
        scale = builder.fmul(d, tok.scale(builder, b))
        out.append((_fma(builder, builder.sitofp(total, _V8F), scale, accs[k][0]),))
    return out


def _unsigned_q8(builder, w):
    """Q8_0's signed bytes plus 128 (0..255), vpdpbusd's unsigned operand: its products then
    carry 128 x the activations' sum, which the sum starts without (one integer start per
    block and token, where llama.cpp's sign trick takes two operations per vector)."""
    return builder.xor(w, splat(I8, w.type.count, -128))


def _q8_0_vectors(builder, tile, base):
    """A Q8_0 tile block's weight vectors: 8 of <32 x i8> (group g: values 4g..4g+3 of each
    row), or with WIDE_LANES 4 of <64 x i8> (lane 2r + p: row r's group 2j + p); unsigned
    (_unsigned_q8) where the host has vpdpbusd."""
    width = 64 if WIDE_LANES else 32
    vectors = [
        _load(builder, tile, _at(builder, base, 16 + width * i), vec(I8, width))
        for i in range(256 // width)
    ]
    return [_unsigned_q8(builder, v) for v in vectors] if HAS_VNNI else vectors


def _q8_0_sums_block(builder, tile, base, b, toks, accs):
    """Q8_0 (as _lanes_block's tiles), its blocks summed whole in int32: one fused multiply-add
    per block and output, a fraction of the lanes' float work."""
    d = _f16x8(builder, tile, base)
    weights = _q8_0_vectors(builder, tile, base)
    x0 = builder.mul(b, _c64(32))
    out = []
    for k, tok in enumerate(toks):
        if WIDE_LANES:
            total16 = splat(I32, 16, 0)
            for j, w in enumerate(weights):
                total16 = dot_accumulate_512(
                    builder, total16, w, tok.x8(builder, _at(builder, x0, 8 * j))
                )
            even = builder.shuffle_vector(total16, total16, lanes(range(0, 16, 2)))
            odd = builder.shuffle_vector(total16, total16, lanes(range(1, 16, 2)))
            total = builder.add(builder.add(even, odd), _times_sum(builder, tok, b, -128))
        elif HAS_VNNI:
            total = _times_sum(builder, tok, b, -128)
            for g, w in enumerate(weights):
                total = dot_accumulate(builder, total, w, tok.x4(builder, _at(builder, x0, 4 * g)))
        else:
            total = None
            for g, w in enumerate(weights):
                x4 = tok.x4(builder, _at(builder, x0, 4 * g))
                part = block_partials(builder, w, x4, True)
                total = part if total is None else builder.add(total, part)
        scale = builder.fmul(d, tok.scale(builder, b))
        out.append((_fma(builder, builder.sitofp(total, _V8F), scale, accs[k][0]),))
    return out


def _lane_start(builder, name, tok, b, group, wide):
    """Where a lane's integer dot starts: the offset of weights stored unsigned (Q5_0's q +
    16, Q8_0's w + 128 on vpdpbusd hosts) times the group's activations, or 0."""
    if name == "Q5_0":
        return tok.offsets(builder, b, group, wide)
    if name == "Q8_0" and HAS_VNNI:  # GROUP_OFFSET * 8 = -128
        return builder.shl(tok.offsets(builder, b, group, wide), splat(I32, 16 if wide else 8, 3))
    return None


def _lanes_block(name: str):
    """Q5_0 (d[8], its fifth bits regrouped (32 bytes), then 4 groups of 32 packed bytes),
    Q8_0 (d[8], then 8 groups of 32 signed bytes) and Q4_1 (d[8], m[8], then 4 groups of
    32 packed bytes) in the float order of llama.cpp's x86 kernels for them (tinyBLAS and
    vec_dot): per output, eight accumulators, one per group of 4 values in the block (lane g
    of its 32-byte dot), each taking one fused multiply-add per block; _lane_sum adds them
    at the end. Q4_1's min terms go to a ninth (one fused multiply-add per block), added
    after the lanes. Each lane's integer dot is the same whichever way it is computed:
    Q5_0's and Q8_0's from unsigned values and an offset start (_lane_start)."""

    def block(builder, tile, base, b, toks, accs):
        d = _f16x8(builder, tile, base)
        x0 = builder.mul(b, _c64(32))
        scales = [builder.fmul(d, tok.scale(builder, b)) for tok in toks]
        out = [list(a) for a in accs]
        if WIDE_LANES:
            _wide_lanes(builder, name, tile, base, b, toks, x0, scales, out)
        else:
            _narrow_lanes(builder, name, tile, base, b, toks, x0, scales, out)
        if name == "Q4_1":  # + m * s, s the activation block's fp16 scaled sum
            m = _f16x8(builder, tile, _at(builder, base, 16))
            for k, tok in enumerate(toks):
                xs = _splat_val(builder, builder.load(builder.gep(tok.xs, [b])))
                out[k][LANE_ACCS] = _fma(builder, m, xs, out[k][LANE_ACCS])
        return [tuple(o) for o in out]

    return block


def _narrow_lanes(builder, name, tile, base, b, toks, x0, scales, out):
    """_lanes_block's groups one <8 x i32> lane vector at a time: out[k][g] takes group g."""
    if name == "Q8_0":
        weights = _q8_0_vectors(builder, tile, base)
    else:  # unsigned nibbles (Q5_0 with its fifth bits: q + 16)
        fifth_bits_at = _at(builder, base, 16) if name == "Q5_0" else None
        qs_at = _at(builder, base, 48 if name == "Q5_0" else 32)
        weights = _nibble_groups(builder, tile, qs_at, fifth_bits_at)
    signed = name == "Q8_0" and not HAS_VNNI  # llama.cpp's sign trick where no vpdpbusd
    for g, w in enumerate(weights):  # groups outer: one weight vector live
        for k, tok in enumerate(toks):
            x4 = tok.x4(builder, _at(builder, x0, 4 * g))
            start = _lane_start(builder, name, tok, b, g, wide=False)
            if HAS_VNNI:
                part = dot_accumulate(builder, start or splat(I32, 8, 0), w, x4)
            else:
                part = block_partials(builder, w, x4, signed)
                part = part if start is None else builder.add(part, start)
            out[k][g] = _fma(builder, builder.sitofp(part, _V8F), scales[k], out[k][g])


# AVX-512 VNNI hosts take two groups in one 512-bit vector: 32-bit lane 2r + p holds row
# r's group 2j + p (the lane formats' values stored so, 8 bytes a row: _layout), half the
# instructions of a group at a time. Each lane's sums are the same as a group's alone.
WIDE_LANES = HAS_VNNI512
LANE_ACCS = 4 if WIDE_LANES else 8  # accumulators per output: <16 x float> or <8 x float>
_PAIR_LANES = lanes([i // 2 for i in range(16)])
# Q5_0's fifth bits in the wide lanes: byte q of accumulator j's vector tests bit 2j + p of
# its row's regrouped byte (bit G: group G), p = lane parity
_FIFTH_BIT_MASKS = [
    ir.Constant(vec(I8, 64), [1 << (2 * j + (q // 4) % 2) for q in range(64)]) for j in range(4)
]


def _wide_weights(builder, name, tile, base):
    """The 4 <64 x i8> weight vectors of a wide-lane tile block, vector j's lane 2r + p row r's
    group 2j + p: Q8_0's 4 chunks; the nibble formats' 2 chunks of packed bytes, low nibbles
    (groups 0-3) then high (4-7), Q5_0's fifth bits set into them."""
    if name == "Q8_0":
        return _q8_0_vectors(builder, tile, base)
    qs_at = 48 if name == "Q5_0" else 32
    packed = [
        _load(builder, tile, _at(builder, base, qs_at + 64 * i), vec(I8, 64)) for i in range(2)
    ]
    weights = [builder.and_(v, splat(I8, 64, 15)) for v in packed]
    weights += [builder.lshr(v, splat(I8, 64, 4)) for v in packed]
    if name == "Q5_0":  # row r's 4 regrouped bytes in both its lanes
        bits = _load(builder, tile, _at(builder, base, 16), _V8I)
        bits = builder.bitcast(builder.shuffle_vector(bits, bits, _PAIR_LANES), vec(I8, 64))
        for j in range(4):
            has = builder.icmp_unsigned(
                "!=", builder.and_(bits, _FIFTH_BIT_MASKS[j]), splat(I8, 64, 0)
            )
            weights[j] = builder.select(has, builder.or_(weights[j], splat(I8, 64, 16)), weights[j])
    return weights


def _wide_lanes(builder, name, tile, base, b, toks, x0, scales, out):
    """_lanes_block's groups two at a time (WIDE_LANES): out[k][j] takes groups 2j, 2j + 1."""
    scales16 = [builder.shuffle_vector(s, s, _PAIR_LANES) for s in scales]
    for j, w in enumerate(_wide_weights(builder, name, tile, base)):
        for k, tok in enumerate(toks):
            x8 = tok.x8(builder, _at(builder, x0, 8 * j))
            start = _lane_start(builder, name, tok, b, 2 * j, wide=True)
            part = dot_accumulate_512(builder, start or splat(I32, 16, 0), w, x8)
            out[k][j] = _fma(builder, builder.sitofp(part, _V16F), scales16[k], out[k][j])


def _lane_sum(builder, accs):
    """The lane accumulators' sum in the tree of llama.cpp's hsum_float_8 (halves, then
    lanes 0 + 2 and 1 + 3, then those two): ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), a_g
    group g's; with WIDE_LANES the same adds, pairs of groups in each vector."""
    if WIDE_LANES:  # accs[j]: lane 2r + p group 2j + p
        z = builder.fadd(builder.fadd(accs[0], accs[2]), builder.fadd(accs[1], accs[3]))
        even = builder.shuffle_vector(z, z, lanes(range(0, 16, 2)))
        return builder.fadd(even, builder.shuffle_vector(z, z, lanes(range(1, 16, 2))))
    half = [builder.fadd(accs[i], accs[i + 4]) for i in range(4)]
    return builder.fadd(builder.fadd(half[0], half[2]), builder.fadd(half[1], half[3]))


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


def _k45_block(fifth_bit: bool, per_pair: bool = False):
    """Q4_K, Q5_K: d[8], dmin[8], scales and mins (each [4 pairs][8 rows][2]), Q5_K's fifth
    bits (8 groups of 32 bytes: bit j of a byte for sub-block j), then per pair p of
    sub-blocks 8 groups of 32 bytes: low nibbles sub-block 2p, high 2p + 1.

    per_pair: the float order of llama.cpp's repacked x86 Q4_K product (ggml_gemm_q4_K_8x8,
    what its prefill runs): one fused multiply-add per pair of sub-blocks, for the scaled
    sums and for the mins alike; else one per super-block."""
    qs_at = 160 + (256 if fifth_bit else 0)

    def block(builder, tile, base, b, toks, accs):
        d = _f16x8(builder, tile, base)
        dmin = _f16x8(builder, tile, _at(builder, base, 16))
        x0 = builder.mul(b, _c64(256))
        xds = [tok.scale(builder, b) for tok in toks]
        scales_d = [builder.fmul(d, xd) for xd in xds]
        scales_min = [builder.fmul(dmin, xd) for xd in xds]
        sums32 = [_sub_block_sums(builder, tok, b, pairs=True) for tok in toks]

        def pair_totals(p):
            """Per token, the pair's int32 sum of scales times sub-block dot products."""
            scales = _widen_bytes(builder, tile, builder.add(base, _c64_mul(builder, p, 16, 32)))
            qs = builder.add(base, _c64_mul(builder, p, 256, qs_at))
            xp = builder.add(x0, _c64_mul(builder, p, 64, 0))
            totals = [None] * len(toks)
            for half in range(2):  # low nibbles: sub-block 2p, high: 2p + 1
                sub_block = builder.trunc(_c64_mul(builder, p, 2, half), I16)

                def weight(g, half=half, sub_block=sub_block):
                    packed = _load(builder, tile, _at(builder, qs, 32 * g), vec(I8, 32))
                    if half:
                        v = builder.lshr(packed, splat(I8, 32, 4))
                    else:
                        v = builder.and_(packed, splat(I8, 32, 15))
                    if not fifth_bit:
                        return v
                    bits = _load(builder, tile, _at(builder, base, 160 + 32 * g), vec(I8, 32))
                    five = builder.and_(_lshr_bytes(builder, bits, sub_block), splat(I8, 32, 1))
                    return builder.or_(v, builder.shl(five, splat(I8, 32, 4)))

                x_at = [_at(builder, xp, 32 * half + 4 * g) for g in range(8)]
                scale16 = _pick_pairs(builder, scales, half)
                parts = _sum_groups(builder, toks, weight, x_at, 4 if fifth_bit else 8, scale16)
                totals = _add_all(builder, totals, parts)
            return totals

        # a loop over pairs, not unrolled: in one long block LLVM hoists every unpacked
        # vector and spills them all
        if per_pair:

            def pair_step(p, carried):
                mins = _widen_bytes(builder, tile, builder.add(base, _c64_mul(builder, p, 16, 96)))
                out = []
                for k, total in enumerate(pair_totals(p)):
                    word = builder.extract_element(sums32[k], builder.trunc(p, I32))
                    words = builder.bitcast(_splat_val(builder, word), vec(I16, 16))
                    acc = _fma(builder, builder.sitofp(total, _V8F), scales_d[k], carried[2 * k])
                    m = builder.sitofp(widen_pairs(builder, mins, words), _V8F)
                    out += [acc, _fma(builder, m, scales_min[k], carried[2 * k + 1])]
                return out

            carried = counted_loop(
                builder, _c64(0), _c64(4), 1, [v for a in accs for v in a], pair_step
            )
            return [(carried[2 * k], carried[2 * k + 1]) for k in range(len(toks))]

        zero = ir.Constant(_V8I, [0] * 8)
        totals = counted_loop(
            builder, _c64(0), _c64(4), 1, [zero] * len(toks),
            lambda p, totals: _add_all(builder, totals, pair_totals(p)),
        )  # fmt: skip
        out = []
        for k in range(len(toks)):
            mins = _scaled_sums(builder, tile, _at(builder, base, 96), 4, sums32[k], signed=False)
            acc = _fma(builder, builder.sitofp(totals[k], _V8F), scales_d[k], accs[k][0])
            acc_min = _fma(builder, builder.sitofp(mins, _V8F), scales_min[k], accs[k][1])
            out.append((acc, acc_min))
        return out

    return block


def _q6_k_block(builder, tile, base, b, toks, accs):
    """Q6_K: d[8], int8 scales [8 pairs][8 rows][2], then per half h and group g the 32
    bytes of ql[64h + 4g..], ql[64h + 32 + 4g..], qh[32h + 4g..]; values stored as q + 32."""
    d = _f16x8(builder, tile, base)
    x0 = builder.mul(b, _c64(256))

    def quarter_block(pair, totals):
        # values 128h + 32q + 0..31 with scales 16 + 2 pair + 0/1, pair = 4h + q; a loop
        # with shifts by q, not unrolled (see _k45_block)
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
        # as llama.cpp's tiled K-quant product (ggml-cpu/tiled, its prefill of 8+ rows on
        # AVX-512 VNNI): the super-block's sum times d, then a fused multiply-add with the
        # activation's scale (GCC contracts its multiply and add)
        scaled = builder.fmul(builder.sitofp(total, _V8F), d)
        out.append((_fma(builder, scaled, tok.scale(builder, b), accs[k][0]),))
    return out


# -- repacking (once per weight) ----------------------------------------------------------------
#
# A tile block is a fixed permutation of the 8 rows' block bytes, plus bytes derived from
# them (Q4_K/Q5_K scales and mins unpacked to one byte each, Q5_0's fifth bits regrouped):
# NumPy appends the derived bytes to each row's block (its "image"), and one compiled
# gather moves 2-byte units by the format's permutation.


def _span(name: str, field: str, group: int) -> tuple[range, int]:
    """The groups of `group` bytes of a raw block field (offsets from quant.reference)."""
    dtype, offset = BLOCK_DTYPES[name].fields[field][:2]
    return range(offset, offset + dtype.itemsize, group), group


@nb.njit(parallel=True, cache=True, nogil=True)
def _unpack_k_scales(image, scales_at, out):
    """out [rows, nb, 16]: the 8 scales, then the 8 mins, of each Q4_K/Q5_K block of image
    [rows, nb, block bytes] (its 12 packed bytes at scales_at), a byte each."""
    for r in nb.prange(image.shape[0]):
        for b in range(image.shape[1]):
            for j in range(8):
                out[r, b, j], out[r, b, 8 + j] = k_scale_min(image[r, b], scales_at, j)


@nb.njit(parallel=True, cache=True, nogil=True)
def _regroup_fifth_bits(image, qh_at, out):
    """out [rows, nb, 4]: byte i has in bit g the fifth bit of value 4g + i of each Q5_0
    block, in bit 4 + g that of value 16 + 4g + i (qh, little-endian, at qh_at)."""
    for r in nb.prange(image.shape[0]):
        for b in range(image.shape[1]):
            qh = np.uint32(0)
            for k in range(4):
                qh |= np.uint32(image[r, b, qh_at + k]) << np.uint32(8 * k)
            for i in range(4):
                byte = 0
                for half in range(2):
                    for g in range(4):
                        byte |= ((qh >> np.uint32(16 * half + 4 * g + i)) & 1) << (4 * half + g)
                out[r, b, i] = byte


def _derived_k45(image, name):
    out = np.empty((*image.shape[:2], 16), np.uint8)
    _unpack_k_scales(image, BLOCK_DTYPES[name].fields["scales"][1], out)
    return out


def _derived_q5_0(image, name):
    out = np.empty((*image.shape[:2], 4), np.uint8)
    _regroup_fifth_bits(image, BLOCK_DTYPES[name].fields["qh"][1], out)
    return out


def _layout(name: str) -> list[tuple[range | list[int], int]]:
    """A tile block's fields in order: the image offsets of their groups, group bytes."""
    bb = block_format(name).block_bytes  # derived bytes start here
    d = _span(name, "d", 2)
    # the lane formats' values 8 bytes a row with WIDE_LANES (two groups a 32-bit lane pair)
    wide = WIDE_LANES and name in ("Q4_1", "Q5_0", "Q8_0")
    if name in ("Q4_0", "Q8_0"):
        return [d, _span(name, "qs", 8 if wide else 4)]
    if name == "Q4_1":
        return [d, _span(name, "m", 2), _span(name, "qs", 8 if wide else 4)]
    if name == "Q5_0":
        return [d, (range(bb, bb + 4, 4), 4), _span(name, "qs", 8 if wide else 4)]
    if name in ("Q4_K", "Q5_K"):
        scales_mins = [(range(bb, bb + 8, 2), 2), (range(bb + 8, bb + 16, 2), 2)]
        fifth = [_span(name, "qh", 4)] if name == "Q5_K" else []
        return [d, _span(name, "dmin", 2), *scales_mins, *fifth, _span(name, "qs", 4)]
    # Q6_K: per half h and group g: ql[64h + 4g..], ql[64h + 32 + 4g..], qh[32h + 4g..]
    ql, qh = (BLOCK_DTYPES[name].fields[f][1] for f in ("ql", "qh"))
    quants = [
        ql + 64 * h + 32 * k + 4 * g if k < 2 else qh + 32 * h + 4 * g
        for h in range(2)
        for g in range(8)
        for k in range(3)
    ]
    return [_span(name, "d", 2), _span(name, "scales", 2), (quants, 4)]


def _permutation(name: str) -> tuple[np.ndarray, np.ndarray]:
    """For each 2-byte unit of a tile block: the row (0-7) and image unit it comes from."""
    rows, units = [], []
    for offsets, group in _layout(name):
        for at in offsets:
            for r in range(TILE_ROWS):
                rows.extend([r] * (group // 2))
                units.extend(range(at // 2, (at + group) // 2))
    return np.array(rows, np.int64), np.array(units, np.int64)


@nb.njit(parallel=True, cache=True, nogil=True)
def _gather(image, sources, out):
    """out [tiles, nb, width] uint16: unit j of tile t, block b from image [rows, nb, L]
    (uint16) at flat index ((8 t) nb + b) L + sources[j]; image has the padding rows."""
    n_tiles, n_blocks, width = out.shape
    flat = image.reshape(-1)
    block_units = image.shape[2]
    for t in nb.prange(n_tiles):
        for b in range(n_blocks):
            start = (t * TILE_ROWS * n_blocks + b) * block_units
            for j in range(width):
                out[t, b, j] = flat[start + sources[j]]


class TileFormat(NamedTuple):
    block: Callable  # IR of one repacked block times the tokens: new accumulators per token
    derived: Callable | None = None  # (raw [rows, nb, block bytes], name) -> more bytes
    second: str = ""  # a second accumulator per output ("add": Q4_1's min, "sub": Q4_K's)
    lanes: bool = False  # eight accumulators per output (then the second), _lane_sum's


# The tiles add in the order of llama.cpp's x86 prefill kernels for each format (tinyBLAS
# and vec_dot for Q5_0, Q8_0 and Q4_1, the repacked product for Q4_K, the tiled one for
# Q6_K), so that their floats are llama.cpp's bit for bit given the same activations
# (tests/test_llamacpp_numerics.py); Q4_0 and Q5_K sum whole blocks in integers.
TILE_FORMATS = {
    "Q4_0": TileFormat(_q4_0_block),
    "Q4_1": TileFormat(_lanes_block("Q4_1"), second="add", lanes=True),
    "Q5_0": TileFormat(_lanes_block("Q5_0"), _derived_q5_0, lanes=True),
    "Q8_0": TileFormat(_lanes_block("Q8_0"), lanes=True),
    "Q4_K": TileFormat(_k45_block(fifth_bit=False, per_pair=True), _derived_k45, "sub"),
    "Q5_K": TileFormat(_k45_block(fifth_bit=True), _derived_k45, "sub"),
    "Q6_K": TileFormat(_q6_k_block),
}
# The output head's products (logits, which no later block reads: llama.cpp's float order
# there changes no other number) in the faster order of whole-block integer sums, on the
# same tiles: "FORMAT:head" names, head_kernel_name's.
HEAD_FORMATS = {"Q8_0:head": TileFormat(_q8_0_sums_block)}


def head_kernel_name(qtype: str) -> str:
    """The tile format an output head of weight type qtype multiplies as."""
    return f"{qtype}:head" if f"{qtype}:head" in HEAD_FORMATS else qtype


def _layout_name(name: str) -> str:
    """The weight type whose tiles a tile format (TILE_NAMES) multiplies."""
    return name.split(":")[0]


# Tokens per pass over a tile for the lane formats: their accumulators per token (4 of 512
# bits, or 8 of 256) fill the registers (32 with AVX-512, 16 below)
LANE_TOKENS = 4 if WIDE_LANES else 2 if HAS_AVX512 else 1
_PERMUTATIONS = {name: _permutation(name) for name in TILE_FORMATS}


def tile_block_bytes(name: str) -> int:
    """Bytes of one repacked block of 8 rows (Q4_K, Q5_K: 32 more than the raw blocks, for
    scales and mins of a byte each)."""
    return 2 * len(_PERMUTATIONS[name][0])


def tiled_shape(name: str, n_out: int, n_in: int) -> tuple[int, int]:
    """[tiles, bytes per tile] of a repacked [n_out, n_in] weight (rows padded to 8)."""
    n_blocks = n_in // block_format(name).block_size
    return -(-n_out // TILE_ROWS), n_blocks * tile_block_bytes(name)


def repack(raw: np.ndarray, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """Raw rows [n_out, row_bytes] of format name -> tiles [ceil(n_out / 8), tile bytes]
    (into out when given); rows past n_out are zero blocks, which add nothing."""
    fmt = block_format(name)
    n_out, nb = raw.shape[0], raw.shape[1] // fmt.block_bytes
    image = np.ascontiguousarray(raw).reshape(n_out, nb, fmt.block_bytes)
    derived = TILE_FORMATS[name].derived
    if derived is not None:
        image = np.concatenate([image, derived(image, name)], axis=2)
    n_tiles = -(-n_out // TILE_ROWS)
    if n_out % TILE_ROWS:  # zero blocks for the last tile's missing rows
        padding = np.zeros((n_tiles * TILE_ROWS - n_out, *image.shape[1:]), np.uint8)
        image = np.concatenate([image, padding])
    if out is None:
        out = np.empty(tiled_shape(name, n_out, nb * fmt.block_size), np.uint8)
    rows_of, units_of = _PERMUTATIONS[name]
    image16 = image.view(np.uint16)
    image16.flags.writeable = False  # one compiled signature, whether raw is the map or not
    sources = rows_of * (nb * image16.shape[2]) + units_of
    _gather(image16, sources, out.reshape(n_tiles, nb, -1).view(np.uint16))
    return out


# -- the tile loop ------------------------------------------------------------------------------


def _tile_product_codegen(name: str, n_tok: int):
    """IR of out[t:t+n_tok, o0:o0+8] = the tile's 8 rows times activation rows t.. (n_tok),
    for arguments (tile, xq, xd, xs, isum, t, n_blocks, out, o0)."""
    spec = TILE_FORMATS.get(name) or HEAD_FORMATS[name]
    n_acc = (LANE_ACCS if spec.lanes else 1) + (1 if spec.second else 0)
    acc_types = ([_V16F if WIDE_LANES else _V8F] * LANE_ACCS if spec.lanes else [_V8F]) + (
        [_V8F] if spec.second else []
    )
    block = spec.block
    block_bytes = tile_block_bytes(_layout_name(name))
    per_pass = LANE_TOKENS if spec.lanes else n_tok

    def codegen(context, builder, arg_types, args):
        tile_p = context.make_array(arg_types[0])(context, builder, args[0]).data
        t_v, nb_v, o0_v = args[5], args[6], args[8]
        arrays = [
            context.make_array(ty)(context, builder, v)
            for ty, v in zip(arg_types[1:5], args[1:5], strict=True)
        ]
        out_a = context.make_array(arg_types[7])(context, builder, args[7])
        out_cols = cgutils.unpack_tuple(builder, out_a.shape, 2)[1]
        toks, outs = [], []
        for k in range(n_tok):
            tk = builder.add(t_v, _c64(k))
            ptrs = []
            for a in arrays:  # C-contiguous 2-D: row tk starts at tk * shape[1]
                cols = cgutils.unpack_tuple(builder, a.shape, 2)[1]
                ptrs.append(builder.gep(a.data, [builder.mul(tk, cols)]))
            toks.append(_Tok(*ptrs, builder.gep(ptrs[3], [nb_v])))
            outs.append(builder.gep(out_a.data, [builder.add(builder.mul(tk, out_cols), o0_v)]))

        first_pass = builder.icmp_signed("==", t_v, _c64(0))

        def tile_pass(toks, outs, first):
            def step(bi, carried):
                accs = [carried[n_acc * k : n_acc * (k + 1)] for k in range(len(toks))]
                base = builder.mul(bi, _c64(block_bytes))
                # by the first activation rows' pass over the tile only: a later pass finds
                # the tile in cache (prefill's many rows)
                if first:
                    with builder.if_then(first_pass):
                        ahead = builder.add(base, _c64(PREFETCH_BYTES))
                        for line in range(0, block_bytes, 64):
                            at = builder.add(ahead, _c64(line))
                            prefetch(builder, builder.gep(tile_p, [at]))
                new = block(builder, tile_p, base, bi, toks, accs)
                return [v for per_tok in new for v in per_tok]

            zeros = [ir.Constant(ty, [0.0] * ty.count) for ty in acc_types] * len(toks)
            carried = counted_loop(builder, _c64(0), nb_v, 1, zeros, step)
            for k in range(len(toks)):
                mine = carried[n_acc * k : n_acc * (k + 1)]
                result = _lane_sum(builder, mine[:LANE_ACCS]) if spec.lanes else mine[0]
                if spec.second:  # min terms, summed apart as llama.cpp does, at the end
                    combine = builder.fsub if spec.second == "sub" else builder.fadd
                    result = combine(result, mine[-1])
                ptr = builder.bitcast(outs[k], _V8F.as_pointer())
                builder.store(result, ptr, align=4)

        for first in range(0, n_tok, per_pass):
            chunk = slice(first, first + per_pass)
            tile_pass(toks[chunk], outs[chunk], first == 0)

    return codegen


# -- the formats a compiled product holds ---------------------------------------------------------
#
# Every product kernel takes a FormatSet as its first argument: the formats it may meet, known
# when it is compiled (a model's, or one weight's), so that it holds the tile loops of those
# formats alone. The seven formats' loops in every kernel were a quarter of a cold start's
# compile time, for models that use one to three of them.

# a format's index: what the kernels' `fmt` arguments hold
TILE_NAMES = tuple(TILE_FORMATS) + tuple(HEAD_FORMATS)


class FormatSet:
    """The tile formats (indices into TILE_NAMES) a compiled call may meet; part of the type
    that Numba compiles the call for."""

    __slots__ = ("indices",)

    def __init__(self, indices):
        self.indices = tuple(sorted(set(int(i) for i in indices)))
        if not self.indices or not all(0 <= i < len(TILE_NAMES) for i in self.indices):
            raise ValueError(f"no tile formats {indices!r}")

    @property
    def q8k(self) -> tuple[bool, ...]:
        """For each activation kind the formats pair with, in order (Q8_0/Q8_1, Q8_K):
        whether any of them does."""
        names = (_layout_name(TILE_NAMES[i]) for i in self.indices)
        kinds = {block_format(name).activation == "Q8_K" for name in names}
        return (False in kinds, True in kinds)

    def __eq__(self, other) -> bool:
        return isinstance(other, FormatSet) and other.indices == self.indices

    def __hash__(self) -> int:
        return hash(self.indices)

    def __repr__(self) -> str:
        return f"FormatSet({', '.join(TILE_NAMES[i] for i in self.indices)})"


class FormatSetType(types.Type):
    def __init__(self, indices: tuple[int, ...]):
        self.indices = indices
        super().__init__(name=repr(FormatSet(indices)))


@typeof_impl.register(FormatSet)
def _typeof_format_set(value, context):
    return FormatSetType(value.indices)


register_model(FormatSetType)(models.OpaqueModel)


@unbox(FormatSetType)
def _unbox_format_set(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())  # nothing at run time: all in the type


def _make_tile_product(n_tok: int):
    @intrinsic
    def tile_product(typingctx, formats, fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0):
        """out[t:t+n_tok, o0:o0+8] = the tile (of format index fmt, one of `formats`) times
        activation rows t.. (n_tok); the last of the formats for any other fmt."""
        if not isinstance(formats, FormatSetType):
            return None
        bodies = [_tile_product_codegen(TILE_NAMES[i], n_tok) for i in formats.indices]

        def codegen(context, builder, sig, args):
            arg_types, inner = sig.args[2:], args[2:]
            if len(bodies) == 1:
                bodies[0](context, builder, arg_types, inner)
                return context.get_dummy_value()
            end = builder.append_basic_block("tile.done")
            cases = [builder.append_basic_block(f"tile.{i}") for i in formats.indices]
            switch = builder.switch(args[1], cases[-1])
            for index, case, body in zip(formats.indices, cases, bodies, strict=True):
                if case is not cases[-1]:
                    switch.add_case(ir.Constant(args[1].type, index), case)
                builder.position_at_end(case)
                body(context, builder, arg_types, inner)
                builder.branch(end)
            builder.position_at_end(end)
            return context.get_dummy_value()

        return types.void(formats, fmt, tile, xq, xd, xs, isum, t, n_blocks, out, o0), codegen

    return tile_product


# n_tok -> the product over n_tok tokens: a product over n tokens takes fours, then one
# product for the 1-3 left, so that each unpacked weight vector serves as many tokens as
# possible (speculation's checking passes are mostly 2-5 tokens)
TILE_TOKENS = (1, 2, 3, 4)
TILE_PRODUCTS = {n: _make_tile_product(n) for n in TILE_TOKENS}
