"""KV cells: one block of key/value storage shared by the sequences of a model, and the only code
that changes its contents.

Two kinds of storage, each [layers, rows, n_kv_heads, head_dim] on the backend:

- Full-context layers (every layer of most models; Gemma's global ones): each sequence owns
  a run of n_ctx consecutive rows, row base + i holding the token at position i, so attention
  reads one contiguous run of rows per query. A full window shifts: the oldest tokens after
  the first n_keep are dropped, the rest move down and their keys are re-rotated to their new
  positions (RoPE is applied before caching), as llama.cpp's context shift. Moving the cells
  keeps attention's reads contiguous; it costs one copy of the window per n_ctx / 2 tokens.
- Sliding-window layers (Gemma's local ones), where the context is longer than they need:
  each sequence owns a ring of R = window + max(max_pass, window) rows, position p at ring row
  ring_base + (p + ring_offset) mod R, so their cache does not grow with the context. A
  query reads its last `window` cells through the ring (one wrap at most). R holds the
  window of the first query of the largest pass the cells admit (max_pass tokens, all written
  before any attends), so a trimmed draft's cells are only ever overwritten once no window
  needs them; the second `window` rows keep a context shift's kept tokens in the ring when
  they stay visible (the engine's shifts move as many tokens as they drop). A shift moves no
  ring row: the offset grows by the tokens dropped, the kept tokens' few rows move to their
  new slots, and the moved keys are re-rotated in place.

A sequence tracks the token ids it holds, so a new request can reuse the longest common
prefix of any sequence (a shared system prompt, the previous chat turn): on ring layers
only while the prefix's last `window` cells are still in the ring.
"""

from __future__ import annotations

import numpy as np

from fastrun.formats.errors import FastrunError

DEFAULT_MAX_PASS = 512  # tokens one pass may add to a sequence (the model's prefill chunk)


def ring_rows(windows, n_ctx: int, max_pass: int) -> int:
    """R, the ring of each sequence on sliding-window layers (windows: each layer's, 0 for a
    full-context one); 0 where a ring would not be smaller than the context (the sliding
    layers then keep full rows, masked by their window, as the global ones)."""
    widest = max(windows, default=0)
    if widest <= 0:
        return 0
    rows = widest + max(max_pass, widest)
    return rows if rows < n_ctx else 0


def storage_rows(windows, n_seq: int, n_ctx: int, max_pass: int) -> dict:
    """Layers and rows of each storage: {"full": (layers, rows), "ring": (layers, rows)},
    each with one scratch row (the padding tokens of a decode step write there)."""
    ring = ring_rows(windows, n_ctx, max_pass)
    n_ring = sum(1 for w in windows if ring and w > 0)
    return {
        "full": (len(windows) - n_ring, n_seq * n_ctx + 1),
        "ring": (n_ring, n_seq * ring + 1),
    }


class KVCells:
    """Storage for n_seq sequences of n_ctx cells each, plus one scratch row per storage: the
    cache row of the padding tokens that fill a decode step up to the backend's step size.

    windows: each layer's attention window (0: full context); max_pass: the most tokens one
    pass may add to a sequence (it sizes the rings; Batch enforces it)."""

    def __init__(
        self,
        backend,
        windows,
        n_seq: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        max_pass: int = DEFAULT_MAX_PASS,
    ):
        if n_seq < 1 or n_ctx < 1:
            raise FastrunError(f"a KV cache needs cells: {n_seq} sequences of {n_ctx}")
        windows = [int(w) for w in windows]
        self.backend = backend
        self.n_ctx = n_ctx
        self.max_pass = max_pass
        self.ring = ring_rows(windows, n_ctx, max_pass)  # R; 0: no ring
        self.window = max(windows) if self.ring else 0  # what the ring layers attend to
        # each layer's storage: (in the ring, index among that storage's layers)
        self.placement = np.zeros((len(windows), 2), np.int64)
        counts = [0, 0]
        for i, w in enumerate(windows):
            kind = int(self.ring > 0 and w > 0)
            self.placement[i] = (kind, counts[kind])
            counts[kind] += 1
        rows = storage_rows(windows, n_seq, n_ctx, max_pass)
        full = (rows["full"][0], rows["full"][1], n_head_kv, head_dim)
        ring = (rows["ring"][0], rows["ring"][1], n_head_kv, head_dim)
        self.k = backend.zeros(full)  # [full layers, rows, hk, hd]
        self.v = backend.zeros(full)
        self.ring_k = backend.zeros(ring)  # [ring layers, n_seq * R + 1, hk, hd]
        self.ring_v = backend.zeros(ring)
        self.pad_row = n_seq * n_ctx
        self.ring_pad_row = n_seq * self.ring
        self.sequences = [KVCache(self, s) for s in range(n_seq)]

    def layer(self, i: int) -> tuple:
        """Layer i's (k, v, ring): its storage's views, and R where it is a ring layer (else 0)."""
        in_ring, at = (int(v) for v in self.placement[i])
        if in_ring:
            return self.ring_k[at], self.ring_v[at], self.ring
        return self.k[at], self.v[at], 0

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.k, self.v, self.ring_k, self.ring_v))

    def free(self) -> None:
        """Release the storage; the cells are unusable afterwards."""
        self.k = self.v = self.ring_k = self.ring_v = None
        for s in self.sequences:
            s.tokens = []
            s.ring_from = 0


def _split_by_rope(ropes, layers):
    """Runs (first, last, rope) of consecutive layers (indices into `layers`) of one RoPE."""
    first = 0
    for last in range(1, len(layers) + 1):
        if last == len(layers) or ropes[layers[last]] is not ropes[layers[first]]:
            yield first, last, ropes[layers[first]]
            first = last


