"""LLVM vector IR building blocks for the CPU kernels (used by tiles.py's intrinsics).

Numba's auto-vectorizer gives up on the 16- and 32-wide per-block loops of the quantized
formats, so the block arithmetic is emitted as vector IR directly. On AVX2 hosts the integer
dot product is `vpmaddubsw` + `vpmaddwd`, as in llama.cpp (`vpdpbusd` where AVX-512 VNNI is
there and no sub-block scales ride along); elsewhere it is generic vector IR that LLVM lowers
for any target, with the same lane layout.
"""

from __future__ import annotations

import os
import platform

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

from fastrun.backends.llamacpp_numerics import LANES
from fastrun.quant.fast import f16_round as _portable_f16_round

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
# FASTRUN_PORTABLE=1 forces the generic path (tests use it with a separate NUMBA_CACHE_DIR).
# The features are those Numba compiles for: the host's, or NUMBA_CPU_FEATURES where set, so
# one machine can build and measure another instruction set's path
# (scripts/bench_vs_llamacpp.py --isa).
_TARGET = numba_config.CPU_FEATURES
if _TARGET is None:
    _TARGET = llvm_binding.get_host_cpu_features().flatten()
_FEATURES = set(_TARGET.split(","))
HAS_AVX2 = "+avx2" in _FEATURES and not os.environ.get("FASTRUN_PORTABLE")
# vpdpbusd on 256-bit vectors does vpmaddubsw + vpmaddwd(1) + add in one: AVX-512 VNNI's
# (with VL) or AVX-VNNI's, its VEX form on laptops without AVX-512 (Alder Lake and later,
# Zen 5), which LLVM selects for the same intrinsic
HAS_VNNI = HAS_AVX2 and ({"+avx512vnni", "+avx512vl"} <= _FEATURES or "+avxvnni" in _FEATURES)
# 32 vector registers (16 below AVX-512): how many accumulators a tile product keeps live
HAS_AVX512 = HAS_AVX2 and "+avx512f" in _FEATURES
# vpdpbusd on 512-bit vectors, with AVX-512BW's byte operations beside it
HAS_VNNI512 = HAS_AVX512 and {"+avx512vnni", "+avx512bw"} <= _FEATURES


def vec(t, n):
    return ir.VectorType(t, n)


def splat(t, n, value):
    """A constant vector of n copies of value."""
    return ir.Constant(vec(t, n), [value] * n)


def lanes(values):
    """A constant <n x i32> lane list, for shufflevector."""
    return ir.Constant(vec(I32, len(values)), list(values))


def intrinsic_fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def block_partials(builder, w, x, signed: bool, scales16=None):
    """<32 x i8> weights . <32 x i8> activations as eight int32 partial sums (<8 x i32>);
    lane i holds products 4i..4i+3, times scales16[2i] (a <16 x i16> whose pairs are equal)
    when given: llama.cpp applies K-quant sub-block scales inside vpmaddwd this way.

    Unsigned weights must be < 128; signed ones use llama.cpp's trick |w| . (x with w's sign).
    """
    if HAS_AVX2:
        if signed:
            signf = intrinsic_fn(builder, "llvm.x86.avx2.psign.b", vec(I8, 32), [vec(I8, 32)] * 2)
            absf = intrinsic_fn(
                builder, "llvm.abs.v32i8", vec(I8, 32), [vec(I8, 32), ir.IntType(1)]
            )
            x = builder.call(signf, [x, w])
            w = builder.call(absf, [w, ir.Constant(ir.IntType(1), 0)])
        if HAS_VNNI and scales16 is None:  # exact: no int16 step, no saturation either way
            return dot_accumulate(builder, splat(I32, 8, 0), w, x)
        pairs = pair_products(builder, w, x)  # cannot saturate: |w| <= 128, |x| <= 127
        return widen_pairs(builder, pairs, scales16 if scales16 is not None else splat(I16, 16, 1))
    widen = builder.sext if signed else builder.zext
    products = builder.mul(widen(w, vec(I32, 32)), builder.sext(x, vec(I32, 32)))
    parts = [builder.shuffle_vector(products, products, lanes(range(k, 32, 4))) for k in range(4)]
    folded = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    if scales16 is None:
        return folded
    per_lane = builder.shuffle_vector(scales16, scales16, lanes(range(0, 16, 2)))
    return builder.mul(folded, builder.sext(per_lane, vec(I32, 8)))


