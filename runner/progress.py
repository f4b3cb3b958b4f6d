"""Rich progress bars on stderr, so stdout stays clean for scripts.

rich is imported only where a bar is drawn (it costs about a tenth of a second, a tenth of a
small model's whole `fastrun quantize`): a WorkProgress on a stderr that is not a terminal (a
pipe, a log file) draws nothing, as a bar there would be one line of its final state.
"""

from __future__ import annotations

import sys
from functools import cache


@cache
def _console():
    from rich.console import Console

    return Console(stderr=True)


class _StderrConsole:
    """rich's stderr Console, made on first use."""

    def __getattr__(self, name):
        return getattr(_console(), name)


stderr_console = _StderrConsole()


class DownloadProgress:
    """One bar per downloaded piece; the interface registry.pull_model expects."""

    def __init__(self, console=None):
        self._console = console
        self._progress = None  # made at the first bar: rich is not imported otherwise
        self._task = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()

    def start(self, description: str, total: int | None) -> None:
        if self._progress is None:  # draw nothing at all when nothing is downloaded
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self._console or _console(),
                transient=False,
            )
            self._progress.start()
        self._task = self._progress.add_task(description, total=total)

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)

    def done(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[self._task]
            self._progress.update(self._task, total=task.completed)


class WorkProgress:
    """One bar over a known amount of work (weights, chunks) with the current item's name;
    none (and no rich) when no console is given and stderr is not a terminal."""

    def __init__(self, console=None):
        self._progress = None
        self._task = None
        if console is None and not sys.stderr.isatty():
            return
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description:<30.30}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or _console(),
            transient=False,
        )

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()

    def start(self, total: int) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task("", total=total)

    def advance(self, n: int, name: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n, description=name)
