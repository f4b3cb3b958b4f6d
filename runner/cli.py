"""The `fastrun` console entry and the model-file commands (pull, info): the command modules
register on runner/app.py's app; user mistakes become one `fastrun: error:` line."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import warnings
from collections import Counter
from typing import Annotated

import typer

try:  # typer >= 0.26 vendors click as typer._click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_errors

from fastrun.formats import keys
from fastrun.formats.errors import FastrunError
from fastrun.runner.app import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    app,
    render,
    resolve,
    start_up_without_gc,
)
from fastrun.runner.progress import DownloadProgress

# -- pull / info -------------------------------------------------------------------------------


@app.command()
def pull(
    name: Annotated[str | None, typer.Argument(help="Registry name from models.toml.")] = None,
    list_: Annotated[
        bool, typer.Option("--list", help="Show known models and which are present.")
    ] = False,
) -> None:
    """Download a model from the registry (models.toml), assemble it and check its sha256."""
    from fastrun.runner.registry import is_present, load_registry, model_path, pull_model

    registry = load_registry()
    if list_ or name is None:
        from rich.table import Table

        table = Table("name", "file", "present", "description")
        for entry in registry.values():
            table.add_row(
                entry.name, entry.file, "yes" if is_present(entry) else "no", entry.description
            )
        typer.echo(render(table))
        return
    entry = registry.get(name)
    if entry is None:
        raise FastrunError(f"unknown model {name!r} (known: {', '.join(sorted(registry))})")
    if is_present(entry):
        typer.echo(f"{name}: already present at {model_path(entry)}")
        return
    with DownloadProgress() as progress:
        path = pull_model(entry, progress=progress)
    typer.echo(f"{name}: {path}")


def model_info(path) -> dict:
    """Summary of a GGUF file: what `fastrun info` prints."""
    from fastrun.formats import GGUFFile, schema
    from fastrun.runner.models import ARCHITECTURES

    with GGUFFile(path) as f:
        arch = f.architecture
        schema.check_file(f, arch_keys=arch in ARCHITECTURES)  # all fastrun reads, not only these
        tokens = f.get(keys.TOKENS) or []
        return {
            "file": str(path),
            "name": f.get(keys.NAME),
            "architecture": arch,
            "runs": arch in ARCHITECTURES,  # whether fastrun runs this architecture
            "supported_architectures": sorted(ARCHITECTURES),
            "parameters": sum(t.n_elements for t in f.tensors.values()),
            "context_length": f.get(keys.CONTEXT_LENGTH),
            "embedding_length": f.get(keys.EMBEDDING_LENGTH),
            "layers": f.get(keys.BLOCK_COUNT),
            "tensor_types": dict(Counter(t.format.name for t in f.tensors.values()).most_common()),
            "tokenizer": f.get(keys.TOKENIZER_MODEL),
            "tokenizer_pre": f.get(keys.TOKENIZER_PRE),
            "vocab_size": len(tokens),
            "chat_template": keys.CHAT_TEMPLATE in f.metadata,  # checked when compiled
            "file_size": f.size,
        }


@app.command()
def info(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show a model's architecture, size, tensor types and tokenizer."""
    data = model_info(resolve(model))
    if as_json:
        import json  # here: the other commands never load it

        typer.echo(json.dumps(data))
        return
    from rich.table import Table

    table = Table(show_header=False, box=None)
    for k, v in data.items():
        if k == "parameters":
            v = f"{v:,} ({v / 1e6:.1f} M)"
        elif k == "tensor_types":
            v = ", ".join(f"{t}: {n}" for t, n in v.items())
        elif k == "file_size":
            v = f"{v / 1e6:.1f} MB"
        elif k == "supported_architectures":
            v = ", ".join(v)
        table.add_row(k, str(v))
    typer.echo(render(table))


# -- entry point -------------------------------------------------------------------------------


