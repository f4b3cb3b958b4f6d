"""Numba's on-disk cache: kernels that inline code from other files are dropped when those
files change (Numba keys a module's kernels on that module's source alone), and fastrun's
kernels load from it without Numba's registry refresh."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
from pathlib import Path

from numba.core import caching
from numba.core.runtime import rtsys

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


def in_cache(dispatcher) -> bool:
    """Whether Numba's cache holds compiled code of this kernel (its index file exists; for
    some signature: where a start needs one it lacks, it compiles that as ever); True where
    the cache cannot be written either, as nothing will come to be in it."""
    try:
        index = dispatcher._cache._cache_file._index_path
        return os.path.exists(index) or not os.access(os.path.dirname(index) or ".", os.W_OK)
    except (AttributeError, OSError):
        return True


@contextlib.contextmanager
def _ctrl_c_after():
    """A Ctrl-C during a kernel load (tens of ms) raised when it is done: raised inside it,
    it lands in one of LLVM's callbacks, which prints it, swallows it and loads on (the
    main thread only; where another SIGINT handler is set, that one stays)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pending = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt


def _load_without_refresh(load_overload):
    """Cache.load_overload for fastrun's kernels: without the refresh of the target context,
    which imports and installs every typing and lowering registry of Numba (0.1-0.25 s of
    each start, the largest part of a warm run's first dispatch) though rebuilding cached
    machine code uses none of them: it needs only the runtime (NRT) the code calls. A
    compile still refreshes first (Numba's compiler does so itself); other packages'
    functions load as Numba loads them."""

    def load(self, sig, target_context):
        if not getattr(self._py_func, "__module__", "").startswith("fastrun."):
            return load_overload(self, sig, target_context)
        with _ctrl_c_after():
            rtsys.initialize(target_context)
            with self._guard_against_spurious_io_errors():
                return self._load_overload(sig, target_context)

    load.without_refresh = True
    return load


# Numba's private hooks; on a version without them, kernels load the ordinary way
if all(hasattr(caching.Cache, a) for a in ("_guard_against_spurious_io_errors", "_load_overload")):
    if not getattr(caching.Cache.load_overload, "without_refresh", False):
        caching.Cache.load_overload = _load_without_refresh(caching.Cache.load_overload)
