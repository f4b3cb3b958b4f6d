"""The Backend contract: the only operations model code may call.

Arrays are the backend's own (NumPy on the CPU, CuPy on the GPU). Shapes use these names:
n = tokens in the batch, d = model width, h / hk = query / key-value heads, hd = head size,
c = cache slots. Every operation has a case in tests/test_parity.py, which checks each
backend against the NumPy reference backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings of a model."""

    n_dims: int  # rotated dimensions of each head (<= hd)
    freq_base: float = 10000.0
    freq_scale: float = 1.0  # linear scaling: positions are multiplied by this
    neox: bool = False  # False: rotate pairs (2i, 2i+1) (llama); True: halves (i, i + n_dims/2)
    freq_factors: np.ndarray | None = None  # [n_dims/2] divisors of each frequency (llama 3, phi3)


class Weight:
    """A weight matrix [n_out, n_in] as a backend holds it (type-specific layout)."""

    qtype: str
    n_out: int
    n_in: int


class Backend(ABC):
    """Operations on backend arrays. `x` arrays are float32 unless stated."""

    name: str = "abstract"
    # the block features (backends/block.py) beyond the llama block that this backend runs;
    # a model that needs another is refused at load
    features: frozenset[str] = frozenset()
    # greedy decode steps one pass may chain, each step's pick run by the next without the
    # host (run_chain): more than 1 where the host's turn between steps costs something
    # beside a step (a CUDA graph's wait and the Python around it)
    chain_steps: int = 1
    # whether a decode step's first run at a new size captures it (run_step: a CUDA graph),
    # a one-time cost of tens of ms that speculation's plans price (PassCosts.one_time)
    captures_steps: bool = False
    # whether a token's numbers are the same in a pass of any size and company; where not
    # (CUDA: prefill's fp16 products, the tensor-core kernels of a batch), the engine runs a
    # prompt's last token in a pass of its own, as a decode step, so that a request alone
    # gives the same tokens whether its prompt ran whole or from a reused prefix
    batch_invariant: bool = True

    def use_on_this_thread(self) -> None:
        """Make the calling thread ready to run this backend's operations (settings that are
        per thread: the CPU's thread count, CUDA's current device). The thread that owns the
        backend (the engine's) calls it first."""
        return None

    @contextmanager
    def one_sequence(self, on: bool = True):
        """Everything computed inside is a pass over one sequence's tokens (on; Batch.
        one_sequence: a checking pass of speculation, a prompt's chunk). A backend whose
        kernels give a token other bits in a pass of several tokens than in a one-token step
        computes such a pass the step's way inside, so that greedy speculation picks plain
        decoding's tokens (CUDA: passes of up to EXACT_PASS_TOKENS). The default does nothing:
        the NumPy and CPU backends give a token the same numbers in a pass of any size."""
        yield

    # -- data movement ----------------------------------------------------------------------

    @abstractmethod
    def load_weight(self, raw: np.ndarray, qtype: str, n_out: int, n_in: int) -> Weight:
        """Take raw GGUF block bytes [n_out, row_bytes] (may be a memory map) as a weight."""

    def head_prefix(self, head: Weight, raw: np.ndarray, n_out: int) -> Weight:
        """The first n_out rows of an output head (raw: their GGUF bytes) as a weight of its
        own, multiplied as the head is (a draft model's head over its common tokens)."""
        return self.load_weight(raw, head.qtype, n_out, head.n_in)

    @abstractmethod
    def load_vector(self, x: np.ndarray):
        """A float32 vector (norm weight, bias) onto the backend."""

    @abstractmethod
    def zeros(self, shape: tuple[int, ...]):
        """KV cache storage of zeros: float32, or the backend's cache type (fp16 on CUDA)."""

    @abstractmethod
    def to_host(self, x) -> np.ndarray:
        """Copy a backend array to a NumPy array."""

    def gather_rows(self, x, rows: np.ndarray):
        """Rows `rows` (host int32 [m]) of x [n, d]: [m, d]."""
        return x[np.asarray(rows)]

    # -- math -------------------------------------------------------------------------------

    @abstractmethod
    def matmul(self, x, w: Weight):
        """x [n, n_in] @ w.T -> [n, n_out], with the activation quantized as llama.cpp pairs it."""

    def matmul_many(self, x, ws: list[Weight]) -> list:
        """[matmul(x, w) for w in ws]; a backend may share the activation's quantization and
        one launch among them (Q, K and V; gate and up)."""
        return [self.matmul(x, w) for w in ws]

    @abstractmethod
    def embed(self, w: Weight, ids: np.ndarray):
        """Rows `ids` (int32 [n]) of an embedding matrix, dequantized: [n, n_in]."""

    @abstractmethod
    def rms_norm(self, x, weight, eps: float):
        """x [n, d] / rms(x) * weight [d] -> [n, d]."""

    @abstractmethod
    def rope(self, x, positions: np.ndarray, rope: RopeConfig):
        """Rotate x [n, heads, hd] in place by the positions (int32 [n]); returns x."""

    @abstractmethod
    def silu_mul(self, gate, up):
        """silu(gate) * up, both [n, f] -> [n, f]."""

    def gelu_mul(self, gate, up):
        """gelu(gate) * up with GELU's tanh form, both [n, f] -> [n, f]; as llama.cpp's CPU
        computes it: gate rounded to fp16, gelu looked up in fp16 (0 from -10 down, gate from
        10 up)."""
        raise NotImplementedError(f"the {self.name} backend has no GELU")

    def scale(self, x, factor: float):
        """x * factor, written into x; returns x."""
        raise NotImplementedError(f"the {self.name} backend has no scale")

    def softcap(self, x, cap: float):
        """cap * tanh(x / cap), written into x [n, m]; returns x."""
        raise NotImplementedError(f"the {self.name} backend has no soft-capping")

    @abstractmethod
    def add(self, x, y):
        """x + y, written into x; returns x."""

    @abstractmethod
    def add_bias(self, x, bias):
        """x [n, m] + bias [m], written into x; returns x."""

    # -- attention --------------------------------------------------------------------------

    @abstractmethod
    def kv_write(self, k_cache, v_cache, k, v, slots: np.ndarray) -> None:
        """Store k, v [n, hk, hd] at cache slots (int32 [n]) of k_cache, v_cache [c, hk, hd]."""

    @abstractmethod
    def attention(
        self, q, k_cache, v_cache, positions, scale: float, starts=None, window=0, softcap=0.0,
        ring=0, offsets=None, one_sequence=False,
    ):  # fmt: skip
        """Causal attention: query i [h, hd] of q [n, h, hd] attends to the cache slots of
        positions 0..positions[i] of its sequence, in that order: slot starts[i] + p
        (starts: int32 [n], the first slot of each query's sequence; None: all 0), or with
        ring > 0 (a sliding-window layer's ring of `ring` slots a sequence) slot starts[i] +
        (p + offsets[i]) % ring (offsets: int32 [n], each query's sequence's ring offset).
        Heads share kv heads in groups of h // hk. Scores are q . k * scale, then softcap *
        tanh(score / softcap) where softcap > 0. window > 0: only the last `window`
        positions, positions[i] - window + 1 .. positions[i] (a ring needs one, smaller than
        ring). one_sequence: every query is of one sequence (a checking pass; the caller
        knows it from the host's batch, also inside a graph, whose key holds it), so a
        backend may read each cached row once for all of them. Returns [n, h * hd], as an
        array or a value of the backend's own that its matmul and matmul_add take and
        to_host reads (CUDA: the rows with their 8-bit form, which the attention kernel
        writes along for the output projection)."""

    def kv_copy(self, k_cache, v_cache, src: int, dst: int, n: int, shift: int = 0, rope=None):
        """Copy rows src .. src + n of every layer of k_cache, v_cache [n_layer, c, hk, hd] to
        rows dst .. dst + n (the ranges may overlap); with shift (and rope: RopeConfig), keys are
        rotated by shift positions on the way, as a context shift needs (RoPE is applied before
        caching). The default composes rope and kv_write layer by layer."""
        slots = np.arange(dst, dst + n, dtype=np.int32)
        for layer in range(k_cache.shape[0]):
            k = k_cache[layer, src : src + n].astype(np.float32)  # copies: the ranges may overlap
            v = v_cache[layer, src : src + n].astype(np.float32)
            if shift:
                k = self.rope(k, np.full(n, shift, np.int32), rope)
            self.kv_write(k_cache[layer], v_cache[layer], k, v, slots)

    def kv_move(self, k_cache, v_cache, src_rows, dst_rows) -> None:
        """Rows src_rows[j] of every layer of k_cache, v_cache [n_layer, c, hk, hd] to rows
        dst_rows[j] (host int arrays; every row is read before any is written): a context
        shift's kept tokens moving within a ring. The default indexes the arrays."""
        src, dst = np.asarray(src_rows, np.int64), np.asarray(dst_rows, np.int64)
        k, v = k_cache[:, src], v_cache[:, src]  # copies
        k_cache[:, dst] = k
        v_cache[:, dst] = v

    # -- fused steps: the defaults compose the operations above; a backend may do each in one
    # pass (the CUDA backend does, to cut kernel launches per token) --------------------------

    def norm_matmul_many(self, x, weight, eps: float, ws: list[Weight]) -> list:
        """matmul_many(rms_norm(x, weight, eps), ws)."""
        return self.matmul_many(self.rms_norm(x, weight, eps), ws)

    def matmul_add(self, x, w: Weight, residual):
        """residual + x @ w.T, written into residual [n, n_out]; returns residual."""
        return self.add(residual, self.matmul(x, w))

    def silu_mul_matmul_add(self, gate, up, w: Weight, residual):
        """residual + (silu(gate) * up) @ w.T, written into residual; returns residual."""
        return self.add(residual, self.matmul(self.silu_mul(gate, up), w))

    def attention_inputs(self, q, k, v, biases, k_cache, v_cache, positions, slots, rope):
        """Prepare one layer's attention: add the biases ((bq, bk, bv) or None) to q [n, h*hd],
        k and v [n, hk*hd], rotate q and k, store k and v at cache slots (int32 [n]).
        Returns the rotated q [n, h, hd]."""
        n, hd = q.shape[0], k_cache.shape[2]
        if biases is not None:
            q, k, v = (self.add_bias(a, b) for a, b in zip((q, k, v), biases, strict=True))
        q = self.rope(q.reshape(n, -1, hd), positions, rope)
        k = self.rope(k.reshape(n, -1, hd), positions, rope)
        self.kv_write(k_cache, v_cache, k, v.reshape(n, -1, hd), slots)
        return q

    def rope_attention(
        self, q, k, v, biases, rope, slots, k_cache, v_cache, positions, scale: float,
        starts=None, window=0, softcap=0.0, ring=0, offsets=None, one_sequence=False,
        one_token_each=False,
    ):  # fmt: skip
        """One layer's attention from its projections: attention_inputs (biases, RoPE, the new
        rows stored at slots), then attention of the rotated q; the other arguments are
        theirs. one_token_each: every query is its sequence's only new token (a decode step;
        the caller knows it from the host's batch, as one_sequence), so a backend may store
        each new row inside the attention, where the query's own reads end (CUDA: a kernel
        a layer fewer)."""
        q = self.attention_inputs(q, k, v, biases, k_cache, v_cache, positions, slots, rope)
        return self.attention(
            q, k_cache, v_cache, positions, scale, starts, window, softcap, ring, offsets,
            one_sequence,
        )  # fmt: skip

    def layer_stack(self, layers, eps: float, block, source: str | None = None, head=None):
        """All transformer blocks (the model's Layer objects, computing as block: BlockSpec
        describes) as one callable, stack(x, positions, placement, full, ring) -> x, doing
        the arithmetic of the steps above; None where this backend has none for these
        weights (the model then calls the steps block by block). The KV cells: full =
        (k_cache, v_cache, slots, starts) of the full-context layers, ring = (k_cache,
        v_cache, slots, starts, offsets, R) of the ring layers (runner/kv_cache.py), caches
        as [layers, rows, hk, hd]; placement int64 [n_layer, 2]: each layer's (in the ring,
        index in its storage). source: the path of the file the weights are views of, if any
        (a backend may keep what it derives from them on disk, keyed by it); head: the weight
        multiplied after the blocks (the output), which a backend may prepare with them.
        A stack's for_block(other) is the same weights computing as another description of
        the same layers (phi3's long-context RoPE), or None where it cannot."""
        return None

    # -- whole decode steps -------------------------------------------------------------------

    def step_size(self, n: int) -> int:
        """Tokens a decode step of n tokens is padded to (a backend that captures steps keeps
        one capture per size); n where nothing is captured."""
        return n

    def run_step(self, owner, key, step, *vectors):
        """step(*vectors) -> backend array(s), returned on the host. A backend may capture the
        step once per (owner, key, shape of the vectors) and replay it (the CUDA backend: a
        graph): step must then read its inputs only from the int32 vectors it is handed (token
        ids, positions, ...) and owner, whose buffers the capture holds, must stay alive while
        it is used. The default runs it."""
        out = step(*vectors)
        if isinstance(out, tuple):
            return tuple(self.to_host(a) for a in out)
        return self.to_host(out)

    def run_chain(self, owner, key, step, steps: int, *vectors) -> np.ndarray:
        """`steps` greedy steps: step(*vectors) -> the most likely id of each token (int32
        [n], on the backend), where vectors are (ids, positions, ..., moves) and after each
        step its picks become the ids and positions move on by moves (1 for a real token, 0
        for padding, whose position stays). Returns every step's picks on the host, int32
        [steps, n]. A backend may capture step as run_step does, under the same rules, and
        chain the replays on the device; the default runs the steps one by one."""
        ids, positions, *others, moves = vectors
        picked = []
        for _ in range(steps):
            ids = self.to_host(step(ids, positions, *others, moves)).astype(np.int32)
            positions = positions + moves
            picked.append(ids)
        return np.stack(picked)

    # -- token selection ----------------------------------------------------------------------

    def top_k(self, logits, k: int) -> tuple:
        """The k largest values of each row of logits [n, vocab], best first and the lower id
        first on ties: (ids int32 [n, k], values float32 [n, k]) on the backend. A decode step
        returns these instead of whole rows where the sampler needs no more."""
        return top_k_host(self.to_host(logits), k)


