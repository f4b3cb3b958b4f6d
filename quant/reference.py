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


_QUANT = {
    "Q4_0": _quant_q4_0,
    "Q4_1": _quant_q4_1,
    "Q5_0": _quant_q5_0,
    "Q5_1": _quant_q5_1,
    "Q8_0": _quant_q8_0,
    "Q8_1": _quant_q8_1,
    "Q8_K": _quant_q8_k,
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
    with np.errstate(invalid="ignore"):
        _QUANT[fmt.name](blocks, out)
    return out.view(np.uint8)
