"""The tensors of a Hugging Face model folder: its *.safetensors files, memory-mapped.

The `safetensors` library opens and validates each file: the header is untrusted JSON, and its
Rust parser checks every dtype and shape and that the data offsets tile the data section
exactly, without gap or overlap. It then lists the tensors in data order. It cannot hand NumPy
a bfloat16 tensor, so the bytes come from a read-only memory map of the same file: with the
offsets validated as contiguous, each tensor starts where the one before it ends.

Which files make up the model follows convert_hf_to_gguf.py: the parts named by
model.safetensors.index.json, else every model*.safetensors, sorted; within a part, tensors
are visited by name.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from fastrun.formats.errors import FastrunError, shown

INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of each safetensors dtype; only the float ones can be converted, the
# others are here so that the data offsets of the tensors after them can be followed.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a part: `shape` in PyTorch order (slowest-varying dimension first)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    part: int  # index into SafetensorsFolder.parts
    offset: int  # absolute byte offset in the part
    n_bytes: int


class SafetensorsFolder:
    """All tensors of a folder's safetensors parts; use as a context manager or close()."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.parts = _part_names(self.folder)
        self._maps: list[mmap.mmap] = []
        self._views: list[np.ndarray] = []
        self.tensors: dict[str, StoredTensor] = {}
        try:
            for i, part in enumerate(self.parts):
                self._open_part(i, part)
        except BaseException:
            self.close()
            raise
        self._check_index()

    def _open_part(self, i: int, part: str) -> None:
        from safetensors import safe_open

        path = os.path.join(self.folder, part)
        try:
            with safe_open(path, framework="numpy") as f:
                names = f.offset_keys()
                slices = {name: f.get_slice(name) for name in names}
                layout = [(n, s.get_dtype(), tuple(s.get_shape())) for n, s in slices.items()]
        except OSError as e:
            raise FastrunError(f"cannot read {path}: {e.strerror or e}") from None
        except Exception as e:  # the library's SafetensorError: a malformed header or size
            raise FastrunError(f"{part} is not a valid safetensors file: {e}") from None
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            (header_len,) = struct.unpack("<Q", fh.read(8))
            # a zero-length map is an error, and a header-only file has no tensors to read
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        offset = 8 + header_len
        for name, dtype, shape in layout:
            if dtype not in DTYPE_BYTES:
                raise FastrunError(f"{part}: tensor {shown(name)} has unsupported dtype {dtype}")
            n_bytes = DTYPE_BYTES[dtype] * int(np.prod(shape, dtype=np.int64))
            if name in self.tensors:
                raise FastrunError(f"{part}: tensor {shown(name)} is also in another part")
            self.tensors[name] = StoredTensor(name, dtype, shape, i, offset, n_bytes)
            offset += n_bytes
        if offset != size:  # the library checks this too; the offsets here depend on it
            raise FastrunError(f"{part}: tensor data ends at byte {offset}, the file at {size}")
        self._maps.append(mapped)
        self._views.append(np.frombuffer(mapped, np.uint8) if mapped is not None else None)
        # within a part, convert_hf_to_gguf.py visits tensors by name
        for name in sorted(n for n, t in self.tensors.items() if t.part == i):
            self.tensors[name] = self.tensors.pop(name)

    def _check_index(self) -> None:
        index = _read_index(self.folder)
        if index is None:
            return
        missing = sorted(set(index) - set(self.tensors))
        if missing:
            raise FastrunError(
                f"{INDEX_FILE} lists {len(missing)} tensors that no part holds "
                f"(first: {shown(missing[0])}); is a part missing or incomplete?"
            )

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, zero-copy and read-only."""
        t = self.tensors[name]
        return self._views[t.part][t.offset : t.offset + t.n_bytes]

    def close(self) -> None:
        self._views = []
        for m in self._maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass  # views still alive: the map closes when they are collected
        self._maps = []

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_index(folder: str) -> dict[str, str] | None:
    """The index's weight map (tensor name -> part file), checked; None without an index."""
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise FastrunError(f"{INDEX_FILE} is not a valid index: {e}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FastrunError(f"{INDEX_FILE}: weight_map is not a map of tensor names to files")
    for part in set(weight_map.values()):
        if os.path.basename(part) != part or not part.endswith(".safetensors"):
            raise FastrunError(f"{INDEX_FILE} names {shown(part)}, not a file of the folder")
    return weight_map


def _part_names(folder: str) -> list[str]:
    index = _read_index(folder)
    if index is not None:
        parts = sorted(set(index.values()))
    else:
        parts = sorted(
            n for n in os.listdir(folder) if n.startswith("model") and n.endswith(".safetensors")
        )
    if not parts:
        raise FastrunError(f"{folder} has no model*.safetensors files")
    for part in parts:
        if not os.path.isfile(os.path.join(folder, part)):
            raise FastrunError(f"{folder}: {part} is missing")
    return parts