def _even_plus_odd(builder, v):
    """<2n x T> -> <n x T>: lane i = v[2i] + v[2i + 1]."""
    n = v.type.count
    even = builder.shuffle_vector(v, v, lanes(range(0, n, 2)))
    return builder.add(even, builder.shuffle_vector(v, v, lanes(range(1, n, 2))))


def pair_products(builder, w, x):
    """<32 x i8> unsigned weights times <32 x i8> signed activations -> <16 x i16>, lane i =
    w[2i] x[2i] + w[2i+1] x[2i+1] (vpmaddubsw). Callers keep sums within int16, where the
    instruction's saturation never applies and the portable form is exact."""
    if HAS_AVX2:
        maddubs = intrinsic_fn(
            builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vec(I8, 32)] * 2
        )
        return builder.call(maddubs, [w, x])
    products = builder.mul(builder.zext(w, vec(I16, 32)), builder.sext(x, vec(I16, 32)))
    return _even_plus_odd(builder, products)


def dot_accumulate(builder, acc, w, x):
    """acc (<8 x i32>) plus, in lane i, the four products w[4i..4i+3] x[4i..4i+3] of
    unsigned weights and signed activations (<32 x i8> each): one vpdpbusd, exact in int32
    (HAS_VNNI hosts only)."""
    dpbusd = intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), [vec(I32, 8)] * 3)
    words = [builder.bitcast(v, vec(I32, 8)) for v in (w, x)]
    return builder.call(dpbusd, [acc, *words])


def dot_accumulate_512(builder, acc, w, x):
    """dot_accumulate on 512-bit vectors: <16 x i32> acc, <64 x i8> w and x (HAS_VNNI512)."""
    dpbusd = intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [vec(I32, 16)] * 3)
    words = [builder.bitcast(v, vec(I32, 16)) for v in (w, x)]
    return builder.call(dpbusd, [acc, *words])


def widen_pairs(builder, p, s):
    """<16 x i16> . <16 x i16> -> <8 x i32>: lane i = p[2i] s[2i] + p[2i+1] s[2i+1]
    (vpmaddwd)."""
    if HAS_AVX2:
        maddwd = intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16)] * 2)
        return builder.call(maddwd, [p, s])
    products = builder.mul(builder.sext(p, vec(I32, 16)), builder.sext(s, vec(I32, 16)))
    return _even_plus_odd(builder, products)


def prefetch(builder, ptr):
    """A hint to fetch the cache line at ptr (an i8 pointer) into every level; never faults."""
    i32 = ir.IntType(32)
    fn = intrinsic_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [ptr.type, i32, i32, i32])
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def counted_loop(builder, start, stop, step, init, body):
    """for i in range(start, stop, step): values = body(i, values); returns the final values
    (`init` when the loop runs zero times)."""
    pre = builder.block
    loop = builder.append_basic_block("loop")
    after = builder.append_basic_block("loop.done")
    builder.cbranch(builder.icmp_signed("<", start, stop), loop, after)
    builder.position_at_end(loop)
    i = builder.phi(ir.IntType(64))
    phis = [builder.phi(v.type) for v in init]
    new = body(i, phis)
    i_next = builder.add(i, ir.Constant(ir.IntType(64), step))
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


# Conversions to and from IEEE half in hardware: x86's F16C, or any 64-bit ARM (FCVT is in
# its base floating point). They are generic IR (fptrunc, fpext), so the portable path keeps
# them; FASTRUN_PORTABLE_HALF=0 takes the scalar steps instead (hosts without them).
_NATIVE_HALF = "+f16c" in _FEATURES or platform.machine().lower() in ("aarch64", "arm64")
HAS_F16C = _NATIVE_HALF and os.environ.get("FASTRUN_PORTABLE_HALF") != "0"


@intrinsic
def _f16_round_f16c(typingctx, x):
    """x rounded to the nearest IEEE half (ties to even), as float32: one vcvtps2ph and
    vcvtph2ps on x86 with F16C, two FCVTs on ARM (the same bits as quant.fast.f16_round,
    which does it in about twenty scalar steps)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(x), codegen


f16_round = _f16_round_f16c if HAS_F16C else _portable_f16_round


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c in float32, rounded once (llvm.fma: one vfmadd where the target has FMA, a
    vector of them in a vectorized loop; a libm call where it has none)."""
    f32 = types.float32

    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        return builder.call(intrinsic_fn(builder, "llvm.fma.f32", f, [f] * 3), args)

    return f32(f32, f32, f32), codegen


