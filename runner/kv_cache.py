"""Per-sequence KV cache: preallocated for n_ctx, and the only code that changes its contents.

Keys and values live on the backend as [n_layer, n_ctx, n_kv_heads, head_dim]. The cache
tracks the token ids it holds, so a new chat turn can reuse the longest common prefix.
"""

from __future__ import annotations

import numpy as np

from fastrun.formats.errors import FastrunError


class KVCache:
    """Keys and values of one sequence. Cache row base + i holds the token at position i."""

    def __init__(
        self, backend, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, shared=None
    ):
        self.backend = backend
        self.n_ctx = n_ctx
        self.base = 0  # first cache row of this sequence
        if shared is None:
            shape = (n_layer, n_ctx, n_head_kv, head_dim)
            self.k = backend.zeros(shape)  # [n_layer, n_ctx, hk, hd]; k[i]: layer i's
            self.v = backend.zeros(shape)
        else:  # a sequence of a BatchKVCache: rows [base, base + n_ctx) of its storage
            self.k, self.v, self.base = shared
        self.tokens: list[int] = []  # the ids whose keys and values are stored, in order

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def free_slots(self) -> int:
        return self.n_ctx - len(self.tokens)

    def append(self, ids) -> np.ndarray:
        """Reserve slots for new tokens; returns their positions (int32 [n])."""
        ids = [int(i) for i in ids]
        if len(ids) > self.free_slots:
            raise FastrunError(
                f"context full: {self.length} + {len(ids)} tokens exceed n_ctx = {self.n_ctx}"
            )
        start = len(self.tokens)
        self.tokens.extend(ids)
        return np.arange(start, start + len(ids), dtype=np.int32)

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

    def free(self) -> None:
        """Release the storage; the cache is unusable afterwards."""
        self.k, self.v, self.tokens = [], [], []


class BatchKVCache:
    """n_seq sequences in one block of storage, so that one decode step runs all of them as a
    batch (one matrix product per weight). Each sequence is a KVCache over its own rows."""

    def __init__(
        self, backend, n_layer: int, n_seq: int, n_ctx: int, n_head_kv: int, head_dim: int
    ):
        shape = (n_layer, n_seq * n_ctx, n_head_kv, head_dim)
        self.k = backend.zeros(shape)  # [n_layer, n_seq * n_ctx, hk, hd]
        self.v = backend.zeros(shape)
        self.sequences = [
            KVCache(backend, n_layer, n_ctx, n_head_kv, head_dim, (self.k, self.v, s * n_ctx))
            for s in range(n_seq)
        ]

    def sequence(self, s: int) -> KVCache:
        return self.sequences[s]
