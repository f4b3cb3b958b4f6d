"""Fused steps of a transformer layer, composed from the CPU kernels in one compiled call
each: the same arithmetic as calling them one by one, without a Python round trip between
them (a decode step makes a few hundred such calls)."""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.matmul import qmatmul, qmatmul_many
from fastrun.backends.cpu.ops import kv_store, rms_norm, rope, silu_mul

drop_stale_cache(
    "fused",
    ("matmul.py", "ops.py", "activations.py", "simd.py", "tiles.py", "../llamacpp_numerics.py"),
)

_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)


@nb.njit(inline="always", **_JIT)
def norm_qmatmul_many(formats, ws, x, weight, eps, fmts, block_size, q8k):
    """qmatmul_many(formats, ws, rms_norm(x, weight, eps))."""
    normed = np.empty_like(x)
    rms_norm(x, weight, eps, normed)
    return qmatmul_many(formats, ws, normed, fmts, block_size, q8k)


@nb.njit(**_JIT)
def qmatmul_add(formats, w, x, residual, fmt, block_size, q8k):
    """residual += x @ w.T; returns residual."""
    residual += qmatmul(formats, w, x, fmt, block_size, q8k)
    return residual


@nb.njit(**_JIT)
def silu_qmatmul_add(formats, w, gate, up, residual, fmt, block_size, q8k):
    """residual += (silu(gate) * up) @ w.T; returns residual."""
    gated = np.empty_like(gate)
    silu_mul(gate, up, gated)
    residual += qmatmul(formats, w, gated, fmt, block_size, q8k)
    return residual


@nb.njit(**_JIT)
def rope_kv(q, k, v, biases, k_cache, v_cache, positions, slots, rope_config, factors):
    """Biases (bq, bk, bv; empty: none) added, q and k rotated, k and v stored at the cache
    slots; q, k, v [n, heads * hd]. Returns q as [n, h, hd].
    rope_config: (n_dims, freq_base, freq_scale, neox) as ops.rope takes them."""
    n, hd = q.shape[0], k_cache.shape[2]
    bq, bk, bv = biases
    if bq.size:
        q += bq
        k += bk
        v += bv
    n_dims, freq_base, freq_scale, neox = rope_config
    q3 = q.reshape((n, q.shape[1] // hd, hd))
    k3 = k.reshape((n, k.shape[1] // hd, hd))
    rope(q3, positions, n_dims, freq_base, freq_scale, neox, factors)
    rope(k3, positions, n_dims, freq_base, freq_scale, neox, factors)
    kv_store(k_cache, v_cache, k3, v.reshape((n, v.shape[1] // hd, hd)), slots)
    return q3
