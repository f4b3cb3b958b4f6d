"""A model's vocabulary and merges decoded once, kept beside the tile cache.

Decoding a vocabulary's ~50k-150k token strings and as many merges from the GGUF file, and
splitting the merges into pairs, is most of what building a tokenizer costs at every start
(tens of ms). A cache file holds them as `marshal` data, which Python reads back several
times faster. Its name is a digest of what it was made from: the raw bytes of the two
metadata values, the code that decodes and splits them, and the Python version (marshal's
format is Python's own). A file whose name matches therefore holds exactly what decoding
gives now; its content is also checked against the digest it records and the counts the
file declares, and anything else is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import marshal
import sys
from pathlib import Path

from fastrun.formats import keys
from fastrun.formats.atomic_file import AtomicFile
from fastrun.formats.cache_folder import cache_folder
from fastrun.formats.errors import FastrunError

_HERE = Path(__file__).resolve().parent
# the code whose output the cached values are: a change to any of them changes every name
_SOURCES = (_HERE / "vocab_cache.py", _HERE / "tokenizer.py", _HERE.parent / "formats" / "gguf.py")
_FORMAT = "fastrun-vocab-1"


def split_merges(merges: list[str]) -> list[tuple[str, ...]]:
    """GGUF's "a b" merge strings as the pairs the BPE model takes."""
    return [tuple(m.split(" ", 1)) for m in merges]


def _digest(gguf) -> str:
    h = hashlib.sha256(f"{_FORMAT} {sys.version_info[:3]} {marshal.version}".encode())
    for source in _SOURCES:
        h.update(source.read_bytes())
    raw = memoryview(gguf.raw_bytes)
    for key in (keys.TOKENS, keys.MERGES):
        kind = gguf.metadata_types.get(key)
        start, end = kind[2] if kind is not None else (0, 0)
        h.update(f"{key} {start} {end}".encode())
        h.update(raw[start:end])
    return h.hexdigest()


def _path(digest: str) -> Path | None:
    folder = cache_folder()
    return None if folder is None else folder / f"{digest[:40]}.vocab"


def load(gguf) -> tuple[str, list[str] | None, list[tuple[str, ...]] | None]:
    """(digest, tokens, merge pairs) of an open GGUFFile: the lists from the cache file of
    this digest, or None each where there is none (pass the digest to save)."""
    digest = _digest(gguf)
    path = _path(digest)
    if path is None:
        return digest, None, None
    try:
        data = marshal.loads(path.read_bytes())
    except (OSError, EOFError, ValueError, TypeError):
        return digest, None, None
    n_tokens, n_merges = (gguf.metadata.length(k) for k in (keys.TOKENS, keys.MERGES))
    if not (
        isinstance(data, tuple)
        and len(data) == 4
        and data[:2] == (_FORMAT, digest)
        and isinstance(data[2], list)
        and len(data[2]) == n_tokens
        and (data[3] is None if n_merges is None else len(data[3]) == 2 * n_merges)
    ):
        return digest, None, None
    tokens, flat = data[2], data[3]
    if flat is None:
        return digest, tokens, None
    halves = iter(flat)
    return digest, tokens, list(zip(halves, halves, strict=True))


def save(digest: str, tokens: list[str], pairs: list[tuple[str, ...]] | None) -> None:
    """Write the cache file of digest (whole or not at all); a read-only or full disk only
    costs the next start its decoding. Pairs that are not pairs (a malformed merge, which
    the tokenizer reports) are not cached."""
    path = _path(digest)
    if path is None or (pairs is not None and any(len(p) != 2 for p in pairs)):
        return
    flat = None if pairs is None else [s for pair in pairs for s in pair]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with AtomicFile(path) as out:
            out.write(marshal.dumps((_FORMAT, digest, tokens, flat)))
    except (OSError, FastrunError):
        pass
