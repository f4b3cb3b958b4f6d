"""A batch of tokens for one forward pass, each tagged with its sequence and position, as
llama.cpp's `llama_batch`: decode tokens of many sequences and prefill chunks of others share a
pass, and the model does not know who asked."""

from __future__ import annotations

import numpy as np

from fastrun.formats.errors import FastrunError
from fastrun.runner.kv_cache import KVCache

# Tokens of one sequence in a step (a pass that every backend runs as a decode step, CUDA as a
# captured graph): its last token and up to MAX_STEP_TOKENS - 1 drafted ones to check.
MAX_STEP_TOKENS = 16


class Batch:
    """Tokens gathered sequence by sequence; `add` reserves their cells. The arrays are made
    once, when the pass first asks for them."""

    def __init__(self):
        self._ids: list[int] = []
        self._positions: list[int] = []
        self._starts: list[int] = []
        self._ring_starts: list[int] = []
        self._offsets: list[int] = []
        self._outputs: list[int] = []
        self._undo: list[tuple[KVCache, int]] = []  # each cache's length before this batch
        self._added: dict[int, int] = {}  # tokens this pass adds to each cache (by id)
        self._longest = 0  # the most tokens one add() brought
        self._arrays: tuple | None = None

    @property
    def n(self) -> int:
        return len(self._ids)

    def add(self, cache: KVCache, ids, logits: str = "last") -> int:
        """Append ids of one sequence (its cells reserved now); logits: "last", "all" or "none",
        the rows whose logits the pass returns. Returns the place of this sequence's first
        output among the pass's outputs."""
        ids = [int(i) for i in ids]
        added = self._added.get(id(cache), 0) + len(ids)
        if cache.cells.ring and added > cache.cells.max_pass:  # its ring holds no more
            raise FastrunError(
                f"a pass adds {added} tokens to one sequence; its cells take {cache.cells.max_pass}"
            )
        first = cache.append(ids)
        self._added[id(cache)] = added
        self._undo.append((cache, first))
        self._longest = max(self._longest, len(ids))
        row, place = len(self._ids), len(self._outputs)
        self._ids += ids
        self._positions += range(first, first + len(ids))
        self._starts += [cache.base] * len(ids)
        self._ring_starts += [cache.ring_base] * len(ids)
        self._offsets += [cache.ring_offset] * len(ids)
        if logits == "all":
            self._outputs += range(row, row + len(ids))
        elif logits == "last":
            self._outputs.append(row + len(ids) - 1)
        self._arrays = None
        return place

    def rollback(self) -> None:
        """Forget the batch's tokens in their caches (a pass that did not finish)."""
        for cache, length in reversed(self._undo):
            cache.trim(length)

    def _made(self) -> tuple:
        if self._arrays is None:
            self._arrays = tuple(
                np.array(v, np.int32)
                for v in (
                    self._ids, self._positions, self._starts, self._outputs,
                    self._ring_starts, self._offsets,
                )
            )  # fmt: skip
        return self._arrays

    @property
    def ids(self) -> np.ndarray:  # int32 [n]
        return self._made()[0]

    @property
    def positions(self) -> np.ndarray:  # int32 [n]
        return self._made()[1]

    @property
    def starts(self) -> np.ndarray:  # int32 [n]: the first cache row of each token's sequence
        return self._made()[2]

    @property
    def ring_starts(self) -> np.ndarray:  # int32 [n]: the first ring row of each token's sequence
        return self._made()[4]

    @property
    def offsets(self) -> np.ndarray:  # int32 [n]: each token's sequence's ring offset
        return self._made()[5]

    @property
    def caches(self) -> list[KVCache]:
        """Each add()'s sequence, in order (a decode step's, row by row)."""
        return [cache for cache, _ in self._undo]

    @property
    def outputs(self) -> np.ndarray:  # int32 [m]: the rows whose logits are returned
        return self._made()[3]

    @property
    def one_sequence(self) -> bool:
        """Several tokens, all of one sequence (a checking pass of drafted tokens, a short
        prompt): a backend may read each cached row once for all of them."""
        starts = self.starts
        return self.n > 1 and bool((starts == starts[0]).all())

    @property
    def one_token_each(self) -> bool:
        """Every token is its sequence's only one (a decode step): a backend may store each
        new key and value inside the attention, as the last row its query reads."""
        return self.n > 0 and len(np.unique(self.starts)) == self.n

    @property
    def is_decode(self) -> bool:
        """Every token wants logits and no sequence brings more than MAX_STEP_TOKENS: a decode
        step, or the check of drafted tokens (graph-captured where the backend captures
        steps; a token attends by its position, so a sequence's tokens may share a step)."""
        return self.n == len(self._outputs) > 0 and self._longest <= MAX_STEP_TOKENS
