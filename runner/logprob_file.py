"""The file `fastrun perplexity --kl-divergence-base` writes: a model's log-probabilities.

Layout (little-endian): magic b"FRLOGP01", then uint32 n_ctx, n_vocab, n_chunk, n_scored (the
scored positions of each chunk), then the int32 tokens of the chunks [n_chunk * n_ctx], then
float16 log-probabilities [n_chunk, n_scored, n_vocab]. Rows are appended chunk by chunk and
read back through a memory map, so neither side holds them all in memory. Written to a
temporary name and renamed when complete (formats.atomic_file), as GGUF output is.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from fastrun.formats.atomic_file import AtomicFile
from fastrun.formats.errors import FastrunError

MAGIC = b"FRLOGP01"
_HEAD = struct.Struct("<8s4I")


class LogprobWriter:
    """Append each chunk's scored log-probabilities; the file appears on a clean exit."""

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_vocab: int, tokens: np.ndarray):
        self.path = os.fspath(path)
        self.n_ctx, self.n_vocab = n_ctx, n_vocab
        self.tokens = np.ascontiguousarray(tokens, dtype="<i4")
        self.n_chunk = self.tokens.size // n_ctx
        self.n_scored = n_ctx - 1 - n_ctx // 2
        self._out: AtomicFile | None = None

    def __enter__(self) -> LogprobWriter:
        self._out = AtomicFile(self.path).__enter__()
        self._out.write(_HEAD.pack(MAGIC, self.n_ctx, self.n_vocab, self.n_chunk, self.n_scored))
        self._out.write(self.tokens.tobytes())
        return self

    def append(self, logprobs: np.ndarray) -> None:
        self._out.write(np.ascontiguousarray(logprobs, dtype="<f2").tobytes())

    def __exit__(self, *exc) -> None:
        self._out.__exit__(*exc)


class LogprobFile:
    """A saved base: header fields, tokens, and a memory-mapped [n_chunk, n_scored, n_vocab]."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                head = fh.read(_HEAD.size)
        except OSError as e:
            raise FastrunError(f"cannot read {self.path}: {e.strerror}") from None
        if len(head) < _HEAD.size or head[:8] != MAGIC:
            raise FastrunError(f"{self.path} is not a fastrun log-probability file")
        _, self.n_ctx, self.n_vocab, self.n_chunk, self.n_scored = _HEAD.unpack(head)
        start = _HEAD.size + 4 * self.n_chunk * self.n_ctx
        expected = start + 2 * self.n_chunk * self.n_scored * self.n_vocab
        if size != expected:
            raise FastrunError(f"{self.path} is truncated ({size} bytes, expected {expected})")
        self.tokens = np.fromfile(self.path, "<i4", self.n_chunk * self.n_ctx, offset=_HEAD.size)
        self.logprobs = np.memmap(
            self.path, "<f2", "r", start, (self.n_chunk, self.n_scored, self.n_vocab)
        )