def top_k_host(x: np.ndarray, k: int) -> tuple:
    """Backend.top_k on host logits [n, vocab] (NumPy results)."""
    x = np.asarray(x, np.float32)
    if k == 1:  # argmax stops at a NaN, if any: only then is the row copied without them
        ids, best = _first_max(x)
        if not np.isnan(best).any():
            return ids, best
        return _first_max(np.where(np.isnan(x), -np.inf, x))
    if k <= SMALL_K:  # k passes of argmax, each the best left and its lowest id on ties
        ids, work, rows = np.empty((len(x), k), np.int32), x.copy(), np.arange(len(x))
        for j in range(k):
            ids[:, j] = np.argmax(work, axis=1)
            work[rows, ids[:, j]] = -np.inf
        values = np.take_along_axis(x, ids, axis=1)
        repeated = (np.diff(np.sort(ids, axis=1), axis=1) == 0).any()  # rows of -inf
        if not (repeated or np.isnan(values).any()):
            return ids, values
    x = np.where(np.isnan(x), -np.inf, x)
    ids = np.empty((len(x), k), np.int32)
    for r, row in enumerate(x):
        least = row[np.argpartition(-row, k - 1)[k - 1]]  # the k-th largest value
        above = np.flatnonzero(row > least)
        chosen = np.concatenate([above, np.flatnonzero(row == least)[: k - len(above)]])
        ids[r] = chosen[np.lexsort((chosen, -row[chosen]))]
    return ids, np.take_along_axis(x, ids, axis=1)


SMALL_K = 8  # up to this k, repeated argmax beats a partition of a 50k-150k vocabulary


def _first_max(x: np.ndarray) -> tuple:
    """Each row's largest value and its lowest id: (ids int32 [n, 1], values [n, 1])."""
    ids = np.argmax(x, axis=1).astype(np.int32)[:, None]
    return ids, np.take_along_axis(x, ids, axis=1)
