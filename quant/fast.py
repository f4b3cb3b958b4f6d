"""Numba dequantization of raw GGML blocks, checked against quant.reference.

Every kernel takes the raw bytes as a flat uint8 array and writes float32 values; each has
exactly one compiled signature so the on-disk cache (cache=True) stays small.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from fastrun.formats.errors import GGUFError
from fastrun.quant.formats import block_format

_JIT = dict(nogil=True, cache=True, fastmath=False)

# 2**(e - 25) for each 5-bit half exponent e; e = 0 (subnormal) uses 2**-24.
_HALF_EXP = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], np.float32)


@nb.njit(inline="always", **_JIT)
def f16_to_f32(lo, hi):
    """IEEE half from its two little-endian bytes."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + (1024 if e else 0)) * _HALF_EXP[e]
    return -v if h & 0x8000 else v


@nb.njit(inline="always", **_JIT)
def f16_round(x):
    """x rounded to the nearest IEEE half (ties to even), returned as float32."""
    ax = abs(x)
    if ax == 0 or not np.isfinite(ax):
        return np.float32(x)
    _, e = math.frexp(ax)  # ax = m * 2**e, 0.5 <= m < 1
    step = 2.0 ** (max(e - 11, -24))  # 10 mantissa bits; subnormal step below 2**-14
    r = np.rint(ax / step) * step
    if r > 65504.0:
        r = np.inf
    return np.float32(r if x > 0 else -r)


@nb.njit(inline="always", **_JIT)
def k_scale_min(s, o, j):
    """6-bit scale and min of sub-block j from the 12 scale bytes at s[o:o+12] (Q4_K, Q5_K)."""
    if j < 4:
        return s[o + j] & 63, s[o + j + 4] & 63
    sc = (s[o + j + 4] & 15) | ((s[o + j - 4] >> 6) << 4)
    mn = (s[o + j + 4] >> 4) | ((s[o + j] >> 6) << 4)
    return sc, mn


