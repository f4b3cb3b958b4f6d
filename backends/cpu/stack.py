"""All transformer blocks of a model in one compiled call (the CPU's answer to a CUDA graph).

The blocks run the steps of fused.py and ops.py in the order Transformer._attention_block
and _ffn_block call them, with the options the model's block description (backends/block.py)
sets: Q/K head norms, post-norms, GELU or SiLU gating, per-layer RoPE base and attention
window, score soft-cap. So the arithmetic is the same; what goes is the Python between them
(about 1.3 ms of a 15 ms SmolLM2 decode step: argument checks, dispatch, allocation). Every
argument has one type whatever the model, so one compiled signature serves all: the weights
as the memory-mapped file plus byte offsets, the norms and biases stacked per layer, the KV
cache as its [n_layer, rows, hk, hd] arrays.
"""

from __future__ import annotations

import copy

import numba as nb
import numpy as np

from fastrun.backends.block import GELU_TANH
from fastrun.backends.cpu import ops, side_compile
from fastrun.backends.cpu.cache import drop_stale_cache
from fastrun.backends.cpu.fused import norm_qmatmul_many, rope_kv
from fastrun.backends.cpu.matmul import FORMATS, format_set, qmatmul
from fastrun.backends.cpu.tiles import head_kernel_name
from fastrun.backends.cpu.weights import kernel_bytes_in_one_buffer, root_array

