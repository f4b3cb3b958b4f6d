"""Block dot products as LLVM vector IR, for the Numba kernels (numba.extending.intrinsic).

Numba's auto-vectorizer gives up on the 16- and 32-wide per-block loops of the quantized
formats, so each block's integer dot product is written here directly: load the packed
weights, unpack them to unsigned 8-bit values, multiply with the int8 activations and sum to
one int32. On AVX2 hosts that is `vpmaddubsw` + `vpmaddwd` (what llama.cpp uses); elsewhere
generic vector IR that LLVM lowers for any target. fp16 scales load with `vcvtph2ps` (F16C).

Every function takes (array, element offset) pairs; arrays are 1-D uint8 (weights) or int8
(activations). Unpacked weight values must stay below 128 (they are at most 63 here).
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
HAS_AVX2 = "+avx2" in llvm_binding.get_host_cpu_features().flatten().split(",")


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, value):
    return ir.Constant(_vec(t, n), [value] * n)


def _lanes(values):
    return ir.Constant(_vec(_I32, len(values)), list(values))


def _load(context, builder, aryty, ary, offset, ty):
    """Load `ty` from &ary[offset] (unaligned)."""
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.bitcast(builder.gep(data, [offset]), ty.as_pointer())
    return builder.load(ptr, align=1)


def _reduce_add(builder, v, n):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_I32, [_vec(_I32, n)]), f"llvm.vector.reduce.add.v{n}i32"
    )
    return builder.call(fn, [v])


def _dot_u8_s8(builder, w, x, n):
    """<n x i8> unsigned weights (< 128) . <n x i8> signed activations -> i32, n = 16 or 32."""
    if HAS_AVX2:
        suffix = ("avx2", "") if n == 32 else ("ssse3", ".128")
        maddubs = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(_vec(_I16, n // 2), [_vec(_I8, n), _vec(_I8, n)]),
            f"llvm.x86.{suffix[0]}.pmadd.ub.sw{suffix[1]}",
        )
        maddwd = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(_vec(_I32, n // 4), [_vec(_I16, n // 2), _vec(_I16, n // 2)]),
            f"llvm.x86.{'avx2' if n == 32 else 'sse2'}.pmadd.wd",
        )
        pairs = builder.call(maddubs, [w, x])  # products cannot saturate: |w| < 128
        quads = builder.call(maddwd, [pairs, _splat(_I16, n // 2, 1)])
        return _reduce_add(builder, quads, n // 4)
    products = builder.mul(builder.zext(w, _vec(_I32, n)), builder.sext(x, _vec(_I32, n)))
    return _reduce_add(builder, products, n)


def _nibbles(builder, packed, shift, n):
    """(packed >> shift) & 15 on <n x i8>."""
    if shift:
        packed = builder.lshr(packed, _splat(_I8, n, shift))
    return builder.and_(packed, _splat(_I8, n, 15))


@intrinsic
def load_f16(typingctx, ary, offset):
    """The IEEE half at bytes ary[offset:offset+2] as float32."""

    def codegen(context, builder, sig, args):
        half = _load(context, builder, sig.args[0], args[0], args[1], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(ary, offset), codegen


@intrinsic
def dot_q4_32(typingctx, w, wo, x, xo):
    """16 bytes at w[wo] hold 32 nibbles (low nibbles are values 0..15, high 16..31), times
    32 int8 at x[xo]. The Q4_0/Q4_1 block layout; nibbles are unsigned."""

    def codegen(context, builder, sig, args):
        packed = _load(context, builder, sig.args[0], args[0], args[1], _vec(_I8, 16))
        lo = _nibbles(builder, packed, 0, 16)
        hi = _nibbles(builder, packed, 4, 16)
        vals = builder.shuffle_vector(lo, hi, _lanes(range(32)))
        act = _load(context, builder, sig.args[2], args[2], args[3], _vec(_I8, 32))
        return _dot_u8_s8(builder, vals, act, 32)

    return types.int32(w, wo, x, xo), codegen


@intrinsic
def dot_q5_32(typingctx, w, wo, qo, x, xo):
    """Q5_0/Q5_1: nibbles as dot_q4_32 at w[wo], fifth bits in the 32-bit word at w[qo]."""

    def codegen(context, builder, sig, args):
        packed = _load(context, builder, sig.args[0], args[0], args[1], _vec(_I8, 16))
        lo = _nibbles(builder, packed, 0, 16)
        hi = _nibbles(builder, packed, 4, 16)
        vals = builder.shuffle_vector(lo, hi, _lanes(range(32)))
        bits = _load(context, builder, sig.args[0], args[0], args[2], _I32)
        mask = builder.bitcast(bits, _vec(ir.IntType(1), 32))
        vals = builder.or_(vals, builder.shl(builder.zext(mask, _vec(_I8, 32)), _splat(_I8, 32, 4)))
        act = _load(context, builder, sig.args[3], args[3], args[4], _vec(_I8, 32))
        return _dot_u8_s8(builder, vals, act, 32)

    return types.int32(w, wo, qo, x, xo), codegen


@intrinsic
def dot_q8_32(typingctx, w, wo, x, xo):
    """32 signed int8 weights at w[wo] (uint8 storage) times 32 int8 at x[xo]."""

    def codegen(context, builder, sig, args):
        wv = _load(context, builder, sig.args[0], args[0], args[1], _vec(_I8, 32))
        act = _load(context, builder, sig.args[2], args[2], args[3], _vec(_I8, 32))
        if HAS_AVX2:  # llama.cpp's trick: |w| (unsigned) times x carrying w's sign
            absf = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(_vec(_I8, 32), [_vec(_I8, 32), ir.IntType(1)]),
                "llvm.abs.v32i8",
            )
            signf = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(_vec(_I8, 32), [_vec(_I8, 32), _vec(_I8, 32)]),
                "llvm.x86.avx2.psign.b",
            )
            magnitude = builder.call(absf, [wv, ir.Constant(ir.IntType(1), 0)])
            return _dot_u8_s8(builder, magnitude, builder.call(signf, [act, wv]), 32)
        products = builder.mul(builder.sext(wv, _vec(_I32, 32)), builder.sext(act, _vec(_I32, 32)))
        return _reduce_add(builder, products, 32)

    return types.int32(w, wo, x, xo), codegen


@intrinsic
def dot_k4_32(typingctx, w, wo, shift, x, xo):
    """Q4_K sub-block: (w[wo+l] >> shift) & 15 for l < 32, times 32 int8 at x[xo]."""

    def codegen(context, builder, sig, args):
        packed = _load(context, builder, sig.args[0], args[0], args[1], _vec(_I8, 32))
        s = builder.trunc(args[2], _I8)
        vals = builder.and_(builder.lshr(packed, _splat_dyn(builder, s, 32)), _splat(_I8, 32, 15))
        act = _load(context, builder, sig.args[3], args[3], args[4], _vec(_I8, 32))
        return _dot_u8_s8(builder, vals, act, 32)

    return types.int32(w, wo, shift, x, xo), codegen


@intrinsic
def dot_k5_32(typingctx, w, wo, shift, ho, bit, x, xo):
    """Q5_K sub-block: nibbles as dot_k4_32 plus bit `bit` of w[ho+l] as the fifth bit."""

    def codegen(context, builder, sig, args):
        packed = _load(context, builder, sig.args[0], args[0], args[1], _vec(_I8, 32))
        s = builder.trunc(args[2], _I8)
        vals = builder.and_(builder.lshr(packed, _splat_dyn(builder, s, 32)), _splat(_I8, 32, 15))
        high = _load(context, builder, sig.args[0], args[0], args[3], _vec(_I8, 32))
        b = builder.trunc(args[4], _I8)
        high = builder.and_(builder.lshr(high, _splat_dyn(builder, b, 32)), _splat(_I8, 32, 1))
        vals = builder.or_(vals, builder.shl(high, _splat(_I8, 32, 4)))
        act = _load(context, builder, sig.args[5], args[5], args[6], _vec(_I8, 32))
        return _dot_u8_s8(builder, vals, act, 32)

    return types.int32(w, wo, shift, ho, bit, x, xo), codegen


@intrinsic
def dot_k6_16(typingctx, w, lo, lshift, hi, hshift, x, xo):
    """Q6_K group of 16: ((w[lo+l] >> lshift) & 15) | (((w[hi+l] >> hshift) & 3) << 4),
    unsigned 0..63 (the caller subtracts 32 * sum(x)), times 16 int8 at x[xo]."""

    def codegen(context, builder, sig, args):
        low = _load(context, builder, sig.args[0], args[0], args[1], _vec(_I8, 16))
        ls = builder.trunc(args[2], _I8)
        low = builder.and_(builder.lshr(low, _splat_dyn(builder, ls, 16)), _splat(_I8, 16, 15))
        high = _load(context, builder, sig.args[0], args[0], args[3], _vec(_I8, 16))
        hs = builder.trunc(args[4], _I8)
        high = builder.and_(builder.lshr(high, _splat_dyn(builder, hs, 16)), _splat(_I8, 16, 3))
        vals = builder.or_(low, builder.shl(high, _splat(_I8, 16, 4)))
        act = _load(context, builder, sig.args[5], args[5], args[6], _vec(_I8, 16))
        return _dot_u8_s8(builder, vals, act, 16)

    return types.int32(w, lo, lshift, hi, hshift, x, xo), codegen


def _splat_dyn(builder, scalar, n):
    """A runtime scalar broadcast to <n x i8>."""
    undef = ir.Constant(_vec(_I8, n), ir.Undefined)
    first = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(_vec(_I32, n), [0] * n))