# The module that adds each command, so that a run imports only its own (a quantize run never
# loads the generation commands); help and unknown names import them all.
_COMMAND_MODULES = {
    "run": "commands",
    "chat": "commands",
    "bench": "commands",
    "perplexity": "perplexity_command",
    "quantize": "quantize_command",
    "serve": "serve_command",
}


def _load_commands(argv: list[str] | None) -> None:
    """Import the modules that add the commands named on the command line (kept out of
    --version's path)."""
    import importlib

    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else None
    if name in _COMMAND_MODULES:
        modules = [_COMMAND_MODULES[name]]
    elif name in ("pull", "info", "--version"):
        modules = []
    else:
        modules = sorted(set(_COMMAND_MODULES.values()))
    for module in modules:
        importlib.import_module(f"fastrun.runner.{module}")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    from fastrun.runner.validate import FastrunWarning

    if issubclass(category, FastrunWarning):
        print(f"fastrun: warning: {message}", file=sys.stderr)
    else:
        _show_warning(message, category, filename, lineno, file, line)


_show_warning = warnings.showwarning


def _terminate(signum, frame) -> None:
    # SIGTERM as an exception, so that `finally` blocks run: a pull removes its partial file
    raise SystemExit(128 + signum)


def _error(message: str) -> int:
    # one line, whatever a message quoted from a file holds
    print(f"fastrun: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_USER_ERROR


def _interrupted() -> int:
    # on a terminal, after the ^C echoed on the line of the text generated so far
    start = "\n" if sys.stderr.isatty() else ""
    print(f"{start}fastrun: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the app, turning user mistakes into one line and exit code 2,
    Ctrl-C at any point into one line and exit code 130."""
    try:
        warnings.showwarning = _one_line_warning
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _terminate)
        if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes typed or piped: U+FFFD
            sys.stdin.reconfigure(errors="replace")
        _load_commands(argv)
        command = typer.main.get_command(app)
        code = command.main(args=argv, prog_name="fastrun", standalone_mode=False)
        if isinstance(code, int):  # typer returns Exit codes (130 on Ctrl-C) in this mode
            return _interrupted() if code == EXIT_INTERRUPTED else code
    except typer.Exit as e:
        return _interrupted() if e.exit_code == EXIT_INTERRUPTED else e.exit_code
    except click_errors.NoArgsIsHelpError as e:
        print(e.ctx.get_help())
        return 0
    except click_errors.UsageError as e:
        return _error(e.format_message())
    except FastrunError as e:
        return _error(str(e))
    except MemoryError:
        print("fastrun: error: out of memory", file=sys.stderr)
        return EXIT_USER_ERROR
    except (KeyboardInterrupt, typer.Abort):
        return _interrupted()
    except BrokenPipeError:
        return 0
    return 0


# The commands whose start-up ends in commands.load_model (which ends start_up_without_gc).
_LOADING_COMMANDS = ("run", "chat", "bench", "serve")


def console(argv: list[str] | None = None) -> int:
    """main() as the console process runs it. The garbage collector is off while a model
    loads (app.start_up_without_gc) and what is alive at the end is frozen (gc.freeze), so
    that the interpreter's last collections skip it: they visited every object of the run
    (Numba's types and compiled functions, the vocabulary, ...), 0.15 s of a one-token run.
    Finalizers run as before. After a Ctrl-C the process ends at once (os._exit, its output
    flushed, a first run's second compiling process stopped): a compile or kernel load cut
    short, on this thread or the engine's, leaves LLVM objects half made, and tearing them
    down aborts the process in LLVM's checks (exit -6 instead of 130)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in _LOADING_COMMANDS:
        start_up_without_gc()
    code = EXIT_INTERRUPTED  # until main returns
    try:
        code = main(argv)
        return code
    finally:
        if code == EXIT_INTERRUPTED:
            _exit_now(code)
        gc.freeze()


def _exit_now(code: int) -> None:
    """End the process without its teardown (see console)."""
    side_compile = sys.modules.get("fastrun.backends.cpu.side_compile")  # loaded: maybe running
    if side_compile is not None:
        side_compile.stop_all()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(console())
