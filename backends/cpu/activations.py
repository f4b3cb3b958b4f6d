"""Activation quantization before an integer dot product, as llama.cpp pairs formats.

Q8_0 (for Q4_0, Q5_0, Q8_0 weights), Q8_1 (Q4_1, Q5_1: also the block sum) and Q8_K (the
K-quants: 256-value blocks with 16-value partial sums). Scales are rounded through fp16 where
llama.cpp stores them as fp16, and Q8_0/Q8_1 round as its x86 SIMD path does (inverse scale
127/amax, ties to even), so results match quant.reference.quantize_activation_ref.

In parallel from ops.PARALLEL_ROWS rows on (prefill), on one thread below (decode), as the
element-wise kernels of ops.py.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.ops import PARALLEL_ROWS
from fastrun.backends.cpu.simd import f16_round

drop_stale_cache(
    "activations", ("simd.py", "ops.py", "../llamacpp_numerics.py")
)  # code and constants it inlines

_JIT = dict(nogil=True, cache=True, fastmath=False)


# What isum holds after the block sums, per group of 4 activations: the group's sum times
# this. Q5_0 stores its values as q + 16 (0..31); its kernels multiply those unsigned
# values (vpdpbusd takes unsigned times signed bytes) starting from this offset, which
# takes the 16's out, where the signed values needed llama.cpp's sign trick per activation
# row. The integer lane sums are the same either way.
GROUP_OFFSET = -16


@nb.njit(inline="always", **_JIT)
def _q8_0_row(x, xq, xd, xs, isum, t):
    n_blocks = x.shape[1] // 32
    for b in range(n_blocks):
        amax = np.float32(0)
        for j in range(32):
            amax = max(amax, abs(x[t, b * 32 + j]))
        d = amax / np.float32(127)
        inv = np.float32(127) / amax if amax != 0 else np.float32(0)
        total = 0
        for g in range(8):
            group = 0
            for j in range(4 * g, 4 * g + 4):
                q = np.int32(np.rint(x[t, b * 32 + j] * inv))
                xq[t, b * 32 + j] = q
                group += q
            isum[t, n_blocks + 8 * b + g] = GROUP_OFFSET * group
            total += group
        xd[t, b] = f16_round(d)
        xs[t, b] = f16_round(np.float32(total) * d)
        isum[t, b] = total


@nb.njit(parallel=True, **_JIT)
def quantize_q8_0(x, xq, xd, xs, isum):
    """x [n, k] -> xq int8 [n, k], xd [n, k/32] scales, xs [n, k/32] scaled block sums (Q8_1),
    isum int32 [n, k/32 + k/4]: the integer block sums (for weights stored with an offset),
    then each 4-value group's sum times GROUP_OFFSET, 8 a block."""
    n = x.shape[0]
    if n < PARALLEL_ROWS:
        for t in range(n):
            _q8_0_row(x, xq, xd, xs, isum, t)
    else:
        for t in nb.prange(n):
            _q8_0_row(x, xq, xd, xs, isum, t)


@nb.njit(inline="always", **_JIT)
def _q8_k_row(x, xq, xd, bsums, t):
    for b in range(x.shape[1] // 256):
        amax = np.float32(0)
        signed_max = np.float32(0)
        for j in range(256):
            v = x[t, b * 256 + j]
            if abs(v) > amax:
                amax = abs(v)
                signed_max = v
        if amax == 0:
            xd[t, b] = 0
            for j in range(256):
                xq[t, b * 256 + j] = 0
            for g in range(16):
                bsums[t, b * 16 + g] = 0
            continue
        iscale = np.float32(-127) / signed_max
        for g in range(16):
            total = 0
            for j in range(16):
                i = b * 256 + g * 16 + j
                q = min(127, np.int32(np.rint(iscale * x[t, i])))
                xq[t, i] = q
                total += q
            bsums[t, b * 16 + g] = total
        xd[t, b] = np.float32(1) / iscale


@nb.njit(parallel=True, **_JIT)
def quantize_q8_k(x, xq, xd, bsums):
    """x [n, k] -> xq int8 [n, k], xd [n, k/256], bsums int32 [n, k/16]."""
    n = x.shape[0]
    if n < PARALLEL_ROWS:
        for t in range(n):
            _q8_k_row(x, xq, xd, bsums, t)
    else:
        for t in nb.prange(n):
            _q8_k_row(x, xq, xd, bsums, t)


@nb.njit(inline="always", **_JIT)
def quantize_k(x):
    """quantize(x, True): Q8_K."""
    n, k = x.shape
    xq = np.empty((n, k), np.int8)
    xd = np.empty((n, k // 256), np.float32)
    isum = np.empty((n, k // 16), np.int32)
    quantize_q8_k(x, xq, xd, isum)
    return xq, xd, xd, isum  # no scaled sums for Q8_K: same array types, one signature


@nb.njit(inline="always", **_JIT)
def quantize_32(x):
    """quantize(x, False): Q8_0/Q8_1."""
    n, k = x.shape
    xq = np.empty((n, k), np.int8)
    xd = np.empty((n, k // 32), np.float32)
    xs = np.empty((n, k // 32), np.float32)
    isum = np.empty((n, k // 32 + k // 4), np.int32)
    quantize_q8_0(x, xq, xd, xs, isum)
    return xq, xd, xs, isum


@nb.njit(inline="always", **_JIT)
def quantize(x, q8k):
    """Activations as the dot kernels take them: (xq int8 [n, k], xd scales, xs scaled block
    sums, isum integer block and group sums, quantize_q8_0's and quantize_q8_k's); Q8_K
    when q8k, else Q8_0/Q8_1."""
    if q8k:
        return quantize_k(x)
    return quantize_32(x)


def quantize_rows(x: np.ndarray, fmt: str):
    """quantize() by activation format name (Q8_0, Q8_1 or Q8_K)."""
    return quantize(np.ascontiguousarray(x, np.float32), fmt == "Q8_K")
