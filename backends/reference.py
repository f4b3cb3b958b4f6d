"""The NumPy reference backend: plain, slow and obviously right; the spec for the others.

It follows llama.cpp's CPU numerics where they change results: activations are quantized to
the weight type's partner format before a matmul, the KV cache holds fp16 values, and
queries are rounded to fp16 before the dot products with keys.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from fastrun.backends import block
from fastrun.backends import llamacpp_numerics as ggml
from fastrun.backends.base import Backend, RopeConfig, Weight
from fastrun.quant.formats import block_format
from fastrun.quant.reference import BLOCK_DTYPES, dequantize_ref, quantize_activation_ref


def fp16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def fma32(a, b, c) -> np.ndarray:
    """a * b + c of float32 values, rounded once to float32: in float64 the product is
    exact, and the sum rounded to odd (to the neighbour with an odd last bit where it is
    inexact: TwoSum gives its error) then rounds to float32 as a single rounding would."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    product = a * b
    total = product + c
    c_part = total - product
    error = (product - (total - c_part)) + (c - c_part)
    even = (total.view(np.int64) & 1) == 0
    with np.errstate(invalid="ignore"):
        toward = np.where(error > 0, np.inf, -np.inf)
    odd = np.where((error != 0) & even & np.isfinite(total), np.nextafter(total, toward), total)
    return odd.astype(np.float32)


def ggml_expf(x) -> np.ndarray:
    """exp(x) in float32 as llama.cpp's softmax and SiLU compute it (ggml_v_expf, AVX-512
    form, bit for bit): 2^n (1 + b p(b)) with n = round(x log2 e), b = x - n ln 2 in two
    parts, p of degree 5; 0 or infinity past the limit (backends/llamacpp_numerics.py)."""
    x = np.asarray(x, np.float32)
    c5, c4, c3, c2, c1 = ggml.EXPF_POLY
    with np.errstate(invalid="ignore", over="ignore"):
        n = fma32(x, ggml.EXPF_LOG2E, ggml.EXPF_ROUNDER) - ggml.EXPF_ROUNDER
        b = fma32(-n, ggml.EXPF_LN2_LO, fma32(-n, ggml.EXPF_LN2_HI, x))
        u = b * b
        j = fma32(fma32(fma32(c5, b, c4), u, fma32(c3, b, c2)), u, fma32(c1, b, np.float32(1)))
        limit = ggml.EXPF_LIMIT
        k = np.clip(np.nan_to_num(n, nan=limit), -limit, limit).astype(np.int64)
        scaled = (j.astype(np.float64) * np.ldexp(1.0, k)).astype(np.float32)
        beyond = np.abs(n) > limit
        return np.where(beyond, np.where(n <= 0, np.float32(0), np.float32(np.inf)), scaled)


def lane_sum(v: np.ndarray) -> np.float32:
    """The sum of 16 float32 values as _mm512_reduce_add_ps adds them: halves lane by lane
    (16 -> 8 -> 4), then lanes 0 + 2 and 1 + 3, then those two."""
    v = np.asarray(v, np.float32)
    v = v[8:] + v[:8]
    v = v[4:] + v[:4]
    return (v[0] + v[2]) + (v[1] + v[3])


