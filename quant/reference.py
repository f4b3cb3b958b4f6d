"""NumPy reference quantization: the specification every fast kernel is tested against.

Block layouts follow llama.cpp's ggml-common.h byte for byte; quantizers follow its
`quantize_row_*_ref` rounding (truncation after +0.5 offsets for the 4/5-bit types,
round half away from zero for Q8_0/Q8_1, round half to even for Q8_K).
"""

from __future__ import annotations

import numpy as np

from fastrun.formats.errors import GGUFError
from fastrun.quant.formats import QK_K, block_format

_f16 = np.dtype("<f2")

# Structured views of one block of each format (field order = byte order).
BLOCK_DTYPES = {
    "Q4_0": np.dtype([("d", _f16), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", _f16), ("m", _f16), ("qs", "u1", 16)]),
    "Q5_0": np.dtype([("d", _f16), ("qh", "<u4"), ("qs", "u1", 16)]),
    "Q5_1": np.dtype([("d", _f16), ("m", _f16), ("qh", "<u4"), ("qs", "u1", 16)]),
    "Q8_0": np.dtype([("d", _f16), ("qs", "i1", 32)]),
    "Q8_1": np.dtype([("d", _f16), ("s", _f16), ("qs", "i1", 32)]),
    "Q4_K": np.dtype([("d", _f16), ("dmin", _f16), ("scales", "u1", 12), ("qs", "u1", 128)]),
    "Q5_K": np.dtype(
        [("d", _f16), ("dmin", _f16), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)]
    ),
    "Q6_K": np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", _f16)]),
    "Q8_K": np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)]),
}


def _blocks(data: np.ndarray, name: str, n: int) -> np.ndarray:
    fmt = block_format(name)
    nb = n // fmt.block_size
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size < nb * fmt.block_bytes:
        raise GGUFError(f"{name}: {raw.size} bytes hold fewer than {n} values")
    return raw[: nb * fmt.block_bytes].view(BLOCK_DTYPES[name])


