"""The decoder-only transformer shared by every architecture.

An architecture file supplies a config class: how to read its GGUF metadata and its block
description (backends/block.py: norms, activation, windows, RoPE per layer, soft-caps); the
weights and the forward pass that follows the description live here, once.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from fastrun.backends.base import Backend, RopeConfig
from fastrun.backends.block import SILU, BlockSpec, LayerAttention
from fastrun.formats import keys
from fastrun.formats.errors import FastrunError
from fastrun.formats.gguf import GGUFFile
from fastrun.runner.batch import Batch
from fastrun.runner.kv_cache import KVCache, KVCells

PREFILL_CHUNK = 512  # tokens per forward pass when prefilling a long prompt


@dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters read from GGUF metadata."""

    arch: str
    n_vocab: int
    n_embd: int  # d
    n_layer: int
    n_head: int  # h
    n_head_kv: int  # hk
    head_dim: int  # hd
    n_ff: int  # f
    n_ctx_train: int
    rms_eps: float
    rope: RopeConfig

    neox_rope = False  # the RoPE pair layout; an architecture class overrides it

    def block(self) -> BlockSpec:
        """The block description (backends/block.py); the llama block here, an architecture
        class states what its own adds."""
        return BlockSpec(
            layers=tuple(LayerAttention(rope=self.rope) for _ in range(self.n_layer)),
            attn_scale=1.0 / float(np.sqrt(self.head_dim)),
        )

    def for_context(self, n_ctx: int) -> TransformerConfig:
        """The config of a context of n_ctx tokens per sequence: this one, except where an
        architecture's RoPE depends on the context (phi3's LongRoPE)."""
        return self

    @classmethod
    def arch_fields(cls, f: GGUFFile, common: dict) -> dict:
        """Values of the architecture's own fields (those beyond TransformerConfig's) read from
        its metadata; `common` holds the shared ones already read, which it may replace."""
        return {}

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> TransformerConfig:
        """The config of a file; f.get checks each value's kind and range (formats/schema.py),
        this the relations between them, so that the kernels' index arithmetic holds."""
        where = os.path.basename(f.path)

        def refuse(problem: str):
            raise FastrunError(f"{where}: {problem}")

        n_embd = f.require(keys.EMBEDDING_LENGTH)
        n_head = f.require(keys.HEAD_COUNT)
        n_head_kv = f.get(keys.HEAD_COUNT_KV) or n_head
        if n_head % n_head_kv:
            refuse(f"{n_head} attention heads do not share {n_head_kv} KV heads evenly")
        head_dim = f.get(keys.KEY_LENGTH) or n_embd // n_head
        if head_dim < 1:
            refuse(f"{n_head} attention heads do not fit the width {n_embd}")
        value_dim = f.get(keys.VALUE_LENGTH)
        if value_dim is not None and value_dim != head_dim:
            refuse(f"value length {value_dim} differs from key length {head_dim} (unsupported)")
        n_vocab = f.count(keys.TOKENS) or f.require(keys.VOCAB_SIZE)
        scale = 1.0
        if f.get(keys.ROPE_SCALING_TYPE) == "linear" and f.get(keys.ROPE_SCALING_FACTOR):
            scale = 1.0 / f.get(keys.ROPE_SCALING_FACTOR)
        elif f.get(keys.ROPE_SCALE_LINEAR):
            scale = 1.0 / f.get(keys.ROPE_SCALE_LINEAR)
        n_rot = f.get(keys.ROPE_DIMENSION_COUNT) or head_dim
        if n_rot % 2 or n_rot > head_dim:
            refuse(f"RoPE over {n_rot} dimensions of {head_dim}-wide heads")
        rope = RopeConfig(
            n_dims=n_rot,
            freq_base=f.get(keys.ROPE_FREQ_BASE) or 10000.0,
            freq_scale=scale,
            neox=cls.neox_rope,
            freq_factors=rope_factors(f, keys.ROPE_FREQS, n_rot),  # llama 3's, if any
        )
        common = dict(
            arch=f.architecture,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=f.require(keys.BLOCK_COUNT),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=f.require(keys.FEED_FORWARD_LENGTH),
            n_ctx_train=f.get(keys.CONTEXT_LENGTH) or 2048,
            rms_eps=f.get(keys.RMS_EPS) or 1e-5,
            rope=rope,
        )
        own = cls.arch_fields(f, common)  # first: it may refine a shared value (phi3's RoPE)
        return cls(**common, **own)


