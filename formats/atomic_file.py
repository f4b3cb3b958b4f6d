"""An output file that appears whole or not at all.

Bytes go to a hidden temporary file beside the target; on a clean exit it is flushed and
renamed over the target, and on any failure (an exception, Ctrl-C, a full disk) it is
removed. A write error becomes one FastrunError line.
"""

from __future__ import annotations

import os
import tempfile

from fastrun.formats.errors import FastrunError


class AtomicFile:
    """Use as a context manager around `write` calls."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fh = None
        self._tmp = None

    def __enter__(self) -> AtomicFile:
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            fd, self._tmp = tempfile.mkstemp(
                dir=folder, prefix=f".{os.path.basename(self.path)}.", suffix=".partial"
            )
        except OSError as e:
            raise FastrunError(f"cannot write {self.path}: {e.strerror}") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        self._fh = os.fdopen(fd, "wb", buffering=1 << 20)
        return self

    def write(self, data) -> None:
        try:
            self._fh.write(data)
        except OSError as e:
            raise FastrunError(f"cannot write {self.path}: {e.strerror}") from None

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.discard()
            return
        try:
            # No fsync: the rename is what makes an interrupted *process* leave no half-written
            # output, and the kernel's page cache holds the whole file once write() returns.
            # Only a power cut right after the rename could expose an incomplete file, the
            # risk llama-quantize takes too; syncing a 250 MB output costs a third of a second.
            self._fh.flush()
            self._fh.close()
            self._fh = None
            os.replace(self._tmp, self.path)
        except OSError as e:
            self.discard()
            raise FastrunError(f"cannot write {self.path}: {e.strerror}") from None

    def discard(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass  # a full disk can fail the final flush too; the file goes anyway
            self._fh = None
        if self._tmp is not None and os.path.exists(self._tmp):
            os.unlink(self._tmp)
