"""The typer application every command module registers on, and what they share: exit codes,
resolving a model name with a progress bar, rendering rich tables to text. The console entry
(cli.py) imports the command modules; none of them imports cli.py."""

from __future__ import annotations

import gc
from typing import Annotated

import typer

import fastrun
from fastrun.runner.progress import DownloadProgress

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="fastrun",
    help="Run GGUF language models fast, on the CPU or an NVIDIA GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        print(f"fastrun {fastrun.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Run GGUF language models fast, on the CPU or an NVIDIA GPU."""


_gc_off_for_start_up = False


def start_up_without_gc() -> None:
    """Turn the garbage collector off for a console command's start-up: importing Numba and
    loading a model make about a million objects that live to the end, and the collections
    their allocations trigger would traverse them again and again (tens of ms).
    start_up_done turns it back on."""
    global _gc_off_for_start_up
    if gc.isenabled():
        gc.disable()
        _gc_off_for_start_up = True


def start_up_done() -> None:
    """After a model loaded: if start_up_without_gc turned the collector off, freeze what
    the start-up made (gc.freeze: later collections skip it) and turn it back on."""
    global _gc_off_for_start_up
    if _gc_off_for_start_up:
        _gc_off_for_start_up = False
        gc.freeze()
        gc.enable()


def resolve(model: str):
    """A path or registry name to a file path, pulling a registry model with a progress bar."""
    from fastrun.runner.registry import resolve_model

    with DownloadProgress() as progress:
        return resolve_model(model, progress=progress)


def render(renderable) -> str:
    """A rich renderable (a table) as plain text, 120 columns wide."""
    import io

    from rich.console import Console

    console = Console(width=120, file=io.StringIO())
    console.print(renderable)
    return console.file.getvalue().rstrip()
