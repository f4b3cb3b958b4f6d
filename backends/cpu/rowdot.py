"""Whole-row dot products of quantized weights, as LLVM IR loops (numba intrinsics).

One call takes a weight row of blocks times T activation rows (T = 1 for decode, 4 for
prefill). Each block is unpacked once, multiplied with every activation row by
`simd.block_partials` into eight int32 lanes, scaled and accumulated in a float vector; one
horizontal sum per row at the end. Numba's own loops cannot reach this (see simd.py).

A block format is a `block` function here that emits, for one block and each token, the
int32 lanes, the float scale that multiplies them, and a correction (Q4_1's min: a float;
the K-quant mins: four float lanes, reduced once per row as llama.cpp does; none where the
offset is folded into the integer lanes). Arrays passed in: row uint8 [row_bytes]; xq int8
[n, n_in]; xd float32 [n, *] activation scales; xs float32 [n, *] (Q8_1 scaled sums); isum
int32 [n, *] (integer block sums for Q8_0, 16-value sums for Q8_K).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fastrun.backends.cpu.simd import (
    I8,
    I16,
    I32,
    block_partials,
    lanes,
    splat,
    unpack_nibbles32,
    vec,
)

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V8F = vec(_F32, 8)
_V8I = vec(I32, 8)


def _c64(v):
    return ir.Constant(_I64, v)


def _load(builder, base, offset, ty):
    ptr = builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())
    return builder.load(ptr, align=1)


def _f16(builder, base, offset):
    return builder.fpext(_load(builder, base, offset, ir.HalfType()), _F32)


def _byte(builder, base, offset):
    return builder.zext(_load(builder, base, offset, I8), I32)


def _splat_val(builder, value, ty, n=8):
    undef = ir.Constant(vec(ty, n), ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(vec(I32, n), [0] * n))


def _hsum_f8(builder, v):
    """Sum of 8 float lanes in llama.cpp's hsum_float_8 order: ((0+4)+(2+6)) + ((1+5)+(3+7))."""
    a = [builder.extract_element(v, ir.Constant(I32, i)) for i in range(8)]
    b = [builder.fadd(a[i], a[i + 4]) for i in range(4)]
    return builder.fadd(builder.fadd(b[0], b[2]), builder.fadd(b[1], b[3]))


class _Tok:
    """Pointers into one token's activation arrays."""

    def __init__(self, x, xd, xs, isum):
        self.x, self.xd, self.xs, self.isum = x, xd, xs, isum

    def x32(self, builder, offset):
        return _load(builder, self.x, offset, vec(I8, 32))


# -- block formats of 32 values (activation Q8_0 / Q8_1) -----------------------------------------


def _b32(block_bytes, qs_at, qh_at=-1, offset=0, has_min=False, signed=False):
    """A 32-value format; its correction term (Q4_1's min) is one float per block."""

    def block(builder, row, base, b, toks):
        d = _f16(builder, row, base)
        qs = builder.gep(row, [builder.add(base, _c64(qs_at))])
        if signed:
            vals = _load(builder, qs, _c64(0), vec(I8, 32))
        else:
            qh = _load(builder, row, builder.add(base, _c64(qh_at)), I32) if qh_at >= 0 else None
            vals = unpack_nibbles32(builder, qs, qh)
            if offset:  # as llama.cpp: subtract in int8, then the signed product
                vals = builder.sub(vals, splat(I8, 32, offset))
        m = _f16(builder, row, builder.add(base, _c64(2))) if has_min else None
        out = []
        for tok in toks:
            xv = tok.x32(builder, builder.mul(b, _c64(32)))
            part = block_partials(builder, vals, xv, signed or bool(offset))
            scale = builder.fmul(d, builder.load(builder.gep(tok.xd, [b])))
            extra = ir.Constant(_F32, 0.0)
            if has_min:  # Q4_1: + m * s, s the activation's fp16 scaled block sum
                extra = builder.fmul(m, builder.load(builder.gep(tok.xs, [b])))
            out.append((part, scale, extra))
        return out

    return block, 32, block_bytes, 1