def quantize_activation(x: np.ndarray, qtype: str) -> np.ndarray:
    """x [n, k] as the weight type's dot product sees it: through its activation format."""
    act = block_format(qtype).activation
    if act == "F32":
        return np.asarray(x, np.float32)
    if act == "F16":
        return fp16_round(x)
    if act == "BF16":
        bits = np.asarray(x, np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.view(np.float32)
    n, k = x.shape
    q = quantize_activation_ref(x, act)
    return dequantize_ref(q, act, n * k).reshape(n, k)


def rope_angles(positions: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """theta [n, n_dims/2] as llama.cpp computes it: pos times base^(-2/n_dims), i times for
    pair i, each product rounded to float32 (its cache's recurrence), divided by the pair's
    frequency factor and times freq_scale."""
    half = rope.n_dims // 2
    theta_scale = np.float32(rope.freq_base) ** np.float32(-2.0 / rope.n_dims)
    theta = np.empty((len(positions), half), np.float32)
    theta[:, 0] = np.asarray(positions, np.float32)
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * theta_scale
    if rope.freq_factors is not None:
        theta = theta / rope.freq_factors.astype(np.float32)[None, :]
    return (np.float32(rope.freq_scale) * theta).astype(np.float32)


def _libm_f32(name: str):
    """The C library's float32 function `name` over an array, as ggml calls it (cosf, sinf:
    not always correctly rounded, so their own values); float64 rounded once without one."""
    path = ctypes.util.find_library("m")
    fn = getattr(ctypes.CDLL(path), name, None) if path else None
    if fn is None:
        return lambda x: getattr(np, name[:-1])(np.asarray(x, np.float64)).astype(np.float32)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    each = np.frompyfunc(fn, 1, 1)
    return lambda x: each(np.asarray(x, np.float32)).astype(np.float32)


libm_cosf, libm_sinf = _libm_f32("cosf"), _libm_f32("sinf")


class RefWeight(Weight):
    def __init__(self, raw: np.ndarray, qtype: str, n_out: int, n_in: int):
        self.qtype, self.n_out, self.n_in = qtype, n_out, n_in
        self.raw = raw
        self.dense = dequantize_ref(raw, qtype, n_out * n_in).reshape(n_out, n_in)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh form in float32, as ggml_gelu_f32 compiled for an FMA machine: 1 + a*x*x
    contracted to one fused multiply-add (emulated exactly in float64), tanhf correctly
    rounded. On fp16 inputs this reproduces llama.cpp's GELU table bit for bit."""
    x = np.asarray(x, np.float32)
    ax = np.float32(0.044715) * x
    poly = (ax.astype(np.float64) * x + 1).astype(np.float32)  # fma(a*x, x, 1)
    inner = np.float32(0.7978845608028654) * x * poly
    tanh = np.tanh(inner.astype(np.float64)).astype(np.float32)
    return np.float32(0.5) * x * (np.float32(1) + tanh)


def _lane_dots(k: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Each row of k [rows, hd] times q [hd] (fp16 values) as llama.cpp's tinyBLAS does on
    AVX-512 where hd is a multiple of 16: lane t the fused multiply-adds of elements t, t +
    16, ..., then lane_sum; in float64 for other head sizes (ggml's own fp16 dot)."""
    rows, hd = k.shape
    if hd % ggml.LANES:
        return (k.astype(np.float64) @ q.astype(np.float64)).astype(np.float32)
    lanes = np.zeros((rows, ggml.LANES), np.float32)
    for at in range(0, hd, ggml.LANES):
        part = slice(at, at + ggml.LANES)
        lanes = fma32(q[None, part], k[:, part], lanes)
    return np.array([lane_sum(r) for r in lanes], np.float32)


class ReferenceBackend(Backend):
    name = "reference"
    features = frozenset(block.FEATURES)

    def load_weight(self, raw, qtype, n_out, n_in):
        return RefWeight(np.asarray(raw), qtype, n_out, n_in)

    def load_vector(self, x):
        return np.asarray(x, np.float32).copy()

    def zeros(self, shape):
        return np.zeros(shape, np.float32)

    def to_host(self, x):
        return np.asarray(x)

    def matmul(self, x, w):
        x = np.asarray(x, np.float32)
        if block_format(w.qtype).activation == "Q8_1":
            return self._matmul_q8_1(x, w)
        xa = quantize_activation(x, w.qtype)
        return (xa.astype(np.float64) @ w.dense.T.astype(np.float64)).astype(np.float32)

    def _matmul_q8_1(self, x, w):
        """Q4_1/Q5_1: the min term multiplies the activation's stored block sum s, an fp16
        rounding of d * sum(q), not the sum of the dequantized values."""
        n, k = x.shape
        mins = w.raw.reshape(-1).view(BLOCK_DTYPES[w.qtype])["m"].astype(np.float32)
        mins = mins.reshape(w.n_out, k // 32)
        scaled = (w.dense - np.repeat(mins, 32, axis=1)).astype(np.float64)
        xq = quantize_activation_ref(x, "Q8_1")
        s = xq.view(BLOCK_DTYPES["Q8_1"])["s"].astype(np.float64).reshape(n, k // 32)
        xa = dequantize_ref(xq, "Q8_1", n * k).reshape(n, k).astype(np.float64)
        return (xa @ scaled.T + s @ mins.T.astype(np.float64)).astype(np.float32)

    def embed(self, w, ids):
        return w.dense[np.asarray(ids)].copy()

    def rms_norm(self, x, weight, eps):
        x = np.asarray(x, np.float32)
        # as ggml: float32 squares summed in float64, then the mean and scale in float32
        squares = (x * x).astype(np.float64)
        mean = (squares.sum(axis=1, keepdims=True) / x.shape[1]).astype(np.float32)
        scale = np.float32(1) / np.sqrt(mean + np.float32(eps))
        return (x * scale) * weight

    def rope(self, x, positions, rope):
        theta = rope_angles(np.asarray(positions), rope)  # [n, half]
        cos, sin = libm_cosf(theta)[:, None, :], libm_sinf(theta)[:, None, :]
        half = rope.n_dims // 2
        if rope.neox:
            first, second = slice(0, half), slice(half, rope.n_dims)
        else:
            first, second = slice(0, rope.n_dims, 2), slice(1, rope.n_dims, 2)
        a, b = x[:, :, first].copy(), x[:, :, second].copy()
        # each one fused multiply-add, a's product fused, as GCC compiles ggml's rotation
        x[:, :, first] = fma32(a, cos, -(b * sin))
        x[:, :, second] = fma32(a, sin, b * cos)
        return x

    def silu_mul(self, gate, up):
        with np.errstate(
            over="ignore"
        ):  # exp(-gate) overflows to inf for very negative gate: silu -> 0
            gate = np.asarray(gate, np.float32)
            return gate / (np.float32(1) + ggml_expf(-gate)) * up  # ggml_v_silu

    def gelu_mul(self, gate, up):
        gate = np.asarray(gate, np.float32)
        looked_up = fp16_round(gelu_tanh(fp16_round(gate)))  # llama.cpp's fp16 table
        gelu = np.where(gate <= -10, np.float32(0), np.where(gate >= 10, gate, looked_up))
        return (gelu * up).astype(np.float32)

    def scale(self, x, factor):
        x *= np.float32(factor)
        return x

    def softcap(self, x, cap):
        x[...] = np.float32(cap) * np.tanh(x / np.float32(cap))
        return x

    def add(self, x, y):
        x += y
        return x

    def add_bias(self, x, bias):
        x += bias[None, :]
        return x

    def kv_write(self, k_cache, v_cache, k, v, slots):
        k_cache[slots] = fp16_round(k)
        v_cache[slots] = fp16_round(v)

    def attention(
        self, q, k_cache, v_cache, positions, scale, starts=None, window=0, softcap=0.0,
        ring=0, offsets=None, one_sequence=False,
    ):  # fmt: skip
        n, h, hd = q.shape
        group = h // k_cache.shape[1]
        qh = fp16_round(q)
        out = np.zeros((n, h, hd), np.float32)
        for i in range(n):
            first = 0 if starts is None else int(starts[i])
            seen = int(positions[i]) + 1 if window <= 0 else min(window, int(positions[i]) + 1)
            seen_positions = np.arange(int(positions[i]) + 1 - seen, int(positions[i]) + 1)
            if ring > 0:  # a sliding-window layer's ring of slots
                rows = first + (seen_positions + int(offsets[i])) % ring
            else:
                rows = first + seen_positions
            for j in range(h):
                k, v = k_cache[rows, j // group], v_cache[rows, j // group]
                s = _lane_dots(k, qh[i, j]) * np.float32(scale)
                if softcap > 0:
                    s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
                # as llama.cpp's softmax: exps summed 16 positions at a time (from position
                # 0), those in float64; probabilities normalized in float32, then fp16
                e = ggml_expf(s - s.max())
                width = ggml.LANES
                chunks = np.zeros(-(-(seen_positions[-1] + 1) // width) * width, np.float32)
                chunks[seen_positions] = e
                total = sum(np.float64(lane_sum(c)) for c in chunks.reshape(-1, width))
                p = fp16_round(e * np.float32(1.0 / total))
                # p times V as tinyBLAS: lane t the fused multiply-adds of positions = t mod 16
                lanes = np.zeros((width, hd), np.float32)
                for position, weight, row in zip(seen_positions, p, v, strict=True):
                    lanes[position % width] = fma32(row, weight, lanes[position % width])
                out[i, j] = [lane_sum(lanes[:, c]) for c in range(hd)]
        return out.reshape(n, h * hd)