def rope_factors(f: GGUFFile, name: str, n_rot: int) -> np.ndarray | None:
    """The file's RoPE frequency divisors `name`, F32 [n_rot / 2], or None where it has none."""
    if name not in f.tensors:
        return None
    info = f.tensor(name)
    if info.format.name != "F32" or info.shape != (n_rot // 2,):
        raise FastrunError(
            f"{os.path.basename(f.path)}: {name} is {info.format.name} {list(info.shape)}, "
            f"expected F32 [{n_rot // 2}]"
        )
    return np.frombuffer(f.tensor_bytes(name).tobytes(), np.float32)


def _caused_by_interrupt(error: BaseException) -> bool:
    seen = error
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _step_vectors(where: tuple, n: int, size: int, cells: KVCells) -> tuple:
    """A step's int32 vectors (ids, positions, starts, ring_starts, ...) padded from n to size
    tokens with ones that write only the cells' scratch rows."""
    vectors = tuple(np.zeros(size, np.int32) for _ in where)
    for padded, vector in zip(vectors, where, strict=True):
        padded[:n] = vector
    vectors[2][n:], vectors[3][n:] = cells.pad_row, cells.ring_pad_row
    return vectors


@contextmanager
def _finished_or_undone(batch: Batch):
    """A pass's body: if it does not finish (an error, Ctrl-C), the caches must not claim its
    tokens."""
    try:
        yield
    except BaseException as e:
        batch.rollback()
        if isinstance(e, SystemError) and _caused_by_interrupt(e):
            # Ctrl-C while a compiled kernel returns surfaces as SystemError
            raise KeyboardInterrupt from None
        raise


class Layer:
    """Weights of one transformer block (backend handles); the optional ones are None where
    the block (BlockSpec) has no use for them."""

    def __init__(self, load, load_split, vector, i: int, c: TransformerConfig, spec: BlockSpec):
        d, q_out, kv = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.attn_norm = vector(keys.ATTN_NORM.format(i=i))  # [d]
        if spec.fused_qkv:  # one [q_out + 2 kv, d] matrix; its row ranges are the three
            qkv = load_split(keys.ATTN_QKV.format(i=i), (q_out, kv, kv), d)
            self.wq, self.wk, self.wv = qkv
        else:
            self.wq = load(keys.ATTN_Q.format(i=i), q_out, d)  # [h*hd, d]
            self.wk = load(keys.ATTN_K.format(i=i), kv, d)  # [hk*hd, d]
            self.wv = load(keys.ATTN_V.format(i=i), kv, d)  # [hk*hd, d]
        self.bq = vector(keys.ATTN_Q_BIAS.format(i=i), optional=True)  # [h*hd] (qwen2)
        self.bk = vector(keys.ATTN_K_BIAS.format(i=i), optional=True)  # [hk*hd]
        self.bv = vector(keys.ATTN_V_BIAS.format(i=i), optional=True)  # [hk*hd]
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = vector(keys.ATTN_Q_NORM.format(i=i))  # [hd]
            self.k_norm = vector(keys.ATTN_K_NORM.format(i=i))  # [hd]
        self.wo = load(keys.ATTN_OUTPUT.format(i=i), d, q_out)  # [d, h*hd]
        self.ffn_norm = vector(keys.FFN_NORM.format(i=i))  # [d]
        if spec.fused_gate_up:  # ffn_up holds gate's rows, then up's: [2 f, d]
            self.w_gate, self.w_up = load_split(keys.FFN_UP.format(i=i), (c.n_ff, c.n_ff), d)
        else:
            self.w_gate = load(keys.FFN_GATE.format(i=i), c.n_ff, d)  # [f, d]
            self.w_up = load(keys.FFN_UP.format(i=i), c.n_ff, d)  # [f, d]
        self.w_down = load(keys.FFN_DOWN.format(i=i), d, c.n_ff)  # [d, f]
        self.attn_post_norm = self.ffn_post_norm = None
        if spec.post_norms:
            self.attn_post_norm = vector(keys.ATTN_POST_NORM.format(i=i))  # [d]
            self.ffn_post_norm = vector(keys.FFN_POST_NORM.format(i=i))  # [d]


class Transformer:
    """Weights plus the forward pass over a batch of tokens of any sequences."""

    config_class = TransformerConfig

    def __init__(self, f: GGUFFile, backend: Backend, progress=None):
        self.file = f  # keeps the memory map (and the weights' views) alive
        self.backend = backend
        self.config = c = self.config_class.from_gguf(f)
        self.block = spec = c.block()  # the model's; described(n_ctx) gives a context's
        spec.check_backend(backend, c.arch)

        def load(name: str, n_out: int, n_in: int):
            return load_split(name, (n_out,), n_in)[0]

        def load_split(name: str, n_outs: tuple[int, ...], n_in: int) -> list:
            """A matrix of sum(n_outs) rows as one weight per consecutive run of n_outs rows."""
            info = f.tensor(name)
            rows, cols = info.matrix_shape
            if (rows, cols) != (sum(n_outs), n_in):
                raise FastrunError(
                    f"{name}: shape {list(info.shape)}, expected [{n_in}, {sum(n_outs)}]"
                )
            if progress:
                progress(info.n_bytes)
            raw, qtype, first = f.tensor_bytes(name), info.format.name, 0
            parts = []
            for n_out in n_outs:
                parts.append(backend.load_weight(raw[first : first + n_out], qtype, n_out, n_in))
                first += n_out
            return parts

        # Every vector's length, by name: the compiled kernels read them without bounds checks.
        q_out, kv_out = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        vector_lengths = {
            keys.ATTN_NORM: c.n_embd, keys.FFN_NORM: c.n_embd, keys.OUTPUT_NORM: c.n_embd,
            keys.ATTN_Q_BIAS: q_out, keys.ATTN_K_BIAS: kv_out, keys.ATTN_V_BIAS: kv_out,
            keys.ATTN_Q_NORM: c.head_dim, keys.ATTN_K_NORM: c.head_dim,
            keys.ATTN_POST_NORM: c.n_embd, keys.FFN_POST_NORM: c.n_embd,
        }  # fmt: skip
        # Vectors that come only together: a Q bias without K and V biases cannot be applied.
        together = {keys.ATTN_Q_BIAS: (keys.ATTN_K_BIAS, keys.ATTN_V_BIAS)}

        def vector(name: str, optional: bool = False):
            match = re.match(r"blk\.(\d+)\.", name)
            pattern = name if match is None else "blk.{i}." + name[match.end() :]
            if optional and (name in f.tensors) != (pattern.format(i=0) in f.tensors):
                raise FastrunError(f"{name}: in some blocks only (biases are all or none)")
            if optional and name not in f.tensors:
                return None
            info = f.tensor(name)
            for sibling in together.get(pattern, ()):
                f.tensor(sibling.format(i=match.group(1)))  # missing: one clear error
            n = vector_lengths[pattern]
            if info.shape != (n,):
                raise FastrunError(f"{name}: shape {list(info.shape)}, expected [{n}]")
            from fastrun.quant import dequantize

            return backend.load_vector(
                dequantize(f.tensor_bytes(name), info.format.name, info.n_elements)
            )

        self.token_embd = load(keys.TOKEN_EMBD, c.n_vocab, c.n_embd)  # [vocab, d]
        self.layers = [Layer(load, load_split, vector, i, c, spec) for i in range(c.n_layer)]
        self.output_norm = vector(keys.OUTPUT_NORM)  # [d]
        tied = keys.OUTPUT not in f.tensors
        self.output = self.token_embd if tied else load(keys.OUTPUT, c.n_vocab, c.n_embd)
        self.head_rows = c.n_vocab  # self.output: the head's first head_rows rows
        self._heads = {c.n_vocab: self.output}  # by rows: those limit_head made
        # the blocks below as one backend call where the backend has one (CPU: compiled)
        self._stack = backend.layer_stack(
            self.layers, c.rms_eps, spec, source=f.path, head=self.output
        )
        self._contexts = {}  # id(config) -> (config, block, stack) of for_context's others

    def described(self, n_ctx: int):
        """(block, stack) of a context of n_ctx tokens per sequence: the model's own, or where
        its config differs for such a context (phi3's long RoPE factors), that config's block,
        and the same stack's weights computing it (built once)."""
        config = self.config.for_context(n_ctx)
        if config is self.config:
            return self.block, self._stack
        if id(config) not in self._contexts:
            spec = config.block()
            stack = None if self._stack is None else self._stack.for_block(spec)
            self._contexts[id(config)] = (config, spec, stack)  # config kept: its id stays
        return self._contexts[id(config)][1:]

    def limit_head(self, rows: int) -> None:
        """Logits of the first `rows` vocabulary ids alone (n_vocab or more: all), set before
        the first pass (a CUDA graph keeps the head it was captured with): a draft model's.
        Its head is a large share of a small model's step (Qwen2.5-0.5B: 145 of about 400 MB
        read a step), and byte-level BPE numbers tokens in the order of their merges, the
        common ones first: the first 65536 of Qwen's 151936 ids hold 97-98 % of the tokens of
        scripts/spec_bench.py's code prompts (the first 32768: 92-93 %, too few: the
        identifiers an edit repeats lie past them). A draft can propose no later id (its draft
        ends there, rejected); logits of every id (top_k 0) come back vocabulary-wide, -inf
        past the rows."""
        c = self.config
        self.head_rows = rows = min(rows, c.n_vocab)
        if rows not in self._heads:
            name = keys.OUTPUT if keys.OUTPUT in self.file.tensors else keys.TOKEN_EMBD
            raw = self.file.tensor_bytes(name)[:rows]
            self._heads[rows] = self.backend.head_prefix(self._heads[c.n_vocab], raw, rows)
        self.output = self._heads[rows]

    def _vocabulary_wide(self, logits: np.ndarray) -> np.ndarray:
        """Host logits [m, head_rows] as [m, n_vocab], -inf where the head has no row."""
        if self.head_rows == self.config.n_vocab:
            return logits
        wide = np.full((len(logits), self.config.n_vocab), -np.inf, np.float32)
        wide[:, : self.head_rows] = logits
        return wide

    def new_cells(self, n_seq: int, n_ctx: int, max_pass: int = PREFILL_CHUNK) -> KVCells:
        """KV storage for n_seq sequences of n_ctx tokens each, whose passes add at most
        max_pass tokens to a sequence (it sizes the sliding-window layers' rings)."""
        c, windows = self.config, [at.window for at in self.block.layers]
        return KVCells(self.backend, windows, n_seq, n_ctx, c.n_head_kv, c.head_dim, max_pass)

    def layer_ropes(self, cells: KVCells) -> list:
        """Each layer's RoPE in these cells, as a context shift re-rotates that layer's keys."""
        return [at.rope for at in self.described(cells.n_ctx)[0].layers]

    def new_cache(self, n_ctx: int, max_pass: int = PREFILL_CHUNK) -> KVCache:
        """The cells of one sequence, alone in its storage."""
        return self.new_cells(1, n_ctx, max_pass).sequences[0]

    def forward(self, ids, cache: KVCache, all_logits: bool = False, top_k: int = 0):
        """Run new tokens of one sequence through the model (in chunks of PREFILL_CHUNK, or of
        the most a pass may add to its cells),
        appending them to its cache.

        Returns float32 logits on the host: [n, vocab] with all_logits, else [1, vocab] for
        the last token; with top_k (and not all_logits), only the last token's k most likely
        tokens, selected on the backend: (ids int32 [1, k], logits float32 [1, k]).
        """
        ids = np.asarray(ids, np.int32).reshape(-1)
        outputs = []
        size = min(PREFILL_CHUNK, cache.cells.max_pass)  # cells may admit smaller passes only
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            last = start + size >= len(ids)
            batch = Batch()
            batch.add(cache, chunk, "all" if all_logits else "last" if last else "none")
            # scoring passes of every row are not steps to capture (capture: a decode step)
            out = self.run(batch, cache.cells, 0 if all_logits else top_k, not all_logits)
            if out is not None:
                outputs.append(out)
        if isinstance(outputs[0], tuple):
            return outputs[0]
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    def run(self, batch: Batch, cells: KVCells, top_k: int = 0, capture: bool = True):
        """One pass over a batch whose tokens' cells are in `cells`: their keys and values are
        stored, and the logits of batch.outputs come back to the host, [m, vocab] float32, or
        with top_k each output's k most likely tokens, (ids int32 [m, k], logits [m, k]);
        None where the batch wants no logits. A decode step goes through the backend's
        run_step (a CUDA graph per step size; capture=False runs it eagerly), padded to its
        step_size with tokens that write only the cells' scratch row. A pass that does not
        finish (an error, Ctrl-C) leaves the caches as they were."""
        with _finished_or_undone(batch):
            n, outputs = batch.n, batch.outputs
            where = (batch.ids, batch.positions, batch.starts, batch.ring_starts, batch.offsets)
            layout = (batch.one_sequence, batch.one_token_each)
            if len(outputs) == 0:  # an inner prefill chunk: only the cells change
                return self._logits(where, cells, outputs, 0, layout)
            if not (capture and batch.is_decode):
                out = self._logits(where, cells, outputs, top_k, layout)
                if top_k:
                    return tuple(map(self.backend.to_host, out))
                return self._vocabulary_wide(self.backend.to_host(out))
            size = self.backend.step_size(n)
            vectors = _step_vectors(where, n, size, cells)

            def step(*vectors):  # on the backend's own int32 vectors (the graph's inputs)
                return self._logits(vectors, cells, None, top_k, layout)

            # one sequence's tokens (a checking pass), one token of each sequence (a decode
            # step) and others share no graph: their attention differs (Backend.attention's
            # one_sequence, rope_attention's one_token_each)
            out = self.backend.run_step(cells, (size, top_k, layout), step, *vectors)
            return tuple(a[:n] for a in out) if top_k else self._vocabulary_wide(out[:n])

    def run_chain(self, batch: Batch, cells: KVCells, steps: int) -> np.ndarray:
        """`steps` greedy decode steps of a batch of one token per sequence, each step's most
        likely tokens fed to the next on the backend (Backend.run_chain: on CUDA one step's
        graph replayed `steps` times with no wait between, so the host's turn is paid once).
        Returns the picked ids, int32 [steps, n]: row i follows step i's tokens. Every
        sequence's cells then hold its token and the first steps - 1 picked ones; the last
        picked one is the next to run. Bit for bit `steps` passes of run(top_k=1)."""
        if not (batch.is_decode and batch.one_token_each):
            raise ValueError("a chain of steps takes one token of each sequence")
        with _finished_or_undone(batch):
            first = [cache.append([-1] * (steps - 1)) for cache in batch.caches]
            n, layout = batch.n, (batch.one_sequence, True)
            where = (batch.ids, batch.positions, batch.starts, batch.ring_starts, batch.offsets)
            # and a vector of 1 for each real token, whose position moves on each step
            moves = np.ones(n, np.int32)  # (padding's stays: it writes the scratch rows)
            size = self.backend.step_size(n)
            vectors = _step_vectors((*where, moves), n, size, cells)

            def step(ids, positions, starts, ring_starts, offsets, moves):
                where = (ids, positions, starts, ring_starts, offsets)
                return self._logits(where, cells, None, 1, layout)[0].reshape(-1)

            key = (size, 1, layout)  # a step's key: the CUDA backend captures it once more
            picked = self.backend.run_chain(cells, key, step, steps, *vectors)[:, :n]
            for cache, start, ids in zip(batch.caches, first, picked.T, strict=True):
                cache.tokens[start : start + steps - 1] = ids[:-1].tolist()
            return picked

    def _logits(self, where, cells: KVCells, outputs, top_k: int, layout=(False, False)):
        """Logits on the backend of the rows `outputs` (host int32; None: every row), or top_k's
        (ids, logits) of them; None for outputs of length 0 (only the cache matters). where:
        the int32 vectors ids, positions, starts (each token's sequence's first full-context
        row), ring_starts (its first ring row) and offsets (its ring offset), on the host or
        the backend; layout: the pass's (Batch.one_sequence, Batch.one_token_each)."""
        # one sequence's tokens: each token's numbers as a one-token step gives them
        # (Backend.one_sequence), so a checking pass picks what plain decoding would
        with self.backend.one_sequence(layout[0]):
            return self._pass_logits(where, cells, outputs, top_k, layout)

    def _pass_logits(self, where, cells: KVCells, outputs, top_k: int, layout):
        """_logits' pass, inside the backend's one_sequence context."""
        b, c = self.backend, self.config
        spec, stack = self.described(cells.n_ctx)
        ids, positions, starts, ring_starts, offsets = where
        slots = starts + positions
        ring_slots = ring_starts + (positions + offsets) % cells.ring if cells.ring else slots
        x = b.embed(self.token_embd, ids)  # [n, d]
        if spec.embed_scale != 1.0:
            x = b.scale(x, spec.embed_scale)
        if stack is not None:  # the backend runs every block in one call
            full = (cells.k, cells.v, slots, starts)
            ring = (cells.ring_k, cells.ring_v, ring_slots, ring_starts, offsets, cells.ring)
            x = stack(x, positions, cells.placement, full, ring)
        else:
            for i, layer in enumerate(self.layers):
                k, v, ring = cells.layer(i)
                to = (ring_slots, ring_starts, ring, offsets) if ring else (slots, starts, 0, None)
                kv = (k, v, *to)
                x = self._attention_block(x, layer, spec, i, kv, positions, layout)
                x = self._ffn_block(x, layer, spec)
        if outputs is not None:
            if len(outputs) == 0:
                return None
            x = b.gather_rows(x, outputs)
        x = b.rms_norm(x, self.output_norm, c.rms_eps)
        logits = b.matmul(x, self.output)
        if spec.final_softcap > 0:
            logits = b.softcap(logits, spec.final_softcap)
        return b.top_k(logits, top_k) if top_k else logits

    def _attention_block(
        self, x, layer: Layer, spec: BlockSpec, i: int, kv, positions, layout: tuple
    ):
        """Block i's attention; kv: its (k_cache, v_cache, slots, starts, ring, offsets), as
        Backend.attention reads a ring (ring > 0) or a full-context storage (ring 0)."""
        b, c, at = self.backend, self.config, spec.layers[i]
        ws = [layer.wq, layer.wk, layer.wv]
        q, k, v = b.norm_matmul_many(x, layer.attn_norm, c.rms_eps, ws)  # [n, h*hd], [n, hk*hd] x 2
        if spec.qk_norm:  # each head's RMSNorm: rows of hd
            n = q.shape[0]
            q = b.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, c.rms_eps).reshape(n, -1)
            k = b.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, c.rms_eps).reshape(n, -1)
        biases = None if layer.bq is None else (layer.bq, layer.bk, layer.bv)
        k_cache, v_cache, slots, starts, ring, offsets = kv
        one_sequence, one_token_each = layout
        reads = (starts, at.window, spec.attn_softcap, ring, offsets, one_sequence)
        if spec.scale_q:  # q scaled after its rotation, then attended to unscaled
            q = b.attention_inputs(q, k, v, biases, k_cache, v_cache, positions, slots, at.rope)
            q = b.scale(q, spec.attn_scale)
            attn = b.attention(q, k_cache, v_cache, positions, 1.0, *reads)
        else:
            attn = b.rope_attention(
                q, k, v, biases, at.rope, slots, k_cache, v_cache, positions, spec.attn_scale,
                *reads, one_token_each,
            )  # fmt: skip
        if layer.attn_post_norm is None:
            return b.matmul_add(attn, layer.wo, x)
        return b.add(x, b.rms_norm(b.matmul(attn, layer.wo), layer.attn_post_norm, c.rms_eps))

    def _ffn_block(self, x, layer: Layer, spec: BlockSpec):
        b, c = self.backend, self.config
        gate, up = b.norm_matmul_many(x, layer.ffn_norm, c.rms_eps, [layer.w_gate, layer.w_up])
        if spec.activation == SILU and layer.ffn_post_norm is None:
            return b.silu_mul_matmul_add(gate, up, layer.w_down, x)  # x + (silu(gate) * up) @ down
        gated = b.silu_mul(gate, up) if spec.activation == SILU else b.gelu_mul(gate, up)
        down = b.matmul(gated, layer.w_down)  # [n, d]
        if layer.ffn_post_norm is not None:
            down = b.rms_norm(down, layer.ffn_post_norm, c.rms_eps)
        return b.add(x, down)