@nb.njit(parallel=True, **_JIT)
def _deq_q4_0(raw, out):
    for b in nb.prange(out.size // 32):
        o = b * 18
        d = f16_to_f32(raw[o], raw[o + 1])
        for j in range(16):
            q = raw[o + 2 + j]
            out[b * 32 + j] = d * np.float32((q & 15) - 8)
            out[b * 32 + j + 16] = d * np.float32((q >> 4) - 8)


@nb.njit(parallel=True, **_JIT)
def _deq_q4_1(raw, out):
    for b in nb.prange(out.size // 32):
        o = b * 20
        d = f16_to_f32(raw[o], raw[o + 1])
        m = f16_to_f32(raw[o + 2], raw[o + 3])
        for j in range(16):
            q = raw[o + 4 + j]
            out[b * 32 + j] = d * np.float32(q & 15) + m
            out[b * 32 + j + 16] = d * np.float32(q >> 4) + m


@nb.njit(parallel=True, **_JIT)
def _deq_q5(raw, out, block_bytes, has_min):
    for b in nb.prange(out.size // 32):
        o = b * block_bytes
        d = f16_to_f32(raw[o], raw[o + 1])
        m = f16_to_f32(raw[o + 2], raw[o + 3]) if has_min else np.float32(0)
        h = o + (4 if has_min else 2)
        qh = np.uint32(raw[h]) | (np.uint32(raw[h + 1]) << 8)
        qh |= (np.uint32(raw[h + 2]) << 16) | (np.uint32(raw[h + 3]) << 24)
        bias = 0 if has_min else 16
        for j in range(16):
            q = raw[h + 4 + j]
            x0 = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
            x1 = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = d * np.float32(x0 - bias) + m
            out[b * 32 + j + 16] = d * np.float32(x1 - bias) + m


@nb.njit(parallel=True, **_JIT)
def _deq_q8_0(raw, out):
    for b in nb.prange(out.size // 32):
        o = b * 34
        d = f16_to_f32(raw[o], raw[o + 1])
        for j in range(32):
            out[b * 32 + j] = d * np.float32(np.int8(raw[o + 2 + j]))


@nb.njit(parallel=True, **_JIT)
def _deq_k45(raw, out, block_bytes, fifth_bit):
    for b in nb.prange(out.size // 256):
        o = b * block_bytes
        d = f16_to_f32(raw[o], raw[o + 1])
        dmin = f16_to_f32(raw[o + 2], raw[o + 3])
        qh = o + 16
        qs = o + 16 + (32 if fifth_bit else 0)
        for c in range(4):  # 4 chunks of 64 values: low nibbles, then high nibbles
            for half in range(2):
                j = 2 * c + half
                sc, mn = k_scale_min(raw, o + 4, j)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(mn)
                for l in range(32):
                    q = np.int32((raw[qs + 32 * c + l] >> (4 * half)) & 15)
                    if fifth_bit:
                        q |= np.int32((raw[qh + l] >> j) & 1) << 4
                    out[b * 256 + 64 * c + 32 * half + l] = dl * np.float32(q) - ml


@nb.njit(parallel=True, **_JIT)
def _deq_q6_k(raw, out):
    for b in nb.prange(out.size // 256):
        o = b * 210
        d = f16_to_f32(raw[o + 208], raw[o + 209])
        for n in range(2):  # two halves of 128 values
            ql = o + 64 * n
            qh = o + 128 + 32 * n
            sc = o + 192 + 8 * n
            y = b * 256 + 128 * n
            for l in range(32):
                s = l // 16
                h = np.int32(raw[qh + l])
                a = np.int32(raw[ql + l])
                c = np.int32(raw[ql + l + 32])
                q1 = ((a & 15) | ((h & 3) << 4)) - 32
                q2 = ((c & 15) | (((h >> 2) & 3) << 4)) - 32
                q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                q4 = ((c >> 4) | (((h >> 6) & 3) << 4)) - 32
                out[y + l] = d * np.float32(np.int8(raw[sc + s])) * np.float32(q1)
                out[y + l + 32] = d * np.float32(np.int8(raw[sc + s + 2])) * np.float32(q2)
                out[y + l + 64] = d * np.float32(np.int8(raw[sc + s + 4])) * np.float32(q3)
                out[y + l + 96] = d * np.float32(np.int8(raw[sc + s + 6])) * np.float32(q4)


@nb.njit(parallel=True, **_JIT)
def _deq_f16(raw, out):
    for i in nb.prange(out.size):
        out[i] = f16_to_f32(raw[2 * i], raw[2 * i + 1])


def dequantize(data: np.ndarray, qtype: str | int, n: int) -> np.ndarray:
    """Dequantize the first n values of raw block bytes (any uint8 array) to float32 [n]."""
    fmt = block_format(qtype)
    if n % fmt.block_size:
        raise GGUFError(f"{fmt.name}: {n} values are not a whole number of blocks")
    nbytes = n // fmt.block_size * fmt.block_bytes
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    if raw.size < nbytes:
        raise GGUFError(f"{fmt.name}: {raw.size} bytes hold fewer than {n} values")
    raw = raw[:nbytes]
    if not (raw.flags.writeable and raw.flags.c_contiguous):
        raw = raw.copy()  # one compiled signature: writable contiguous bytes
    out = np.empty(n, np.float32)
    name = fmt.name
    if name == "F32":
        out[:] = raw.view("<f4")
    elif name == "BF16":
        out[:] = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif name == "F16":
        _deq_f16(raw, out)
    elif name == "Q4_0":
        _deq_q4_0(raw, out)
    elif name == "Q4_1":
        _deq_q4_1(raw, out)
    elif name in ("Q5_0", "Q5_1"):
        _deq_q5(raw, out, fmt.block_bytes, name == "Q5_1")
    elif name == "Q8_0":
        _deq_q8_0(raw, out)
    elif name in ("Q4_K", "Q5_K"):
        _deq_k45(raw, out, fmt.block_bytes, name == "Q5_K")
    elif name == "Q6_K":
        _deq_q6_k(raw, out)
    else:
        raise GGUFError(f"no dequantizer for {name}")
    return out