@intrinsic
def pow2_f64(typingctx, k):
    """2.0 ** k as float64, exactly, for integer k in [-1022, 1023] (its exponent bits)."""
    i64 = ir.IntType(64)

    def codegen(context, builder, sig, args):
        biased = builder.add(args[0], ir.Constant(i64, 1023))
        return builder.bitcast(builder.shl(biased, ir.Constant(i64, 52)), ir.DoubleType())

    return types.float64(types.int64), codegen


def lane_tree(builder, v):
    """The sum of a <16 x float> as _mm512_reduce_add_ps adds it (GCC's and Clang's
    headers): the halves added lane by lane, 512 -> 256 -> 128 bits, lanes 0 + 2 and 1 + 3,
    then those two."""
    half8 = builder.fadd(
        builder.shuffle_vector(v, v, lanes(range(8, 16))),
        builder.shuffle_vector(v, v, lanes(range(8))),
    )
    half4 = builder.fadd(
        builder.shuffle_vector(half8, half8, lanes(range(4, 8))),
        builder.shuffle_vector(half8, half8, lanes(range(4))),
    )
    pairs = builder.fadd(half4, builder.shuffle_vector(half4, half4, lanes((2, 3, 0, 1))))
    return builder.fadd(
        builder.extract_element(pairs, ir.Constant(I32, 0)),
        builder.extract_element(pairs, ir.Constant(I32, 1)),
    )


# Heads whose dot products dot_lanes interleaves: each chain waits on its fused
# multiply-adds in turn, so one alone leaves the core idle (Qwen2.5-1.5B's 6 heads a KV head,
# 512 rows, one thread: 40 us one at a time, 30 in pairs, 24 in threes; six no better)
DOT_HEADS = 3


@intrinsic
def dot_lanes(typingctx, q, k_cache, s, kv, out):
    """out[g] = q[g] . k_cache[s, kv] for every row g of q, as llama.cpp's tinyBLAS
    multiplies an fp16 K by an fp16 Q on AVX-512, bit for bit: lane i the fused multiply-add
    chain of elements i, i + 16, ... in order, the lanes then summed by lane_tree. q float32
    [G, hd] (the query heads of one KV head), k_cache float32 [rows, hk, hd], out float32
    [G], C-contiguous, hd a multiple of 16. The K row is read once for all G heads, and
    DOT_HEADS heads' chains run interleaved."""
    v16 = vec(ir.FloatType(), LANES)
    i64 = ir.IntType(64)

    def codegen(context, builder, sig, args):
        q_a, k_a = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1))
        out_a = context.make_array(sig.args[4])(context, builder, args[4])
        n_heads = cgutils.unpack_tuple(builder, q_a.shape, 2)[0]
        _, hk, hd = cgutils.unpack_tuple(builder, k_a.shape, 3)
        row = builder.add(builder.mul(args[2], hk), args[3])
        k_p = builder.gep(k_a.data, [builder.mul(row, hd)])
        fma = intrinsic_fn(builder, "llvm.fma.v16f32", v16, [v16] * 3)
        zero = ir.Constant(v16, [0.0] * LANES)

        def load(p, l):
            return builder.load(builder.bitcast(builder.gep(p, [l]), v16.as_pointer()), align=4)

        def heads(g, n):
            q_ps = [builder.gep(q_a.data, [builder.mul(builder.add(g, ir.Constant(i64, j)), hd)])
                    for j in range(n)]  # fmt: skip

            def block(l, accs):
                k_v = load(k_p, l)
                pairs = zip(q_ps, accs, strict=True)
                return [builder.call(fma, [load(q_p, l), k_v, acc]) for q_p, acc in pairs]

            accs = counted_loop(builder, ir.Constant(i64, 0), hd, LANES, [zero] * n, block)
            for j, acc in enumerate(accs):
                at = builder.add(g, ir.Constant(i64, j))
                builder.store(lane_tree(builder, acc), builder.gep(out_a.data, [at]))
            return []

        # whole groups of DOT_HEADS heads, then the rest one by one
        u = ir.Constant(i64, DOT_HEADS)
        whole = builder.mul(builder.sdiv(n_heads, u), u)
        counted_loop(
            builder, ir.Constant(i64, 0), whole, DOT_HEADS, [], lambda g, _: heads(g, DOT_HEADS)
        )
        counted_loop(builder, whole, n_heads, 1, [], lambda g, _: heads(g, 1))
        return context.get_dummy_value()

    return types.void(q, k_cache, s, kv, out), codegen