drop_stale_cache(
    "stack",
    (
        "fused.py",
        "matmul.py",
        "ops.py",
        "activations.py",
        "simd.py",
        "tiles.py",
        "../llamacpp_numerics.py",
    ),
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
def _add_branch(x, branch, post_norm, eps):
    """x += branch, or x += rms_norm(branch) * post_norm where the block has post-norms."""
    if post_norm.size:
        ops.rms_norm(branch, post_norm, eps, branch)  # element-wise: in place is safe
    x += branch


@nb.njit(**_JIT)
def run_blocks(
    formats, x, file, where, kernels, block_sizes, q8k, norms, bq, bk, bv, head_norms, post_norms,
    positions, placement, k_cache, v_cache, slots, starts, ring_k, ring_v, ring_slots,
    ring_starts, offsets, ring, eps, rope_dims, rope_neox, rope_bases, rope_scales, factors,
    windows, q_scale, scale, softcap, gelu, threads,
):  # fmt: skip
    """x [n, d] through every block, in place; returns x.

    formats: the FormatSet of the matrices' types (matmul.format_set);
    file: the weights' kernel bytes (weights.kernel_bytes_in_one_buffer); where int64
    [L * 7, 3]: each matrix's (offset, units, bytes per unit), MATRICES order per layer;
    kernels int64 [L, 7] (matmul FORMATS index);
    block_sizes int64, q8k bool [L, 4]: the activation format of the QKV, wo, gate/up and
    down products; norms [L, 2, d] (attention, FFN); bq [L, h*hd], bk, bv [L, hk*hd] (or
    [L, 0]: none); head_norms [L, 2, hd] (Q, K; or [L, 0, 0]: none); post_norms [L, 2, d]
    (attention and FFN outputs; or [L, 0, 0]); placement int64 [L, 2]: each layer's (in the
    ring, index in its storage); k_cache, v_cache [full layers, rows, hk, hd] with their
    slots and starts; ring_k, ring_v [ring layers, rows, hk, hd] with theirs, the
    sequences' ring offsets and R (runner/kv_cache.py: 0, no ring layers); per layer
    the RoPE base and scale and the attention window (0: none), float64/int64 [L]; q_scale
    multiplies q before attention (1: no product), scale the scores; softcap:
    of the attention scores (0: none); gelu: True for GELU gating, None for SiLU
    (backends/block.py; None or not is part of the compiled signature); threads: the
    parallel loops' count (numba.get_num_threads() in here would keep it out of the cache)."""
    n = x.shape[0]
    hd = k_cache.shape[3]
    no_offsets = np.zeros_like(positions)
    for layer in range(norms.shape[0]):
        w = 7 * layer
        qkv = (_rows(file, where, w), _rows(file, where, w + 1), _rows(file, where, w + 2))
        q, k, v = norm_qmatmul_many(
            formats, qkv, x, norms[layer, 0], eps, kernels[layer, :3], block_sizes[layer, 0],
            q8k[layer, 0],
        )  # fmt: skip
        if head_norms.shape[1]:  # each head's RMSNorm, in place (row by row: safe)
            q_heads = q.reshape((q.size // hd, hd))
            k_heads = k.reshape((k.size // hd, hd))
            ops.rms_norm(q_heads, head_norms[layer, 0], eps, q_heads)
            ops.rms_norm(k_heads, head_norms[layer, 1], eps, k_heads)
        at = placement[layer, 1]
        if placement[layer, 0]:  # a ring layer: its storage and its ring's rows
            kc, vc, to, first = ring_k[at], ring_v[at], ring_slots, ring_starts
            rows, shifted = ring, offsets
        else:
            kc, vc, to, first = k_cache[at], v_cache[at], slots, starts
            rows, shifted = np.int64(0), no_offsets
        biases = (bq[layer], bk[layer], bv[layer])
        rope_config = (rope_dims, rope_bases[layer], rope_scales[layer], rope_neox)
        q3 = rope_kv(q, k, v, biases, kc, vc, positions, to, rope_config, factors)
        if q_scale != 1:
            q3 *= q_scale
        attn = np.empty(q3.shape, np.float32)
        window = windows[layer]
        ops.attention(
            q3, kc, vc, positions, first, scale, window, softcap, rows, shifted, threads, attn
        )
        wo = _rows(file, where, w + 3)
        attn2 = attn.reshape((n, attn.shape[1] * attn.shape[2]))
        out = qmatmul(formats, wo, attn2, kernels[layer, 3], block_sizes[layer, 1], q8k[layer, 1])
        _add_branch(x, out, post_norms[layer, 0] if post_norms.shape[1] else post_norms[0, 0], eps)
        gate_up = (_rows(file, where, w + 4), _rows(file, where, w + 5))
        gate, up = norm_qmatmul_many(
            formats, gate_up, x, norms[layer, 1], eps, kernels[layer, 4:6], block_sizes[layer, 2],
            q8k[layer, 2],
        )  # fmt: skip
        gated = np.empty_like(gate)
        if gelu is not None:  # known when compiling: only the gating used is compiled
            ops.gelu_mul(gate, up, gated)
        else:
            ops.silu_mul(gate, up, gated)
        down = _rows(file, where, w + 6)
        out = qmatmul(formats, down, gated, kernels[layer, 6], block_sizes[layer, 3], q8k[layer, 3])
        _add_branch(x, out, post_norms[layer, 1] if post_norms.shape[1] else post_norms[0, 0], eps)
    return x


def supported(layers, block) -> bool:
    """All matrices in integer-kernel formats and views of one file, Q/K/V and gate/up each
    sharing one activation format; every layer's RoPE of one layout and frequency factors
    (their bases and scales may differ)."""
    if not _ropes_supported(block):
        return False
    files = set()
    for layer in layers:
        ws = [getattr(layer, name) for name in MATRICES]
        if any(not w.fusable or not w.raw.flags.c_contiguous for w in ws):
            return False
        files.update(id(root_array(w.raw)) for w in ws)
        for group in (ws[:3], ws[4:6]):
            if len({(w.format.activation, w.format.block_size) for w in group}) > 1:
                return False
    return len(files) == 1 and root_array(layers[0].wq.raw).ndim == 1


def _ropes_supported(block) -> bool:
    """Every layer's RoPE of one layout and frequency factors (run_blocks takes one set)."""
    first = block.layers[0].rope

    def same_layout(r) -> bool:
        if (r.n_dims, r.neox) != (first.n_dims, first.neox):
            return False
        if r.freq_factors is None or first.freq_factors is None:
            return r.freq_factors is first.freq_factors
        return np.array_equal(r.freq_factors, first.freq_factors)

    return all(same_layout(spec.rope) for spec in block.layers)


def _stacked(layers, names: tuple[str, ...]) -> np.ndarray:
    """Per-layer vectors stacked [L, len(names), m]; [L, 0, 0] where the layers have none."""
    if getattr(layers[0], names[0]) is None:
        return np.zeros((len(layers), 0, 0), np.float32)
    return np.stack([np.stack([getattr(layer, a) for a in names]) for layer in layers])


class CompiledBlocks:
    """stack(x, positions, placement, full, ring) -> x (Backend.layer_stack) for one model's
    layers (which `supported` accepts), computing as their BlockSpec describes."""

    def __init__(self, layers, eps: float, block, source: str | None = None, head=None):
        ws = [getattr(layer, name) for layer in layers for name in MATRICES]
        with_head = ws + ([head] if head is not None and head.qtype in FORMATS else [])
        # the head's products too compile for the layers' formats and its own (its tiles
        # multiplied as head_kernel_name's): one compile of the product kernel serves both
        has_head = len(with_head) > len(ws)
        kinds = {w.qtype for w in ws} | ({head_kernel_name(head.qtype)} if has_head else set())
        names = tuple(sorted(kinds))
        self.formats = format_set(names)
        if has_head:
            head.formats = self.formats
            head.kernel = FORMATS.index(head_kernel_name(head.qtype))
        # a first run: half of the stack's kernels (and the head's product) compile on a
        # second core from here on
        self._side_compile = side_compile.start(block.activation, names if has_head else ())
        # repacked (or from the tile cache, source the model file), as one array; the head's
        # tiles after the layers' (the stack does not read them: one cache file for both)
        self.file, self.where = kernel_bytes_in_one_buffer(with_head, source)
        self.kernels = np.array([w.kernel for w in ws], np.int64).reshape(len(layers), 7)
        products = [(layer.wq, layer.wo, layer.w_gate, layer.w_down) for layer in layers]
        self.block_sizes = np.array([[w.format.block_size for w in p] for p in products], np.int64)
        self.q8k = np.array([[w.format.activation == "Q8_K" for w in p] for p in products])
        self.norms = _stacked(layers, ("attn_norm", "ffn_norm"))
        self.biases = [
            np.stack([getattr(layer, b) for layer in layers])
            if layers[0].bq is not None
            else np.zeros((len(layers), 0), np.float32)
            for b in ("bq", "bk", "bv")
        ]
        self.head_norms = _stacked(layers, ("q_norm", "k_norm"))
        self.post_norms = _stacked(layers, ("attn_post_norm", "ffn_post_norm"))
        self.eps = float(eps)
        self._follow(block)

    def for_block(self, block):
        """These weights computing as another description of the same layers (Backend.
        layer_stack); None where this stack cannot."""
        if not _ropes_supported(block):
            return None
        other = copy.copy(self)
        other._follow(block)
        return other

    def _follow(self, block) -> None:
        """The description's values, as run_blocks takes them."""
        ropes = [spec.rope for spec in block.layers]
        self.rope_dims, self.rope_neox = ropes[0].n_dims, ropes[0].neox
        self.rope_bases = np.array([r.freq_base for r in ropes], np.float64)
        self.rope_scales = np.array([r.freq_scale for r in ropes], np.float64)
        factors = np.zeros(0) if ropes[0].freq_factors is None else ropes[0].freq_factors
        self.factors = np.ascontiguousarray(factors, np.float32)
        self.windows = np.array([spec.window for spec in block.layers], np.int64)
        self.q_scale = np.float32(block.attn_scale if block.scale_q else 1.0)
        self.scale = np.float32(1.0 if block.scale_q else block.attn_scale)
        self.softcap = np.float32(block.attn_softcap)
        self.gelu = True if block.activation == GELU_TANH else None

    def __call__(self, x, positions, placement, full, ring):
        def ints(a):
            return np.ascontiguousarray(a, np.int32)

        k_cache, v_cache, slots, starts = full
        ring_k, ring_v, ring_slots, ring_starts, offsets, rows = ring
        return run_blocks(
            self.formats, np.ascontiguousarray(x, np.float32), self.file, self.where, self.kernels,
            self.block_sizes, self.q8k, self.norms, *self.biases, self.head_norms,
            self.post_norms, ints(positions), placement, k_cache, v_cache, ints(slots),
            ints(starts), ring_k, ring_v, ints(ring_slots), ints(ring_starts), ints(offsets),
            np.int64(rows), self.eps, self.rope_dims, self.rope_neox, self.rope_bases,
            self.rope_scales, self.factors, self.windows, self.q_scale, self.scale, self.softcap,
            self.gelu, np.int64(nb.get_num_threads()),
        )  # fmt: skip
