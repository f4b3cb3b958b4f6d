"""`fastrun serve MODEL`: the OpenAI-compatible server (runner/server.py) under uvicorn."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from fastrun.formats.errors import FastrunError
from fastrun.runner.app import app, resolve
from fastrun.runner.commands import (
    SPEC,
    BackendOpt,
    CtxSize,
    Draft,
    DraftMax,
    DraftMin,
    DraftPMin,
    Lookup,
    Threads,
    load_model,
    speculative,
)

GRACEFUL_SHUTDOWN_SECONDS = 10  # open streams are cancelled at once; this bounds the wait


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is one clear line."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise FastrunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8080,
    parallel: Annotated[
        int, typer.Option("-np", "--parallel", min=1, help="Sequences generated at once.")
    ] = 4,
    ctx_size: CtxSize = None,
    max_queue: Annotated[
        int, typer.Option("--max-queue", min=0, help="Requests that may wait; beyond: 503.")
    ] = 256,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="FASTRUN_API_KEY", help="Bearer token clients must send."),
    ] = None,
    backend: BackendOpt = "auto",
    threads: Threads = None,
    draft: Draft = None,
    lookup: Lookup = False,
    draft_max: DraftMax = SPEC.draft_max,
    draft_min: DraftMin = SPEC.draft_min,
    draft_p_min: DraftPMin = SPEC.draft_p_min,
) -> None:
    """Serve MODEL over the OpenAI HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics, /stats). Ctrl-C or SIGTERM ends open streams and exits."""
    try:
        import uvicorn
    except ImportError:
        raise FastrunError("fastrun serve needs its extra: pip install 'fastrun[serve]'") from None
    from fastrun.runner.server import ServerState, create_app

    path = resolve(model)  # a registry model is pulled (with a bar) before the server starts
    model_id = Path(path).stem if os.path.exists(model) else model
    sock = _listen(host, port)
    failure: list[str] = []
    drafting = speculative(draft, lookup, draft_max, draft_min, draft_p_min)

    def load():
        # the one loading path of run, chat and bench (kernel notice, GPU upload bar)
        return load_model(
            str(path), backend, ctx_size, threads, parallel=parallel, max_queue=max_queue,
            **drafting,
        )  # fmt: skip

    def load_failed(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    state = ServerState(load, load_failed)
    config = uvicorn.Config(
        create_app(state, model_id, api_key=api_key or None),
        log_level="info",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        server_header=False,
    )
    server = _stopping_server(uvicorn.Server, config, state)
    where = f"[{host}]" if ":" in host else host
    logging.getLogger("uvicorn.error").info(
        "fastrun serve: %s on http://%s:%d/v1 (loading the model)",
        model_id,
        where,
        sock.getsockname()[1],
    )
    server.run(sockets=[sock])
    if failure:
        raise FastrunError(failure[0])


def _stopping_server(base, config, state):
    """uvicorn's server (`base`, imported late: it is an optional extra) that ends the open
    streams on Ctrl-C or SIGTERM and then exits 0, where uvicorn would re-raise the signal."""

    class Server(base):
        def handle_exit(self, sig, frame) -> None:
            if state.loop is not None:  # stop() takes locks: not inside a signal handler
                state.loop.call_soon_threadsafe(state.stop)
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:
                captured.clear()

    return Server(config)
