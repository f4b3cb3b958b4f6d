"""Weights of the CPU backend: the raw GGUF rows, and the tiles its kernels read (repacked
on first use, or for all layers of a model into one buffer)."""

from __future__ import annotations

from collections import defaultdict

import numba
import numpy as np

from fastrun.backends.base import Weight
from fastrun.backends.cpu import float_tiles, matmul, tile_cache, tiles
from fastrun.formats.errors import FastrunError
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
        if qtype in ("F32", "F16", "BF16"):  # float weights: float32 tiles of 32 rows
            self.float_tiles = float_tiles.to_float_tiles(raw, qtype, n_out, n_in)
        elif qtype in matmul.FORMATS:
            self.kernel = matmul.FORMATS.index(qtype)
            self.formats = matmul.format_set([qtype])  # what its own products compile for
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

    def spot_tiles(self) -> list[int]:
        """The tiles a cached repack is checked by: the first and the last."""
        return sorted({0, (self.raw.shape[0] - 1) // tiles.TILE_ROWS})

    def adopt_kernel_bytes(self, packed: np.ndarray) -> None:
        """Use tiles repacked before (read-only uint8 of kernel_shape, from the tile cache,
        its spot tiles checked)."""
        self._kernel_bytes = packed


def root_array(raw: np.ndarray) -> np.ndarray:
    """The array that raw is a view of, at the root (for weights: the whole memory map)."""
    while isinstance(raw.base, np.ndarray):
        raw = raw.base
    return raw


def kernel_bytes_in_one_buffer(weights, source: str | None = None):
    """Every weight's kernel bytes placed in one read-only buffer, for a compiled call that
    takes them as one array: (buffer, where int64 [len, 3]: offset, units, bytes per unit).
    Each weight then multiplies from its view of the buffer (no second copy). With source
    (the path of the model file the weights are views of), the buffer comes from the tile
    cache when it holds these weights' tiles, else is repacked and stored there."""
    shapes = [w.kernel_shape for w in weights]
    sizes = [rows * cols for rows, cols in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    where = np.array([(at, *shape) for at, shape in zip(offsets, shapes, strict=False)], np.int64)
    views = [(w, int(at), rows * cols, (rows, cols)) for w, (rows, cols), at in zip(
        weights, shapes, offsets, strict=False)]  # fmt: skip
    header = None
    if source is not None:
        header = tile_cache.expected_header(source, _origins(weights), int(offsets[-1]))
        cached = tile_cache.load(header)
        if cached is not None and _adopt_all(cached, views):
            return cached, where
    buffer = np.empty(int(offsets[-1]), np.uint8)
    for w, at, n, shape in views:
        w.place_kernel_bytes(buffer[at : at + n].reshape(shape))
    buffer.flags.writeable = False
    if header is not None:
        tile_cache.save(header, buffer)
    return buffer, where


def _adopt_all(cached: np.ndarray, views) -> bool:
    """Each weight adopts its view of the cached tiles if its spot tiles are what repacking
    gives now. The spot tiles of all weights of one format and width are repacked in one
    call (a call per tile was most of a warm load), on one thread: too small for a parallel
    loop to pay (on a busy machine each would wait for a descheduled thread)."""
    groups = defaultdict(list)  # (type, n_in) -> (weight, its cached tiles)
    for w, at, n, shape in views:
        groups[w.qtype, w.n_in].append((w, cached[at : at + n].reshape(shape)))
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        for (qtype, _), members in groups.items():
            rows, expected = [], []
            for w, packed in members:
                for tile in w.spot_tiles():
                    rows.append(_tile_rows(w.raw, tile))
                    expected.append(packed[tile])
            if not np.array_equal(tiles.repack(np.concatenate(rows), qtype), np.stack(expected)):
                return False
    finally:
        numba.set_num_threads(threads)
    for members in groups.values():
        for w, packed in members:
            w.adopt_kernel_bytes(packed)
    return True


def _tile_rows(raw: np.ndarray, tile: int) -> np.ndarray:
    """The raw rows of one tile, zero rows past the last (as repack pads a weight)."""
    rows = raw[tile * tiles.TILE_ROWS : (tile + 1) * tiles.TILE_ROWS]
    if rows.shape[0] == tiles.TILE_ROWS:
        return rows
    padding = np.zeros((tiles.TILE_ROWS - rows.shape[0], rows.shape[1]), np.uint8)
    return np.concatenate([rows, padding])


def _origins(weights) -> list[tuple[int, str, int, int]]:
    """Each weight's (byte offset in its file, type, n_out, n_in): what its tiles come from."""
    out = []
    for w in weights:
        start = root_array(w.raw).__array_interface__["data"][0]
        out.append((w.raw.__array_interface__["data"][0] - start, w.qtype, w.n_out, w.n_in))
    return out