# -- K-quant super-blocks of 256 values (activation Q8_K) ---------------------------------------


def _k_scales(builder, row, at):
    """The 8 six-bit scales (<8 x i16>) and mins (<8 x i32>) of Q4_K/Q5_K from the 12 bytes at
    row[at], unpacked four at a time in 32-bit words with llama.cpp's masks."""
    u0, u1, u2 = (_load(builder, row, builder.add(at, _c64(4 * i)), I32) for i in range(3))
    k1, k2, k3 = (ir.Constant(I32, v) for v in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
    c4, c6 = ir.Constant(I32, 4), ir.Constant(I32, 6)

    def high_bits(word):  # bits 6-7 of each byte of word, moved to bits 4-5
        return builder.shl(builder.and_(builder.lshr(word, c6), k3), c4)

    scales = (builder.and_(u0, k1), builder.or_(builder.and_(u2, k2), high_bits(u0)))
    mins = (
        builder.and_(u1, k1),
        builder.or_(builder.and_(builder.lshr(u2, c4), k2), high_bits(u1)),
    )

    def bytes8(pair, ty):
        words = ir.Constant(vec(I32, 2), ir.Undefined)
        for i, w in enumerate(pair):
            words = builder.insert_element(words, w, ir.Constant(I32, i))
        return builder.zext(builder.bitcast(words, vec(I8, 8)), vec(ty, 8))

    return bytes8(scales, I16), bytes8(mins, I32)


def _add_partials(builder, totals, toks, v, x_at, scales16):
    """totals[k] += scaled partial sums of 32 unsigned weights v against token k's 32
    activations at x_at (one unpacked weight vector, every token)."""
    for k, tok in enumerate(toks):
        part = block_partials(builder, v, tok.x32(builder, x_at), False, scales16)
        totals[k] = part if totals[k] is None else builder.add(totals[k], part)


def _pair_sums(builder, v):
    """<2n x i32> -> <n x i32>: lane i = v[2i] + v[2i + 1]."""
    n = v.type.count
    even = builder.shuffle_vector(v, v, lanes(range(0, n, 2)))
    return builder.add(even, builder.shuffle_vector(v, v, lanes(range(1, n, 2))))


def _k45(fifth_bit: bool):
    block_bytes, qs_at = (176, 48) if fifth_bit else (144, 16)

    def block(builder, row, base, b, toks):
        d = _f16(builder, row, base)
        dmin = _f16(builder, row, builder.add(base, _c64(2)))
        scales, mins = _k_scales(builder, row, builder.add(base, _c64(4)))
        x0 = builder.mul(b, _c64(256))
        totals = [None] * len(toks)
        for j in range(8):  # sub-block outer, tokens inner: one unpacked vector live at a time
            packed = _load(
                builder, row, builder.add(base, _c64(qs_at + 32 * (j // 2))), vec(I8, 32)
            )
            if j % 2:
                packed = builder.lshr(packed, splat(I8, 32, 4))
            v = builder.and_(packed, splat(I8, 32, 15))
            if fifth_bit:
                high = _load(builder, row, builder.add(base, _c64(16)), vec(I8, 32))
                high = builder.and_(builder.lshr(high, splat(I8, 32, j)), splat(I8, 32, 1))
                v = builder.or_(v, builder.shl(high, splat(I8, 32, 4)))
            scale_j = builder.shuffle_vector(scales, scales, lanes([j] * 16))  # <16 x i16>
            _add_partials(builder, totals, toks, v, builder.add(x0, _c64(32 * j)), scale_j)
        out = []
        for k, tok in enumerate(toks):
            xd = builder.load(builder.gep(tok.xd, [b]))
            # min term, as llama.cpp: four float lanes of -dmin * xd * (mn_j * s_j summed in
            # pairs of sub-blocks), s_j the sum of sub-block j's 32 activations; reduced once
            sums = _load(builder, tok.isum, builder.mul(b, _c64(16)), vec(I32, 16))
            prods = builder.mul(_pair_sums(builder, sums), mins)
            neg_dmin = builder.fsub(ir.Constant(_F32, 0.0), builder.fmul(xd, dmin))
            extra = builder.fmul(
                _splat_val(builder, neg_dmin, _F32, 4),
                builder.sitofp(_pair_sums(builder, prods), vec(_F32, 4)),
            )
            out.append((totals[k], builder.fmul(d, xd), extra))
        return out

    return block, 256, block_bytes, 4


def _q6k(builder, row, base, b, toks):
    """Q6_K: ql[128], qh[64], int8 scales[16], d; values 0..63 stored as q + 32."""
    d = _f16(builder, row, builder.add(base, _c64(208)))
    scales8 = _load(builder, row, builder.add(base, _c64(192)), vec(I8, 16))
    scales = builder.sext(scales8, vec(I32, 16))
    scales16 = builder.sext(scales8, vec(I16, 16))
    x0 = builder.mul(b, _c64(256))
    totals = [None] * len(toks)
    for half in range(2):
        for quarter in range(4):  # values outer, tokens inner: one unpacked vector live at a time
            lo = _load(
                builder, row, builder.add(base, _c64(64 * half + 32 * (quarter % 2))), vec(I8, 32)
            )
            if quarter >= 2:
                lo = builder.lshr(lo, splat(I8, 32, 4))
            lo = builder.and_(lo, splat(I8, 32, 15))
            hi = _load(builder, row, builder.add(base, _c64(128 + 32 * half)), vec(I8, 32))
            hi = builder.and_(builder.lshr(hi, splat(I8, 32, 2 * quarter)), splat(I8, 32, 3))
            v = builder.or_(lo, builder.shl(hi, splat(I8, 32, 4)))
            g = 8 * half + 2 * quarter  # lanes 0-3 hold values 0-15 (scale g), 4-7 the next 16
            lane_scales = builder.shuffle_vector(scales16, scales16, lanes([g] * 8 + [g + 1] * 8))
            x_at = builder.add(x0, _c64(32 * (4 * half + quarter)))
            _add_partials(builder, totals, toks, v, x_at, lane_scales)
    out = []
    for k, tok in enumerate(toks):
        xd = builder.load(builder.gep(tok.xd, [b]))
        # offset, in the integer lanes as llama.cpp subtracts it: - 32 * sum_g scale_g * (sum
        # of the 16 activations of group g)
        sums = _load(builder, tok.isum, builder.mul(b, _c64(16)), vec(I32, 16))
        offset = builder.shl(_pair_sums(builder, builder.mul(sums, scales)), splat(I32, 8, 5))
        out.append((builder.sub(totals[k], offset), builder.fmul(d, xd), None))
    return out


# name -> (block function, values per block, bytes per block, correction lanes)
BLOCKS = {
    "Q4_0": _b32(18, 2, offset=8),
    "Q4_1": _b32(20, 4, has_min=True),
    "Q5_0": _b32(22, 6, qh_at=2, offset=16),
    "Q8_0": _b32(34, 2, signed=True),
    "Q4_K": _k45(False),
    "Q5_K": _k45(True),
    "Q6_K": (_q6k, 256, 210, 0),
}


# -- the row loop -------------------------------------------------------------------------------


def counted_loop(builder, start, stop, step, init, body):
    """for i in range(start, stop, step): values = body(i, values); returns the final values
    (`init` when the loop runs zero times)."""
    pre = builder.block
    loop = builder.append_basic_block("loop")
    after = builder.append_basic_block("loop.done")
    builder.cbranch(builder.icmp_signed("<", start, stop), loop, after)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    phis = [builder.phi(v.type) for v in init]
    new = body(i, phis)
    i_next = builder.add(i, _c64(step))
    end = builder.block
    builder.cbranch(builder.icmp_signed("<", i_next, stop), loop, after)
    i.add_incoming(start, pre)
    i.add_incoming(i_next, end)
    for phi, v0, v1 in zip(phis, init, new, strict=True):
        phi.add_incoming(v0, pre)
        phi.add_incoming(v1, end)
    builder.position_at_end(after)
    outs = [builder.phi(v.type) for v in init]
    for out, v0, v1 in zip(outs, init, new, strict=True):
        out.add_incoming(v0, pre)
        out.add_incoming(v1, end)
    return outs


def _hsum_f4(builder, v):
    """Sum of 4 float lanes as llama.cpp reduces its K-quant min terms: (0+2) + (1+3)."""
    a = [builder.extract_element(v, ir.Constant(I32, i)) for i in range(4)]
    return builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))


def _make_rowdot(block, values_per_block: int, block_bytes: int, extra_lanes: int, n_tok: int):
    """extra_lanes: the block's correction term is None (0), a float (1) or <4 x float> (4)."""

    @intrinsic
    def rowdot(typingctx, row, xq, xd, xs, isum, t, n_blocks):
        ret = types.float32 if n_tok == 1 else types.UniTuple(types.float32, n_tok)

        def codegen(context, builder, sig, args):
            row_v, t_v, nb_v = args[0], args[5], args[6]
            rowp = context.make_array(sig.args[0])(context, builder, row_v).data
            arrays = [
                context.make_array(ty)(context, builder, v)
                for ty, v in zip(sig.args[1:5], args[1:5], strict=True)
            ]
            toks = []
            for k in range(n_tok):
                tk = builder.add(t_v, _c64(k))
                ptrs = []
                for a in arrays:  # C-contiguous 2-D: row tk starts at tk * shape[1]
                    cols = cgutils.unpack_tuple(builder, a.shape, 2)[1]
                    ptrs.append(builder.gep(a.data, [builder.mul(tk, cols)]))
                toks.append(_Tok(*ptrs))

            def step(bi, carried, lane):
                """Accumulate block bi into accumulator set `lane` of carried."""
                out = list(carried)
                results = block(builder, rowp, builder.mul(bi, _c64(block_bytes)), bi, toks)
                for k, (part, scale, extra) in enumerate(results):
                    at = 2 * (lane * n_tok + k)
                    prod = builder.fmul(
                        builder.sitofp(part, _V8F), _splat_val(builder, scale, _F32)
                    )
                    out[at] = builder.fadd(out[at], prod)
                    if extra_lanes:
                        out[at + 1] = builder.fadd(out[at + 1], extra)
                return out

            # One accumulator per token, blocks in order, FMA: llama.cpp's summation order,
            # which keeps results close to its own (the model is sensitive to rounding).
            sets = 1
            zero_v = ir.Constant(_V8F, [0.0] * 8)
            zero = ir.Constant(vec(_F32, 4), [0.0] * 4) if extra_lanes == 4 else _F32(0.0)
            init = [zero_v, zero] * (sets * n_tok)
            main_stop = builder.mul(builder.sdiv(nb_v, _c64(sets)), _c64(sets))

            def unrolled(bi, carried):
                for lane in range(sets):
                    carried = step(builder.add(bi, _c64(lane)), carried, lane)
                return carried

            carried = counted_loop(builder, _c64(0), main_stop, sets, init, unrolled)
            if sets > 1:
                carried = counted_loop(
                    builder, main_stop, nb_v, 1, carried, lambda bi, c: step(bi, c, 0)
                )
            sums = []
            for k in range(n_tok):
                acc, extra = carried[2 * k], carried[2 * k + 1]
                for lane in range(1, sets):
                    acc = builder.fadd(acc, carried[2 * (lane * n_tok + k)])
                    extra = builder.fadd(extra, carried[2 * (lane * n_tok + k) + 1])
                if extra_lanes == 4:
                    extra = _hsum_f4(builder, extra)
                total = _hsum_f8(builder, acc)
                sums.append(builder.fadd(total, extra) if extra_lanes else total)
            return sums[0] if n_tok == 1 else context.make_tuple(builder, sig.return_type, sums)

        return ret(row, xq, xd, xs, isum, t, n_blocks), codegen

    return rowdot


# name -> (values per block, one-token rowdot, four-token rowdot)
ROWDOT = {
    name: (spec[1], _make_rowdot(*spec, 1), _make_rowdot(*spec, 4)) for name, spec in BLOCKS.items()
}
