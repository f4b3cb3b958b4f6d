"""Numba's on-disk cache keys a module's kernels on that module's source alone; kernels that
inline code from other files must be dropped when those files change."""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent


def drop_stale_cache(stem: str, sources: tuple[str, ...]) -> None:
    """Delete the cached kernels of module `stem` when any of `sources` (files beside it)
    changed since they were compiled; a sha256 stamp beside the cache records the sources."""
    digest = hashlib.sha256(b"".join((HERE / f).read_bytes() for f in sources)).hexdigest()
    stamp = HERE / "__pycache__" / f"{stem}.kernels.sha256"
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return
        for old in list(stamp.parent.glob(f"{stem}.*.nbi")) + list(
            stamp.parent.glob(f"{stem}.*.nbc")
        ):
            old.unlink()
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass  # a read-only install: Numba then caches elsewhere, or not at all
