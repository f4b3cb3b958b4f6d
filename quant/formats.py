"""The table of GGML block formats: one entry per tensor type fastrun knows.

Every other part of fastrun (reader, reference quantizers, kernels) looks sizes and
pairings up here rather than hard-coding them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastrun.formats.errors import GGUFError

QK_K = 256  # super-block size of the K-quants


@dataclass(frozen=True)
class BlockFormat:
    """Traits of one GGML tensor type."""

    id: int  # the GGML type id stored in GGUF tensor infos
    name: str
    block_size: int  # weights per block
    block_bytes: int  # bytes per block
    activation: str  # the format the activation row is quantized to for this type's dot product

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of n weights; n must be a whole number of blocks."""
        if n % self.block_size:
            raise GGUFError(
                f"{self.name}: a row of {n} is not a whole number of {self.block_size}-blocks"
            )
        return n // self.block_size * self.block_bytes


_TABLE = [
    # id, name, block size, block bytes, activation format of its dot product (llama.cpp CPU)
    BlockFormat(0, "F32", 1, 4, "F32"),
    BlockFormat(1, "F16", 1, 2, "F16"),
    BlockFormat(2, "Q4_0", 32, 18, "Q8_0"),
    BlockFormat(3, "Q4_1", 32, 20, "Q8_1"),
    BlockFormat(6, "Q5_0", 32, 22, "Q8_0"),
    BlockFormat(7, "Q5_1", 32, 24, "Q8_1"),
    BlockFormat(8, "Q8_0", 32, 34, "Q8_0"),
    BlockFormat(9, "Q8_1", 32, 36, "Q8_1"),
    BlockFormat(12, "Q4_K", QK_K, 144, "Q8_K"),
    BlockFormat(13, "Q5_K", QK_K, 176, "Q8_K"),
    BlockFormat(14, "Q6_K", QK_K, 210, "Q8_K"),
    BlockFormat(15, "Q8_K", QK_K, 292, "Q8_K"),
    BlockFormat(30, "BF16", 1, 2, "BF16"),
]

BY_ID: dict[int, BlockFormat] = {f.id: f for f in _TABLE}
BY_NAME: dict[str, BlockFormat] = {f.name: f for f in _TABLE}


def block_format(qtype: str | int) -> BlockFormat:
    """Look a format up by GGML id or name (case-insensitive); GGUFError if unknown."""
    fmt = BY_ID.get(qtype) if isinstance(qtype, int) else BY_NAME.get(str(qtype).upper())
    if fmt is None:
        raise GGUFError(f"unsupported tensor type {qtype!r}")
    return fmt