def _fma_rows(width: int, heads: int):
    """fma_rows(probs, p0, v_cache, row0, n_rows, row_step, kv, col, lanes, lane, g0): for each
    query head g of g0 .. g0 + heads - 1, lanes[g, lane, col : col + width] = the fused
    multiply-add chain, continued from its value there, over r < n_rows in order, of
    v_cache[row0 + r row_step, kv, col : col + width] times probs[g, p0 + r row_step] (one
    lane of llama.cpp's tinyBLAS product: dot_lanes), the sums in registers over the rows,
    each V row loaded once for all the heads. probs float32 [G, n], v_cache float32 [rows,
    hk, hd], lanes float32 [G, 16, hd], C-contiguous."""
    v16 = vec(ir.FloatType(), LANES)
    i64 = ir.IntType(64)
    n_vectors = width // LANES

    def fma_rows(typingctx, probs, p0, v_cache, row0, n_rows, row_step, kv, col, lanes,
                       lane, g0):  # fmt: skip
        sig = types.void(probs, p0, v_cache, row0, n_rows, row_step, kv, col, lanes, lane, g0)
        return sig, codegen

    def codegen(context, builder, sig, args):
        probs_a, v_a, lanes_a = (
            context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 2, 8)
        )
        p0_v, row0_v, n_v, step_v, kv_v, col_v, lane_v, g0_v = (
            args[i] for i in (1, 3, 4, 5, 6, 7, 9, 10)
        )
        _, hk, hd = cgutils.unpack_tuple(builder, v_a.shape, 3)
        n_probs = cgutils.unpack_tuple(builder, probs_a.shape, 2)[1]
        row_stride = builder.mul(hk, hd)
        base = builder.gep(v_a.data, [builder.add(builder.mul(kv_v, hd), col_v)])
        ptrs, prob_rows = [], []
        for h in range(heads):
            g = builder.add(g0_v, ir.Constant(i64, h))
            lane_row = builder.add(builder.mul(g, ir.Constant(i64, LANES)), lane_v)
            out_p = builder.gep(lanes_a.data, [builder.add(builder.mul(lane_row, hd), col_v)])
            ptrs += [builder.bitcast(builder.gep(out_p, [ir.Constant(i64, LANES * j)]),
                                     v16.as_pointer()) for j in range(n_vectors)]  # fmt: skip
            prob_rows.append(builder.gep(probs_a.data, [builder.mul(g, n_probs)]))
        init = [builder.load(p, align=4) for p in ptrs]
        fma = intrinsic_fn(builder, "llvm.fma.v16f32", v16, [v16] * 3)
        undef = ir.Constant(v16, ir.Undefined)
        broadcast = ir.Constant(vec(I32, LANES), [0] * LANES)

        def row(r, sums):
            at = builder.mul(r, step_v)
            v_row = builder.gep(base, [builder.mul(builder.add(row0_v, at), row_stride)])
            values = [
                builder.load(builder.bitcast(builder.gep(v_row, [ir.Constant(i64, LANES * j)]),
                                             v16.as_pointer()), align=4)
                for j in range(n_vectors)
            ]  # fmt: skip
            out = []
            for h in range(heads):
                p = builder.load(builder.gep(prob_rows[h], [builder.add(p0_v, at)]))
                pv = builder.shuffle_vector(
                    builder.insert_element(undef, p, ir.Constant(I32, 0)), undef, broadcast
                )
                mine = sums[h * n_vectors : (h + 1) * n_vectors]
                out += [builder.call(fma, [v, pv, s]) for v, s in zip(values, mine, strict=True)]
            return out

        sums = counted_loop(builder, ir.Constant(i64, 0), n_v, 1, init, row)
        for p, s in zip(ptrs, sums, strict=True):
            builder.store(s, p, align=4)
        return context.get_dummy_value()

    return intrinsic(fma_rows)


# One head's lane, every column at once for the usual head sizes (at most 16 of the 32
# AVX-512 vector registers), and 64 columns at a time for others; and the heads that share
# each V row's loads for 64 and 128 columns: 24 accumulators, the rest for the row's values
# and a probability
fma_rows_64, fma_rows_128, fma_rows_256 = (_fma_rows(w, 1) for w in (64, 128, 256))
FMA_HEADS_64, FMA_HEADS_128 = 6, 3
fma_rows_heads_64 = _fma_rows(64, FMA_HEADS_64)
fma_rows_heads_128 = _fma_rows(128, FMA_HEADS_128)