class KVCache:
    """The cells of one sequence: rows base .. base + n_ctx of the full-context storage, and
    ring_base .. ring_base + R of the ring."""

    def __init__(self, cells: KVCells, index: int):
        self.cells = cells
        self.index = index
        self.n_ctx = cells.n_ctx
        self.base = index * cells.n_ctx  # first full-context row of this sequence
        self.ring_base = index * cells.ring  # first ring row
        self.ring_offset = 0  # position p's ring row: ring_base + (p + ring_offset) % R
        self.ring_from = 0  # the first position whose ring row still holds it (later ones do)
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
        ring = self.cells.ring
        if ring:
            if self.ring_from > max(0, start - self.cells.window + 1):
                raise FastrunError(  # a bug, not a user's mistake: reuse and shifts check this
                    f"the sliding-window cells of positions {self.ring_from - 1} and before were"
                    f" overwritten; the query at {start} needs them"
                )
            self.ring_from = max(self.ring_from, start + len(ids) - ring)
        self.tokens.extend(ids)
        return start

    def trim(self, length: int) -> None:
        """Forget every token from position `length` on (a rejected draft, an edited turn)."""
        del self.tokens[max(0, length) :]
        self.ring_from = min(self.ring_from, len(self.tokens))

    def common_prefix(self, ids) -> int:
        """How many leading ids the cache already holds."""
        n = 0
        for a, b in zip(self.tokens, ids, strict=False):
            if a != int(b):
                break
            n += 1
        return n

    def reusable(self, n: int) -> int:
        """How many of the first n tokens a new pass can continue from: n where the ring still
        holds the last `window` cells before position n (or there is no ring), else 0."""
        n = max(0, min(n, self.length))
        if self.cells.ring and self.ring_from > max(0, n - self.cells.window + 1):
            return 0
        return n

    def reusable_prefix(self, ids, limit: int) -> int:
        """The leading ids (at most limit) that the cache holds and a new pass can continue."""
        return self.reusable(min(self.common_prefix(ids), limit))

    def _ring_runs(self, first: int, end: int, offset: int | None = None):
        """(ring row, count): the contiguous runs of ring rows of positions first .. end."""
        ring = self.cells.ring
        offset = self.ring_offset if offset is None else offset
        n = end - first
        if n <= 0:
            return []
        at = (first + offset) % ring
        head = min(n, ring - at)
        runs = [(self.ring_base + at, head)]
        if n > head:
            runs.append((self.ring_base, n - head))
        return runs

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
        cells, backend = self.cells, self.cells.backend
        n_layer = len(cells.placement)
        per_layer = ropes if isinstance(ropes, list | tuple) else [ropes] * n_layer
        full = [i for i in range(n_layer) if not cells.placement[i, 0]]
        if moved and full:
            src, dst = self.base + n_keep + n_discard, self.base + n_keep
            for first, last, rope in _split_by_rope(per_layer, full):
                k, v = self.k[first:last], self.v[first:last]
                backend.kv_copy(k, v, src, dst, moved, -n_discard, rope)
        if cells.ring:
            self._shift_ring(n_keep, n_discard, per_layer)
        del self.tokens[n_keep : n_keep + n_discard]

    def _shift_ring(self, n_keep: int, n_discard: int, per_layer) -> None:
        """The shift on the ring: the moved tokens stay in their rows (the offset grows by
        n_discard), their keys rotated in place; the kept tokens that the ring still holds
        move to the rows of their positions under the new offset."""
        cells, backend = self.cells, self.cells.backend
        ring, length = cells.ring, self.length
        after = length - n_discard  # the length after the shift
        ring_layers = [i for i in range(len(cells.placement)) if cells.placement[i, 0]]
        old, new = self.ring_offset, (self.ring_offset + n_discard) % ring
        rotate = self._ring_runs(max(n_keep + n_discard, self.ring_from), length, old)
        for first, last, rope in _split_by_rope(per_layer, ring_layers):
            k, v = cells.ring_k[first:last], cells.ring_v[first:last]
            for row, count in rotate:
                backend.kv_copy(k, v, row, row, count, -n_discard, rope)
        if self.ring_from > n_keep + n_discard:  # some moved tokens are gone already
            self.ring_from -= n_discard
        else:  # every moved one is held: so are the kept ones from kept_from on
            kept_from = min(n_keep, max(self.ring_from, after - ring))
            if kept_from < n_keep:
                positions = np.arange(kept_from, n_keep)
                src = self.ring_base + (positions + old) % ring
                dst = self.ring_base + (positions + new) % ring
                backend.kv_move(cells.ring_k, cells.ring_v, src, dst)
            self.ring_from = kept_from
        self.ring_offset = new

    def copy_prefix(self, source: KVCache, n: int) -> None:
        """Hold the first n tokens of another sequence of the same cells (its cells copied;
        fewer where its ring no longer holds what they need: see reusable)."""
        n = source.reusable(min(n, self.n_ctx))
        if source is self:
            self.trim(n)
            return
        cells, backend = self.cells, self.cells.backend
        if n and cells.k.shape[0]:
            backend.kv_copy(cells.k, cells.v, source.base, self.base, n)
        self.ring_from = 0
        if cells.ring:  # the same offset: the runs of rows line up
            self.ring_offset = source.ring_offset
            self.ring_from = max(source.ring_from, n - cells.ring, 0) if n else 0
            for row, count in source._ring_runs(self.ring_from, n):
                dst = row - source.ring_base + self.ring_base
                backend.kv_copy(cells.ring_k, cells.ring_v, row, dst, count)
        self.tokens = source.tokens[:n]

    def free(self) -> None:
        """Forget the tokens; a cache made alone by new_cache also releases its storage."""
        self.tokens = []
        self.ring_from = 0
        if len(self.cells.sequences) == 1:
            self.cells.free()
