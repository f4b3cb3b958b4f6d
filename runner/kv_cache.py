"""KV cells: one block of key/value storage shared by the sequences of a model, and the only code
that changes its contents.

Keys and values live on the backend as [n_layer, rows, n_kv_heads, head_dim]. Each sequence
owns a window of n_ctx consecutive rows (row base + i holds the token at position i), so
attention reads one contiguous run of rows per query and a decode step of many sequences is
one batch. A full window shifts: the oldest tokens after the first n_keep are dropped, the
rest move down and their keys are re-rotated to their new positions (RoPE is applied before
caching), as llama.cpp's context shift. Moving the cells instead of wrapping a ring keeps
attention's reads contiguous; it costs one copy of the window per n_ctx / 2 tokens.

A sequence tracks the token ids it holds, so a new request can reuse the longest common
prefix of any sequence (a shared system prompt, the previous chat turn).
"""

from __future__ import annotations

from fastrun.formats.errors import FastrunError


class KVCells:
    """Storage for n_seq sequences of n_ctx cells each, plus one scratch row: the cache row of
    the padding tokens that fill a decode step up to the backend's step size."""

    def __init__(
        self, backend, n_layer: int, n_seq: int, n_ctx: int, n_head_kv: int, head_dim: int
    ):
        if n_seq < 1 or n_ctx < 1:
            raise FastrunError(f"a KV cache needs cells: {n_seq} sequences of {n_ctx}")
        self.backend = backend
        self.n_ctx = n_ctx
        shape = (n_layer, n_seq * n_ctx + 1, n_head_kv, head_dim)
        self.k = backend.zeros(shape)  # [n_layer, rows, hk, hd]; k[i]: layer i's
        self.v = backend.zeros(shape)
        self.pad_row = n_seq * n_ctx
        self.sequences = [KVCache(self, s) for s in range(n_seq)]

    def free(self) -> None:
        """Release the storage; the cells are unusable afterwards."""
        self.k = self.v = None
        for s in self.sequences:
            s.tokens = []


class KVCache:
    """The cells of one sequence: rows base .. base + n_ctx of a KVCells."""

    def __init__(self, cells: KVCells, index: int):
        self.cells = cells
        self.index = index
        self.n_ctx = cells.n_ctx
        self.base = index * cells.n_ctx  # first cache row of this sequence
        self.tokens: list[int] = []  # the ids whose keys and values are stored, in order

    @property
    def k(self):
        return self.cells.k

    @property
    def v(self):
        return self.cells.v

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def free_slots(self) -> int:
        return self.n_ctx - len(self.tokens)

    def append(self, ids: list[int]) -> int:
        """Reserve cells for new tokens; returns the position of the first."""
        if len(ids) > self.free_slots:
            raise FastrunError(
                f"context full: {self.length} + {len(ids)} tokens exceed n_ctx = {self.n_ctx}"
            )
        start = len(self.tokens)
        self.tokens.extend(ids)
        return start

    def trim(self, length: int) -> None:
        """Forget every token from position `length` on (a rejected draft, an edited turn)."""
        del self.tokens[max(0, length) :]

    def common_prefix(self, ids) -> int:
        """How many leading ids the cache already holds."""
        n = 0
        for a, b in zip(self.tokens, ids, strict=False):
            if a != int(b):
                break
            n += 1
        return n

    def shift(self, n_keep: int, n_discard: int, ropes) -> None:
        """Context shift: drop the n_discard tokens after the first n_keep; the later ones move
        down by n_discard positions, their keys rotated back by as much (ropes: one RopeConfig
        for every layer, or a list with each layer's, the same object for layers that share
        one: gemma3's local and global layers differ)."""
        n_keep = max(0, min(n_keep, self.length))
        n_discard = max(0, min(n_discard, self.length - n_keep))
        moved = self.length - n_keep - n_discard
        if n_discard == 0:
            return
        if moved:
            src, dst = self.base + n_keep + n_discard, self.base + n_keep
            per_layer = ropes if isinstance(ropes, list | tuple) else [ropes] * self.k.shape[0]
            first = 0
            for last in range(1, len(per_layer) + 1):  # runs of layers of one RoPE, one copy each
                if last == len(per_layer) or per_layer[last] is not per_layer[first]:
                    k, v = self.k[first:last], self.v[first:last]
                    rope = per_layer[first]
                    self.cells.backend.kv_copy(k, v, src, dst, moved, -n_discard, rope)
                    first = last
        del self.tokens[n_keep : n_keep + n_discard]

    def copy_prefix(self, source: KVCache, n: int) -> None:
        """Hold the first n tokens of another sequence of the same cells (its cells copied)."""
        n = min(n, source.length, self.n_ctx)
        if source is not self and n:
            self.cells.backend.kv_copy(self.k, self.v, source.base, self.base, n)
        self.tokens = source.tokens[:n]

    def free(self) -> None:
        """Forget the tokens; a cache made alone by new_cache also releases its storage."""
        self.tokens = []
        if len(self.cells.sequences) == 1:
            self.cells.free()
