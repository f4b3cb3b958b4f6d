"""GGUF reader over a read-only memory map.

The file is untrusted input: every length, count and offset is checked against the bytes
that are really there before anything is allocated or sliced, and every problem becomes a
GGUFError that names it.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fastrun.formats import keys, schema
from fastrun.formats.errors import GGUFError, shown
from fastrun.quant.formats import BlockFormat, block_format

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_STRING = 1 << 30  # a single metadata string longer than 1 GiB is not a real file
MAX_KEY = 65535  # the GGUF specification's limit on a metadata key
MAX_TENSOR_NAME = 256  # ggml's limit is 64
MAX_NESTING = 16  # arrays of arrays: real files nest one deep; the parser recurses per level

# Metadata value types: id -> (struct code, numpy dtype); 8 = string and 9 = array are special.
SCALAR_TYPES = {
    0: ("B", np.uint8),
    1: ("b", np.int8),
    2: ("H", np.uint16),
    3: ("h", np.int16),
    4: ("I", np.uint32),
    5: ("i", np.int32),
    6: ("f", np.float32),
    7: ("?", np.bool_),
    10: ("Q", np.uint64),
    11: ("q", np.int64),
    12: ("d", np.float64),
}
STRING_TYPE, ARRAY_TYPE = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. `shape` is GGUF order: fastest-varying dimension first."""

    name: str
    format: BlockFormat
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(rows, row length): GGUF [n_in, n_out, ...] is a row-major [n_out * ..., n_in] matrix."""
        return self.n_elements // self.shape[0], self.shape[0]


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"truncated file: {what} at byte {self.pos} runs past the end ({self.size})"
            )

    def scalar(self, code: str, what: str):
        n = struct.calcsize("<" + code)
        self.need(n, what)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        if n > MAX_STRING:
            raise GGUFError(f"{what}: absurd string length {n}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")


_U64 = struct.Struct("<Q")


def _walk_strings(cur: _Cursor, n: int, key: str, decode: bool) -> list[str] | None:
    """Steps over a string array, checking every length against the file; with `decode`, the
    strings too. The hot loop of opening a file with a large vocabulary."""
    buf, pos, size, unpack = cur.buf, cur.pos, cur.size, _U64.unpack_from
    out = [""] * n if decode else None
    for k in range(n):
        if pos + 8 > size:
            raise GGUFError(f"truncated file: array {key} at byte {pos} runs past the end")
        end = pos + 8 + unpack(buf, pos)[0]
        if end > size:
            raise GGUFError(f"truncated file: array {key} at byte {pos} runs past the end")
        if decode:
            out[k] = buf[pos + 8 : end].decode("utf-8", "replace")
        pos = end
    cur.pos = pos
    return out


class _Metadata(Mapping):
    """The metadata pairs in file order. A top-level string array (a vocabulary's 49k-150k
    tokens, its merges) is checked at open but decoded on its first read: a quantize run copies
    it raw and never reads it, and decoding is most of what opening such a file costs."""

    def __init__(self, gguf: GGUFFile):
        self._gguf = gguf
        self._values: dict[str, object] = {}
        self._undecoded: dict[str, tuple[int, int, str]] = {}  # key -> (position, count, label)

    def __getitem__(self, key: str):
        if key in self._undecoded:
            pos, n, label = self._undecoded[key]
            mm = self._gguf.raw_bytes
            if mm is None:
                raise GGUFError(f"{os.path.basename(self._gguf.path)} is closed")
            cur = _Cursor(mm, self._gguf.size)
            cur.pos = pos
            self._values[key] = _walk_strings(cur, n, label, decode=True)
            del self._undecoded[key]
        return self._values[key]

    def __contains__(self, key) -> bool:
        return key in self._values

    def length(self, key: str) -> int | None:
        """The number of items of an array value (None: no such key), without decoding it."""
        if key in self._undecoded:
            return self._undecoded[key][1]
        value = self._values.get(key)
        return None if value is None else len(value)

    def decoded(self, key: str):
        """The value without decoding it: None for a string array not read yet."""
        return None if key in self._undecoded else self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class GGUFFile:
    """A GGUF file opened read-only: metadata, tensor table and zero-copy tensor views.

    Use as a context manager, or call close(). Views returned by `tensor_bytes` stay valid
    while the file is open.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise GGUFError(f"no such file: {self.path}") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path} is a directory, not a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"cannot open {self.path}: {e.strerror}") from None
        self.size = os.fstat(self._fh.fileno()).st_size
        if self.size < 24:
            self._fh.close()
            raise GGUFError(f"{self.path} is not a GGUF file (only {self.size} bytes)")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._mm, dtype=np.uint8)
        try:
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{os.path.basename(self.path)}: {e}") from None
        except (struct.error, ValueError, OverflowError, MemoryError) as e:
            self.close()
            raise GGUFError(f"{os.path.basename(self.path)}: malformed GGUF ({e})") from None

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._mm, self.size)
        if self._mm[:4] != GGUF_MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        cur.pos = 4
        self.version = cur.scalar("I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"unsupported GGUF version {self.version}")
        n_tensors = cur.scalar("Q", "tensor count")
        n_kv = cur.scalar("Q", "metadata count")
        # Each metadata pair takes at least 12 bytes and each tensor info at least 28.
        if n_kv * 12 > self.size or n_tensors * 28 > self.size:
            raise GGUFError(f"absurd counts: {n_tensors} tensors, {n_kv} metadata pairs")

        self.metadata = _Metadata(self)
        # key -> (value type, item type of an array or None, byte span of the value): what a
        # writer needs to copy a value exactly
        self.metadata_types: dict[str, tuple[int, int | None, tuple[int, int]]] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            if len(key) > MAX_KEY:
                raise GGUFError(f"a metadata key of {len(key)} characters")
            label = shown(key)  # how error lines name it
            vtype = cur.scalar("I", f"type of {label}")
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {label}")
            item_type = None
            if vtype == ARRAY_TYPE:
                cur.need(4, f"item type of {label}")
                (item_type,) = struct.unpack_from("<I", self._mm, cur.pos)
            start = cur.pos
            if vtype == ARRAY_TYPE and item_type == STRING_TYPE:
                self.metadata._undecoded[key] = (start + 12, self._string_count(cur, label), label)
                self.metadata._values[key] = None  # a placeholder, keeping the file order
            else:
                self.metadata._values[key] = self._value(cur, vtype, label)
            self.metadata_types[key] = (vtype, item_type, (start, cur.pos))

        alignment = self.metadata.get(keys.ALIGNMENT, DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"bad alignment {alignment!r}")

        infos = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            if len(name) > MAX_TENSOR_NAME:
                raise GGUFError(f"a tensor name of {len(name)} characters")
            label = shown(name)
            n_dims = cur.scalar("I", f"dimension count of {label}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {label}: {n_dims} dimensions")
            shape = tuple(cur.scalar("Q", f"shape of {label}") for _ in range(n_dims))
            type_id = cur.scalar("I", f"type of {label}")
            offset = cur.scalar("Q", f"offset of {label}")
            infos.append((name, shape, type_id, offset))

        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in infos:
            label = shown(name)
            if name in self.tensors:
                raise GGUFError(f"duplicate tensor {label}")
            if any(d <= 0 or d > 1 << 40 for d in shape):
                raise GGUFError(f"tensor {label}: bad shape {list(shape)}")
            try:
                fmt = block_format(type_id)
            except GGUFError:
                raise GGUFError(f"tensor {label}: unknown tensor type {type_id}") from None
            n_elements = 1
            for d in shape:
                n_elements *= d
            if shape[0] % fmt.block_size:
                raise GGUFError(
                    f"tensor {label}: row of {shape[0]} is not a whole number of "
                    f"{fmt.name} blocks ({fmt.block_size})"
                )
            n_bytes = n_elements // fmt.block_size * fmt.block_bytes
            if offset % alignment:
                raise GGUFError(f"tensor {label}: offset {offset} is not aligned to {alignment}")
            start = data_start + offset
            if start + n_bytes > self.size:
                raise GGUFError(
                    f"tensor {label}: data ({n_bytes} bytes at {start}) runs past the end of the "
                    f"file ({self.size} bytes); the file is truncated"
                )
            self.tensors[name] = TensorInfo(name, fmt, shape, start, n_bytes)

    def _string_count(self, cur: _Cursor, key: str) -> int:
        """Steps over a string array's header and strings, checked but not decoded; its length."""
        cur.scalar("I", f"item type of {key}")
        n = cur.scalar("Q", f"length of {key}")
        cur.need(n * 8, f"array {key} of {n} strings")  # each string has an 8-byte length
        _walk_strings(cur, n, key, decode=False)
        return n

    def _value(self, cur: _Cursor, vtype: int, key: str, depth: int = 0):
        if vtype in SCALAR_TYPES:
            return cur.scalar(SCALAR_TYPES[vtype][0], key)
        if vtype == STRING_TYPE:
            return cur.string(key)
        if vtype != ARRAY_TYPE:
            raise GGUFError(f"metadata {key}: unknown value type {vtype}")
        itype = cur.scalar("I", f"item type of {key}")
        n = cur.scalar("Q", f"length of {key}")
        if itype in SCALAR_TYPES:
            dtype = np.dtype(SCALAR_TYPES[itype][1]).newbyteorder("<")
            cur.need(n * dtype.itemsize, f"array {key} of {n} items")
            arr = self._data[cur.pos : cur.pos + n * dtype.itemsize].view(dtype)
            cur.pos += n * dtype.itemsize
            return arr
        if itype == STRING_TYPE:
            cur.need(n * 8, f"array {key} of {n} strings")  # each string has an 8-byte length
            return _walk_strings(cur, n, key, decode=True)
        if itype == ARRAY_TYPE:
            if depth >= MAX_NESTING:
                raise GGUFError(f"metadata {key}: arrays nested more than {MAX_NESTING} deep")
            cur.need(n * 12, f"array {key} of {n} arrays")
            return [self._value(cur, ARRAY_TYPE, key, depth + 1) for _ in range(n)]
        raise GGUFError(f"metadata {key}: unknown array item type {itype}")

    # -- access ----------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.metadata.get(keys.ARCHITECTURE)
        if arch is None:
            raise GGUFError(f"{os.path.basename(self.path)}: no general.architecture")
        try:
            return schema.check(keys.ARCHITECTURE, arch)
        except GGUFError as e:
            raise GGUFError(f"{os.path.basename(self.path)}: {e}") from None

    def get(self, key: str, default=None):
        """Metadata value, checked against formats/schema.py's table (GGUFError naming the key
        when it is of the wrong kind or range); "{arch}" in the key is replaced by
        general.architecture."""
        name = key.format(arch=self.architecture) if "{arch}" in key else key
        value = self.metadata.get(name)
        if value is None:
            return default
        try:
            return schema.check(key, value, name)
        except GGUFError as e:
            raise GGUFError(f"{os.path.basename(self.path)}: {e}") from None

    def count(self, key: str) -> int:
        """len(get(key) or []), checked as get checks it, without decoding a string array not
        read yet (a vocabulary's size at load, where the tokenizer had it from its cache):
        its items are strings by its item type, so the checks come down to its length."""
        if key not in self.metadata or self.metadata.decoded(key) is not None:
            return len(self.get(key) or [])
        n = self.metadata.length(key)
        try:
            schema.check(key, [""] * n, key)  # n strings, as far as the checks can tell
        except GGUFError as e:
            raise GGUFError(f"{os.path.basename(self.path)}: {e}") from None
        return n

    def require(self, key: str):
        """Metadata value that must be present."""
        value = self.get(key)
        if value is None:
            name = key.format(arch=self.get(keys.ARCHITECTURE))
            raise GGUFError(f"{os.path.basename(self.path)}: missing metadata {shown(name)}")
        return value

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{os.path.basename(self.path)}: missing tensor {name}")
        return info

    @property
    def raw_bytes(self) -> mmap.mmap:
        """The whole file, read-only; a slice of it is bytes."""
        return self._mm

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy read-only uint8 view [rows, row_bytes] of a tensor's data."""
        info = self.tensor(name)
        rows, n = info.matrix_shape
        return self._data[info.offset : info.offset + info.n_bytes].reshape(rows, -1)

    def close(self) -> None:
        self._data = None
        if getattr(self, "_mm", None) is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # numpy views still alive: the map closes when they are collected
            self._mm = None
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
