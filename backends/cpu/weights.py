"""Weights of the CPU backend: the raw GGUF rows, and the tiles its kernels read (repacked
on first use, or for all layers of a model into one buffer)."""

from __future__ import annotations

import numpy as np

from fastrun.backends.base import Weight
from fastrun.backends.cpu import matmul, tiles
from fastrun.formats.errors import FastrunError
from fastrun.quant import dequantize
from fastrun.quant.formats import block_format


class CPUWeight(Weight):
    """Raw GGUF rows [n_out, row_bytes] (read-only, usually the memory map itself)."""

    def __init__(self, raw: np.ndarray, qtype: str, n_out: int, n_in: int):
        self.qtype, self.n_out, self.n_in = qtype, n_out, n_in
        self.format = block_format(qtype)
        if raw.shape != (n_out, self.format.row_bytes(n_in)):
            raise FastrunError(f"{qtype} weight: bytes {raw.shape} do not fit [{n_out}, {n_in}]")
        self.raw = raw
        self._kernel_bytes = None
        if qtype in ("F32", "F16", "BF16"):  # float weights: one float32 matrix
            self.dense = dequantize(raw, qtype, n_out * n_in).reshape(n_out, n_in)
        elif qtype in matmul.FORMATS:
            self.kernel = matmul.FORMATS.index(qtype)
        else:
            raise FastrunError(f"the CPU backend has no matmul for {qtype} weights")

    @property
    def fusable(self) -> bool:
        """Whether compiled steps may multiply it: an integer-kernel format whose products
        have no padding columns (tiles of 8 rows)."""
        return self.qtype in matmul.FORMATS and self.n_out % tiles.TILE_ROWS == 0

    @property
    def kernel_shape(self) -> tuple[int, int]:
        return tiles.tiled_shape(self.qtype, self.n_out, self.n_in)

    @property
    def kernel_bytes(self) -> np.ndarray:
        """What matmul.FORMATS[self.kernel] multiplies: tiles, repacked on first use (a
        weight never multiplied, such as an embedding, is never repacked)."""
        if self._kernel_bytes is None:
            self.place_kernel_bytes(None)
        return self._kernel_bytes

    def place_kernel_bytes(self, out: np.ndarray | None) -> None:
        """Repack into out (uint8 of kernel_shape; None: a new array), read-only after."""
        packed = tiles.repack(self.raw, self.qtype, out)
        packed.flags.writeable = False  # one compiled signature: read-only weight bytes
        self._kernel_bytes = packed


def kernel_bytes_in_one_buffer(weights) -> tuple[np.ndarray, np.ndarray]:
    """Every weight's kernel bytes placed in one read-only buffer, for a compiled call that
    takes them as one array: (buffer, where int64 [len, 3]: offset, units, bytes per unit).
    Each weight then multiplies from its view of the buffer (no second copy)."""
    shapes = [w.kernel_shape for w in weights]
    sizes = [rows * cols for rows, cols in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    buffer = np.empty(int(offsets[-1]), np.uint8)
    for w, (rows, cols), at in zip(weights, shapes, offsets, strict=False):
        w.place_kernel_bytes(buffer[at : at + rows * cols].reshape(rows, cols))
    buffer.flags.writeable = False
    where = np.array([(at, *shape) for at, shape in zip(offsets, shapes, strict=False)], np.int64)
    return buffer, where
