"""Rich progress bars on stderr, so stdout stays clean for scripts."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

stderr_console = Console(stderr=True)


class DownloadProgress:
    """One bar per downloaded piece; the interface registry.pull_model expects."""

    def __init__(self, console: Console = stderr_console):
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = None

        self._started = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._started:
            self._progress.stop()

    def start(self, description: str, total: int | None) -> None:
        if not self._started:  # draw nothing at all when nothing is downloaded
            self._progress.start()
            self._started = True
        self._task = self._progress.add_task(description, total=total)

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)

    def done(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[self._task]
            self._progress.update(self._task, total=task.completed)


class WorkProgress:
    """One bar over a known amount of work (weights, chunks) with the current item's name."""

    def __init__(self, console: Console = stderr_console):
        self._progress = Progress(
            TextColumn("[bold]{task.description:<30.30}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = None

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc):
        self._progress.stop()

    def start(self, total: int) -> None:
        self._task = self._progress.add_task("", total=total)

    def advance(self, n: int, name: str = "") -> None:
        self._progress.update(self._task, advance=n, description=name)