def _f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] packed bytes -> [nb, 32]: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int32)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """[nb] uint32 -> [nb, 32] fifth bits."""
    return ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K 12-byte scale fields [nb, 12] into 6-bit scales and mins [nb, 8]."""
    s = scales.astype(np.int32)
    sc = np.empty((s.shape[0], 8), np.int32)
    mn = np.empty((s.shape[0], 8), np.int32)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _deq_q4_0(b):
    return _f32(b["d"])[:, None] * (_nibbles(b["qs"]) - 8)


def _deq_q4_1(b):
    return _f32(b["d"])[:, None] * _nibbles(b["qs"]) + _f32(b["m"])[:, None]


def _deq_q5_0(b):
    q = _nibbles(b["qs"]) | (_qh_bits(b["qh"]) << 4)
    return _f32(b["d"])[:, None] * (q - 16)


def _deq_q5_1(b):
    q = _nibbles(b["qs"]) | (_qh_bits(b["qh"]) << 4)
    return _f32(b["d"])[:, None] * q + _f32(b["m"])[:, None]


def _deq_q8_0(b):
    return _f32(b["d"])[:, None] * b["qs"].astype(np.float32)


def _k_quant_values(b, fifth_bit: bool) -> np.ndarray:
    """Q4_K/Q5_K integer values [nb, 8, 32]: 4 chunks of 32 bytes, low nibbles then high."""
    qs = b["qs"].reshape(-1, 4, 32).astype(np.int32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    if fifth_bit:
        qh = b["qh"].astype(np.int32)  # [nb, 32]; bit j of qh[l] belongs to sub-block j
        bits = (qh[:, None, :] >> np.arange(8)[None, :, None]) & 1
        q = q | (bits << 4)
    return q


def _deq_k(b, fifth_bit: bool):
    sc, mn = k_scales_mins(b["scales"])
    d = _f32(b["d"])[:, None] * sc
    m = _f32(b["dmin"])[:, None] * mn
    q = _k_quant_values(b, fifth_bit)
    return (d[:, :, None] * q - m[:, :, None]).reshape(-1, QK_K)


def q6_k_values(b) -> np.ndarray:
    """Q6_K signed integer values [nb, 256] (-32..31)."""
    ql = b["ql"].reshape(-1, 2, 64).astype(np.int32)
    qh = b["qh"].reshape(-1, 2, 32).astype(np.int32)
    lo = np.concatenate(
        [ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2
    )
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    return ((lo | (hi << 4)) - 32).reshape(-1, QK_K)


def _deq_q6_k(b):
    q = q6_k_values(b).reshape(-1, 16, 16)
    d = _f32(b["d"])[:, None] * b["scales"].astype(np.float32)
    return (d[:, :, None] * q).reshape(-1, QK_K)


def _deq_q8_k(b):
    return b["d"][:, None] * b["qs"].astype(np.float32)


_DEQUANT = {
    "Q4_0": _deq_q4_0,
    "Q4_1": _deq_q4_1,
    "Q5_0": _deq_q5_0,
    "Q5_1": _deq_q5_1,
    "Q8_0": _deq_q8_0,
    "Q8_1": _deq_q8_0,
    "Q4_K": lambda b: _deq_k(b, False),
    "Q5_K": lambda b: _deq_k(b, True),
    "Q6_K": _deq_q6_k,
    "Q8_K": _deq_q8_k,
}


def dequantize_ref(data: np.ndarray, qtype: str | int, n: int) -> np.ndarray:
    """Dequantize the first n values of raw block bytes to float32 [n]."""
    fmt = block_format(qtype)
    if n % fmt.block_size:
        raise GGUFError(f"{fmt.name}: {n} values are not a whole number of blocks")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if fmt.name == "F32":
        return raw[: 4 * n].view("<f4").astype(np.float32)
    if fmt.name == "F16":
        return raw[: 2 * n].view(_f16).astype(np.float32)
    if fmt.name == "BF16":
        return (raw[: 2 * n].view("<u2").astype(np.uint32) << 16).view(np.float32)
    return _DEQUANT[fmt.name](_blocks(raw, fmt.name, n)).reshape(-1).astype(np.float32)


# -- quantizers ---------------------------------------------------------------------------------


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row, the value of largest magnitude, with its sign (first one on ties)."""
    return x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _pack_qh(q: np.ndarray) -> np.ndarray:
    bits = ((q >> 4) & 1).astype(np.uint32)
    return (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: round half away from zero."""
    return np.trunc(x + np.copysign(np.float32(0.5), x)).astype(np.float32)


def _q_sym(x, levels_half: int):
    """Q4_0/Q5_0: d = signed max / -levels_half, q = trunc(x/d + levels_half + 0.5)."""
    mx = _signed_absmax(x)
    d = (mx / -levels_half).astype(np.float32)
    q = np.trunc(x * _inv(d)[:, None] + np.float32(levels_half + 0.5))
    return d, np.minimum(2 * levels_half - 1, q).astype(np.int32)


def _q_affine(x, levels: int):
    """Q4_1/Q5_1: d = (max - min) / levels, q = trunc((x - min)/d + 0.5)."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = ((hi - lo) / levels).astype(np.float32)
    q = np.trunc((x - lo[:, None]) * _inv(d)[:, None] + np.float32(0.5))
    return d, lo, np.minimum(levels, q).astype(np.int32)


def _quant_q4_0(x, out):
    d, q = _q_sym(x, 8)
    out["d"], out["qs"] = d, _pack_nibbles(q)


def _quant_q4_1(x, out):
    d, lo, q = _q_affine(x, 15)
    out["d"], out["m"], out["qs"] = d, lo, _pack_nibbles(q)


def _quant_q5_0(x, out):
    d, q = _q_sym(x, 16)
    out["d"], out["qh"], out["qs"] = d, _pack_qh(q), _pack_nibbles(q & 15)


def _quant_q5_1(x, out):
    d, lo, q = _q_affine(x, 31)
    out["d"], out["m"], out["qh"], out["qs"] = d, lo, _pack_qh(q), _pack_nibbles(q & 15)


def _q8(x):
    d = (np.abs(x).max(axis=1) / 127).astype(np.float32)
    return d, round_away(x * _inv(d)[:, None]).astype(np.int8)


def _quant_q8_0(x, out):
    out["d"], out["qs"] = _q8(x)


def _quant_q8_1(x, out):
    d, q = _q8(x)
    out["d"], out["qs"] = d, q
    out["s"] = d * q.astype(np.int32).sum(axis=1).astype(np.float32)


def _quant_q8_k(x, out):
    """llama.cpp's quantize_row_q8_K_ref (x86 uses it too): iscale = -127 / signed max, one
    rounding; q = round half to even of iscale * x, at most 127; d = 1 / iscale."""
    mx = _signed_absmax(x)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
    q = np.minimum(127, np.rint(x * iscale[:, None])).astype(np.int8)
    out["d"] = _inv(iscale)
    out["qs"] = q
    out["bsums"] = q.reshape(-1, 16, 16).astype(np.int16).sum(axis=2, dtype=np.int16)


# K-quants: llama.cpp's search for each sub-block's scale (and min), vectorized over
# sub-blocks. Sums run element by element in float32, in C's order, so that every rounding
# matches; a NumPy reduction (pairwise) would not.


def _f16_trip(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(_f16).astype(np.float32)


def _seq_sum(terms) -> np.ndarray:
    """Sum of [S, n] float32 terms along n, left to right."""
    total = terms[:, 0].copy()
    for i in range(1, terms.shape[1]):
        total += terms[:, i]
    return total


def _nearest(v) -> np.ndarray:
    return np.rint(v).astype(np.int32)


def _scale_min_search(x, w, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants: per row of x [S, n], (scale, minus the min, levels [S, n])."""
    f32 = np.float32
    mn = np.minimum(x.min(axis=1), f32(0))
    mx = x.max(axis=1)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    span = mx - mn
    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    levels = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    diff = scale[:, None] * levels.astype(f32) + mn[:, None] - x
    best = _seq_sum(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (mx - mn)
        aux = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lq = aux.astype(f32)
        sum_l = _seq_sum(w * lq)
        sum_l2 = _seq_sum(w * lq * lq)
        sum_xl = _seq_sum(w * lq * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = np.where(positive, f32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        diff = this_scale[:, None] * lq + this_min[:, None] - x
        err = _seq_sum(w * (diff * diff))
        better = (det > 0) & (err < best)
        levels[better] = aux[better]
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    flat = span == 0
    levels[flat] = 0
    return np.where(flat, f32(0), scale), -mn, levels


def _quant_k45(x, out, nmax, rmin, nstep):
    """Q4_K (nmax 15) and Q5_K (31): 8 sub-blocks of 32, 6-bit scales and mins."""
    f32 = np.float32
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seq_sum(xs * xs) / f32(32))
    w = av_x[:, None] + np.abs(xs)
    scales, mins, levels = _scale_min_search(xs, w, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
    inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    ls = np.minimum(63, _nearest(inv_scale[:, None] * scales) & 255)
    lm = np.minimum(63, _nearest(inv_min[:, None] * mins) & 255)
    packed = np.zeros((nb, 12), np.int32)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    out["d"], out["dmin"] = max_scale / f32(63), max_min / f32(63)
    out["scales"] = packed
    sc, mn = k_scales_mins(packed)
    d = _f16_trip(out["d"])[:, None] * sc.astype(f32)
    dm = _f16_trip(out["dmin"])[:, None] * mn.astype(f32)
    levels = levels.reshape(nb, 8, 32)
    requant = np.clip(_nearest((x.reshape(nb, 8, 32) + dm[:, :, None]) / d[:, :, None]), 0, nmax)
    q = np.where((d != 0)[:, :, None], requant, levels).reshape(nb, 4, 2, 32)
    if nmax == 15:
        out["qs"] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
        return
    out["qs"] = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(nb, 128)
    bits = (q >> 4).transpose(0, 3, 1, 2).reshape(nb, 32, 8)  # [block, l, sub-block]
    out["qh"] = (bits << np.arange(8)).sum(axis=2)


def _quant_q4_k(x, out):
    _quant_k45(x, out, 15, -1.0, 20)


def _quant_q5_k(x, out):
    _quant_k45(x, out, 31, -0.5, 15)


def _symmetric_search(x, nmax):
    """make_qx_quants with weights x**2: per row of x [S, n], (scale, levels + nmax)."""
    f32 = np.float32
    rows = np.arange(x.shape[0])
    mx = x[rows, np.abs(x).argmax(axis=1)]
    zero = np.abs(mx) < f32(1e-15)
    w = x * x

    def attempt(iscale):
        q = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
        lq = q.astype(f32)
        return q, _seq_sum(w * x * lq), _seq_sum(w * lq * lq)

    q, sumlx, suml2 = attempt(f32(-nmax) / mx)
    levels = q + nmax
    scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        q, sumlx, suml2 = attempt(-(f32(nmax) + f32(0.1) * f32(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels[better] = q[better] + nmax
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    levels[zero] = 0
    return np.where(zero, f32(0), scale), levels


def _quant_q6_k(x, out):
    """Q6_K: 16 sub-blocks of 16 with int8 scales under one fp16 scale."""
    f32 = np.float32
    nb = x.shape[0]
    scales, levels = _symmetric_search(x.reshape(nb * 16, 16), 32)
    scales, levels = scales.reshape(nb, 16), levels.reshape(nb, 16, 16)
    max_scale = scales[np.arange(nb), np.abs(scales).argmax(axis=1)]
    zero = np.abs(max_scale) < f32(1e-15)
    iscale = f32(-128) / max_scale
    out["d"] = f32(1) / iscale
    sc = (np.minimum(127, _nearest(iscale[:, None] * scales)) & 255).astype(np.uint8).view(np.int8)
    out["scales"] = sc
    d = _f16_trip(out["d"])[:, None] * sc.astype(f32)
    requant = np.clip(_nearest(x.reshape(nb, 16, 16) / d[:, :, None]), -32, 31) + 32
    q = np.where((d != 0)[:, :, None], requant, levels).reshape(nb, 2, 4, 32)
    low = q & 15
    out["ql"] = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(nb, 128)
    high = q >> 4
    out["qh"] = (
        high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    ).reshape(nb, 64)
    out[zero] = np.zeros(1, out.dtype)


_QUANT = {
    "Q4_0": _quant_q4_0,
    "Q4_1": _quant_q4_1,
    "Q5_0": _quant_q5_0,
    "Q5_1": _quant_q5_1,
    "Q8_0": _quant_q8_0,
    "Q8_1": _quant_q8_1,
    "Q8_K": _quant_q8_k,
    "Q4_K": _quant_q4_k,
    "Q5_K": _quant_q5_k,
    "Q6_K": _quant_q6_k,
}


def quantize_activation_ref(x: np.ndarray, fmt: str) -> np.ndarray:
    """Quantize an activation row as llama.cpp's x86 SIMD path does before a dot product.

    For Q8_0/Q8_1 that differs from the weight quantizer above: the inverse scale is
    127 / amax and values round half to even. Q8_K uses the reference everywhere.
    """
    if fmt == "Q8_K":
        return quantize_ref(x, fmt)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(x * inv[:, None]).astype(np.int8)
    d = (amax / np.float32(127)).astype(np.float32)
    out = np.zeros(x.shape[0], BLOCK_DTYPES[fmt])
    out["d"], out["qs"] = d, q
    if fmt == "Q8_1":
        out["s"] = d * q.astype(np.int32).sum(axis=1).astype(np.float32)
    return out.view(np.uint8)


def quantize_ref(x: np.ndarray, qtype: str | int) -> np.ndarray:
    """Quantize float values (length a whole number of blocks) to raw block bytes (uint8)."""
    fmt = block_format(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if fmt.name == "F32":
        return x.view(np.uint8).copy()
    if fmt.name == "F16":
        return x.astype(_f16).view(np.uint8)
    if fmt.name not in _QUANT:
        raise GGUFError(f"no reference quantizer for {fmt.name}")
    if x.size % fmt.block_size:
        raise GGUFError(f"{fmt.name}: {x.size} values are not a whole number of blocks")
    blocks = x.reshape(-1, fmt.block_size)
    out = np.zeros(blocks.shape[0], BLOCK_DTYPES[fmt.name])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        _QUANT[fmt.name](blocks, out)
    return out.view(np.uint8)
