"""Repacked tiles kept on disk, so that a model's later loads map them instead of repacking.

Repacking a model's layers into tiles (tiles.py) costs about a second of CPU per 500 MB of
weights, at every start, and the tiles are a second resident copy beside the file's pages.
A cache file holds the tiles of one model file, written once (atomically) and memory-mapped
read-only on later loads: no CPU time, and pages the kernel may drop and read back.

One file per model path, under $FASTRUN_TILE_CACHE (default $XDG_CACHE_HOME/fastrun/tiles;
"off" disables it): magic, a JSON header, padding to 64 bytes, the tiles. The header says
what the tiles were made from: the model file (path, size, mtime), the sources of the tile
layout (a digest of the code that repacks), and each weight (offset in the file, type,
shape). A file whose header is not exactly the one expected, or whose size does not fit it,
is ignored and rewritten; the bytes it holds are trusted no further than that, and the
caller compares a tile of each weight with a fresh repack before using them.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np

from fastrun.backends.cpu.tiles import WIDE_LANES
from fastrun.formats.atomic_file import AtomicFile
from fastrun.formats.cache_folder import cache_folder
from fastrun.formats.errors import FastrunError

MAGIC = b"FRTILES1"
HEADER_LIMIT = 1 << 22  # a model of thousands of weights has a header of a few hundred KB
ALIGN = 64

_HERE = Path(__file__).resolve().parent
# the code whose output the cached bytes are: a change to any of them invalidates the cache
LAYOUT_SOURCES = (
    _HERE / "tiles.py",
    _HERE.parent.parent / "quant" / "reference.py",
    _HERE.parent.parent / "quant" / "fast.py",
)


def layout_digest() -> str:
    digest = hashlib.sha256()
    for source in LAYOUT_SOURCES:
        digest.update(source.read_bytes())
    # the same code lays the lane formats out two ways, by the host's vector width
    digest.update(b"wide lanes" if WIDE_LANES else b"narrow lanes")
    return digest.hexdigest()


def expected_header(model_path: str, weights: list[tuple[int, str, int, int]], total: int):
    """The header a cache file of these weights must have. weights: (byte offset of its raw
    rows in the model file, type name, n_out, n_in) each, in buffer order."""
    real = os.path.realpath(model_path)
    st = os.stat(real)
    return {
        "model": real,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "layout": layout_digest(),
        "weights": [list(w) for w in weights],
        "bytes": total,
    }


def path_for(header: dict) -> Path | None:
    where = cache_folder()
    if where is None:
        return None
    name = hashlib.sha256(header["model"].encode()).hexdigest()[:32]
    return where / f"{name}.tiles"


def _data_offset(header_bytes: int) -> int:
    return -(-(len(MAGIC) + 8 + header_bytes) // ALIGN) * ALIGN


def load(header: dict) -> np.ndarray | None:
    """The cached tiles (read-only uint8 [header['bytes']], a view of the mapped file) when a
    file with exactly this header and the size it implies exists; else None."""
    path = path_for(header)
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            if fh.read(len(MAGIC)) != MAGIC:
                return None
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= HEADER_LIMIT:
                return None
            found = json.loads(fh.read(n).decode("utf-8"))
            at = _data_offset(n)
            if found != header or os.fstat(fh.fileno()).st_size != at + header["bytes"]:
                return None
            if header["bytes"] == 0:
                return np.zeros(0, np.uint8)
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # json.JSONDecodeError is a ValueError
    return np.frombuffer(mapped, np.uint8, count=header["bytes"], offset=at)


def save(header: dict, tiles: np.ndarray) -> None:
    """Write the cache file (whole or not at all); a read-only or full disk only costs the
    next load its repacking."""
    path = path_for(header)
    if path is None:
        return
    encoded = json.dumps(header).encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with AtomicFile(path) as out:
            out.write(MAGIC)
            out.write(len(encoded).to_bytes(8, "little"))
            out.write(encoded)
            out.write(bytes(_data_offset(len(encoded)) - len(MAGIC) - 8 - len(encoded)))
            out.write(memoryview(tiles))
    except (OSError, FastrunError):
        pass
