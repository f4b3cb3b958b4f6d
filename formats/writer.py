"""GGUF writer: header, metadata and tensor table first, then tensor data streamed in order.

The caller declares every tensor (name, shape, type) up front, so all offsets are known before
the first byte of data; data then goes to disk one tensor (or one slab of rows) at a time and a
model never sits in memory twice. Output goes to a hidden temporary file beside the target,
renamed over it only when the last tensor is complete: an interrupted or failed run leaves
nothing behind.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from fastrun.formats import keys
from fastrun.formats.atomic_file import AtomicFile
from fastrun.formats.errors import GGUFError
from fastrun.formats.gguf import (
    ARRAY_TYPE,
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    SCALAR_TYPES,
    STRING_TYPE,
    GGUFFile,
)
from fastrun.quant.formats import BlockFormat

GGUF_VERSION = 3
UINT32 = 4
INT32 = 5
FLOAT32 = 6
BOOL = 7
STRING = STRING_TYPE
ARRAY = ARRAY_TYPE


@dataclass(frozen=True)
class MetadataValue:
    """A typed metadata value: GGUF value type, the value, and the item type of an array.

    `raw`, when set, is the value's encoding as read from a file: copied as is, so a value
    the reader decoded lossily (invalid UTF-8, nested arrays) survives a copy unchanged; then
    `value` may be None (metadata_of)."""

    type: int
    value: object
    item_type: int | None = None
    raw: bytes | None = None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: `shape` in GGUF order (fastest-varying dimension first)."""

    name: str
    shape: tuple[int, ...]
    format: BlockFormat

    @property
    def n_bytes(self) -> int:
        rows = 1
        for d in self.shape[1:]:
            rows *= d
        return rows * self.format.row_bytes(self.shape[0])


def array_value(item_type: int, items) -> MetadataValue:
    """An array of `item_type` values (an id such as STRING or INT32)."""
    return MetadataValue(ARRAY, list(items), item_type)


def metadata_of(gguf: GGUFFile) -> dict[str, MetadataValue]:
    """A file's metadata with the value types it was stored with, in file order. A string
    array the reader has not decoded (a vocabulary, untouched by a quantize run) has value
    None: it is copied raw, and decoding it is most of what opening the file costs."""
    raw = gguf.raw_bytes
    return {
        key: MetadataValue(vtype, gguf.metadata.decoded(key), item_type, raw[start:end])
        for key, (vtype, item_type, (start, end)) in gguf.metadata_types.items()
    }


_U64 = struct.Struct("<Q")


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def _strings(items) -> bytes:
    """Many strings (a vocabulary): the hot loop of writing a header."""
    pack = _U64.pack
    return b"".join([pack(len(raw)) + raw for raw in [s.encode("utf-8") for s in items]])


def _encode(key: str, v: MetadataValue) -> bytes:
    if v.raw is not None:
        return v.raw
    if v.type in SCALAR_TYPES:
        return struct.pack("<" + SCALAR_TYPES[v.type][0], v.value)
    if v.type == STRING_TYPE:
        return _string(v.value)
    if v.type != ARRAY_TYPE:
        raise GGUFError(f"metadata {key}: unknown value type {v.type}")
    items = v.value
    head = struct.pack("<IQ", v.item_type, len(items))
    if v.item_type in SCALAR_TYPES:
        dtype = np.dtype(SCALAR_TYPES[v.item_type][1]).newbyteorder("<")
        return head + np.asarray(items).astype(dtype, copy=False).tobytes()
    if v.item_type == STRING_TYPE:
        return head + _strings(items)
    raise GGUFError(f"metadata {key}: arrays of type {v.item_type} cannot be written")


def _padding(n: int, alignment: int) -> int:
    return -n % alignment


class GGUFWriter:
    """Write one GGUF file. Use as a context manager; call `write_tensor` for every declared
    tensor in declaration order. The file appears at `path` only on a clean exit."""

    def __init__(
        self,
        path: str | os.PathLike,
        metadata: dict[str, MetadataValue],
        tensors: list[TensorSpec],
    ):
        self.path = os.fspath(path)
        self.metadata = metadata
        self.tensors = tensors
        align = metadata.get(keys.ALIGNMENT)
        self.alignment = int(align.value) if align is not None else DEFAULT_ALIGNMENT
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"bad alignment {self.alignment}")
        if len({t.name for t in tensors}) != len(tensors):
            raise GGUFError("duplicate tensor names")
        self._out: AtomicFile | None = None
        self._next = 0  # index of the tensor being written
        self._written = 0  # bytes of it written so far

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> GGUFWriter:
        self._out = AtomicFile(self.path).__enter__()
        self._out.write(self._header())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._next != len(self.tensors):
            self._out.discard()
            missing = self.tensors[self._next].name
            raise GGUFError(f"{self.path}: tensor {missing} was never written")
        self._out.__exit__(exc_type, exc, tb)

    # -- layout ----------------------------------------------------------------------------

    def _header(self) -> bytes:
        counts = struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.metadata))
        parts = [GGUF_MAGIC, counts]
        for key, value in self.metadata.items():
            parts += [_string(key), struct.pack("<I", value.type), _encode(key, value)]
        offset = 0
        for t in self.tensors:
            parts += [_string(t.name), struct.pack("<I", len(t.shape))]
            parts += [struct.pack(f"<{len(t.shape)}Q", *t.shape)]
            parts += [struct.pack("<IQ", t.format.id, offset)]
            offset += t.n_bytes + _padding(t.n_bytes, self.alignment)
        head = b"".join(parts)
        return head + bytes(_padding(len(head), self.alignment))

    # -- data ------------------------------------------------------------------------------

    def write_tensor(self, name: str, data: np.ndarray) -> None:
        """Append data (any array; its raw bytes) to tensor `name`, which may come in parts
        (slabs of rows); the tensor is complete once its declared size has been written."""
        if self._next >= len(self.tensors):
            raise GGUFError(f"{self.path}: tensor {name} was not declared")
        spec = self.tensors[self._next]
        if name != spec.name:
            raise GGUFError(f"{self.path}: expected tensor {spec.name}, got {name}")
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if self._written + raw.size > spec.n_bytes:
            raise GGUFError(f"{self.path}: tensor {name} is larger than its declared size")
        self._out.write(raw.data)
        self._written += raw.size
        if self._written == spec.n_bytes:
            self._out.write(bytes(_padding(spec.n_bytes, self.alignment)))
            self._next += 1
            self._written = 0
