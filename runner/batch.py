"""A batch of tokens for one forward pass, each tagged with its sequence and position, as
llama.cpp's `llama_batch`: decode tokens of many sequences and prefill chunks of others share a
pass, and the model does not know who asked."""

from __future__ import annotations

import numpy as np

from fastrun.runner.kv_cache import KVCache


class Batch:
    """Tokens gathered sequence by sequence; `add` reserves their cells. The arrays are made
    once, when the pass first asks for them."""

    def __init__(self):
        self._ids: list[int] = []
        self._positions: list[int] = []
        self._starts: list[int] = []
        self._outputs: list[int] = []
        self._undo: list[tuple[KVCache, int]] = []  # each cache's length before this batch
        self._arrays: tuple | None = None

    @property
    def n(self) -> int:
        return len(self._ids)

    def add(self, cache: KVCache, ids, logits: str = "last") -> int:
        """Append ids of one sequence (its cells reserved now); logits: "last", "all" or "none",
        the rows whose logits the pass returns. Returns the place of this sequence's first
        output among the pass's outputs."""
        ids = [int(i) for i in ids]
        first = cache.append(ids)
        self._undo.append((cache, first))
        row, place = len(self._ids), len(self._outputs)
        self._ids += ids
        self._positions += range(first, first + len(ids))
        self._starts += [cache.base] * len(ids)
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
                for v in (self._ids, self._positions, self._starts, self._outputs)
            )
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
    def outputs(self) -> np.ndarray:  # int32 [m]: the rows whose logits are returned
        return self._made()[3]

    @property
    def is_decode(self) -> bool:
        """One token per sequence, each wanting logits: a decode step (graph-captured where the
        backend captures steps)."""
        return len(self._undo) == self.n == len(self._outputs) > 0
