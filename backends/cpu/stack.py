"""All transformer blocks of a model in one compiled call (the CPU's answer to a CUDA graph).

The blocks run the fused steps of fused.py in the order Transformer._attention_block and
_ffn_block call them, so the arithmetic is the same; what goes is the Python between them
(about 1.3 ms of a 15 ms SmolLM2 decode step: argument checks, dispatch, allocation). Every
argument has one type whatever the model, so one compiled signature serves all: the weights
as the memory-mapped file plus byte offsets, the norms and biases stacked per layer, the KV
cache as its [n_layer, rows, hk, hd] arrays.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from fastrun.backends.cpu import ops
from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.fused import norm_qmatmul_many, qmatmul_add, rope_kv, silu_qmatmul_add
from fastrun.backends.cpu.weights import kernel_bytes_in_one_buffer

drop_stale_cache(
    "stack",
    ("fused.py", "matmul.py", "ops.py", "activations.py", "simd.py", "tiles.py"),
)

_JIT = dict(nogil=True, cache=True, fastmath=False, boundscheck=False)

# A layer's matrices, in the order of `where` rows; Q/K/V and gate/up share activations.
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@nb.njit(inline="always", **_JIT)
def _rows(file, where, i):
    """Weight i: its [n_out, row_bytes] bytes in the file; where[i] = offset, n_out, bytes."""
    return file[where[i, 0] : where[i, 0] + where[i, 1] * where[i, 2]].reshape(
        (where[i, 1], where[i, 2])
    )


@nb.njit(**_JIT)
def run_blocks(
    x, file, where, kernels, block_sizes, q8k, norms, bq, bk, bv, k_cache, v_cache, positions,
    slots, starts, eps, rope_config, factors, scale,
):  # fmt: skip
    """x [n, d] through every block, in place; returns x.

    file: the weights' kernel bytes (weights.kernel_bytes_in_one_buffer); where int64
    [L * 7, 3]: each matrix's (offset, units, bytes per unit), MATRICES order per layer;
    kernels int64 [L, 7] (matmul FORMATS index);
    block_sizes int64, q8k bool [L, 4]: the activation format of the QKV, wo, gate/up and
    down products; norms [L, 2, d] (attention, FFN); bq [L, h*hd], bk, bv [L, hk*hd] (or
    [L, 0]: none); k_cache, v_cache [L, rows, hk, hd]."""
    n = x.shape[0]
    for layer in range(norms.shape[0]):
        w = 7 * layer
        qkv = (_rows(file, where, w), _rows(file, where, w + 1), _rows(file, where, w + 2))
        q, k, v = norm_qmatmul_many(
            qkv, x, norms[layer, 0], eps, kernels[layer, :3], block_sizes[layer, 0],
            q8k[layer, 0],
        )  # fmt: skip
        kc, vc = k_cache[layer], v_cache[layer]
        biases = (bq[layer], bk[layer], bv[layer])
        q3 = rope_kv(q, k, v, biases, kc, vc, positions, slots, rope_config, factors)
        attn = np.empty(q3.shape, np.float32)
        ops.attention(q3, kc, vc, positions, starts, scale, attn)
        wo = _rows(file, where, w + 3)
        attn2 = attn.reshape((n, attn.shape[1] * attn.shape[2]))
        qmatmul_add(wo, attn2, x, kernels[layer, 3], block_sizes[layer, 1], q8k[layer, 1])
        gate_up = (_rows(file, where, w + 4), _rows(file, where, w + 5))
        gate, up = norm_qmatmul_many(
            gate_up, x, norms[layer, 1], eps, kernels[layer, 4:6], block_sizes[layer, 2],
            q8k[layer, 2],
        )  # fmt: skip
        down = _rows(file, where, w + 6)
        silu_qmatmul_add(down, gate, up, x, kernels[layer, 6], block_sizes[layer, 3], q8k[layer, 3])
    return x


def _file_of(raw: np.ndarray) -> np.ndarray:
    """The array that raw is a view of, at the root (for weights: the whole memory map)."""
    while isinstance(raw.base, np.ndarray):
        raw = raw.base
    return raw


def supported(layers) -> bool:
    """All matrices in integer-kernel formats and views of one file, Q/K/V and gate/up each
    sharing one activation format."""
    files = set()
    for layer in layers:
        ws = [getattr(layer, name) for name in MATRICES]
        if any(not w.fusable or not w.raw.flags.c_contiguous for w in ws):
            return False
        files.update(id(_file_of(w.raw)) for w in ws)
        for group in (ws[:3], ws[4:6]):
            if len({(w.format.activation, w.format.block_size) for w in group}) > 1:
                return False
    return len(files) == 1 and _file_of(layers[0].wq.raw).ndim == 1


class CompiledBlocks:
    """stack(x, k_cache, v_cache, positions, slots, starts) -> x for one model's layers
    (which `supported` accepts)."""

    def __init__(self, layers, eps: float, rope, scale: float):
        ws = [getattr(layer, name) for layer in layers for name in MATRICES]
        self.file, self.where = kernel_bytes_in_one_buffer(ws)  # repacked, as one array
        self.kernels = np.array([w.kernel for w in ws], np.int64).reshape(len(layers), 7)
        products = [(layer.wq, layer.wo, layer.w_gate, layer.w_down) for layer in layers]
        self.block_sizes = np.array([[w.format.block_size for w in p] for p in products], np.int64)
        self.q8k = np.array([[w.format.activation == "Q8_K" for w in p] for p in products])
        self.norms = np.stack([np.stack([layer.attn_norm, layer.ffn_norm]) for layer in layers])
        self.biases = [
            np.stack([getattr(layer, b) for layer in layers])
            if layers[0].bq is not None
            else np.zeros((len(layers), 0), np.float32)
            for b in ("bq", "bk", "bv")
        ]
        self.eps = float(eps)
        self.rope_config = (rope.n_dims, float(rope.freq_base), float(rope.freq_scale), rope.neox)
        factors = np.zeros(0) if rope.freq_factors is None else rope.freq_factors
        self.factors = np.ascontiguousarray(factors, np.float32)
        self.scale = np.float32(scale)

    def __call__(self, x, k_cache, v_cache, positions, slots, starts):
        return run_blocks(
            np.ascontiguousarray(x, np.float32), self.file, self.where, self.kernels,
            self.block_sizes, self.q8k, self.norms, *self.biases, k_cache, v_cache,
            np.ascontiguousarray(positions, np.int32), np.ascontiguousarray(slots, np.int32),
            np.ascontiguousarray(starts, np.int32), self.eps, self.rope_config, self.factors,
            self.scale,
        )  # fmt: skip
