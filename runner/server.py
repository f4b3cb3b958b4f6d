"""The OpenAI-compatible HTTP server: the ASGI app (Starlette); `fastrun serve` runs it.

The engine's thread does the generating; each request's stream is iterated by a thread of its
own that hands the pieces to the event loop, so a slow or waiting stream never blocks another
request. A client that goes away cancels its generation; a full queue answers 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from fastrun.formats.errors import FastrunError
from fastrun.runner.engine import QueueFull
from fastrun.runner.openai_protocol import (
    ApiError,
    GenerationRequest,
    ResponseBuilder,
    invalid,
    parse_chat,
    parse_completion,
)
from fastrun.runner.server_metrics import Metrics

MAX_BODY_BYTES = 8 * 1024 * 1024  # a full context of text is far smaller
log = logging.getLogger("uvicorn.error")  # the server's own log lines go where uvicorn's go


class ServerState:
    """The model's lifecycle (loading, ready, failed, stopping) and the open generations."""

    def __init__(self, load_engine: Callable[[], object], on_load_error: Callable | None = None):
        """load_engine returns the engine-backed model; on_load_error(message) is called from
        the loader's thread when it fails."""
        self.load_engine = load_engine
        self.on_load_error = on_load_error
        self.engine = None
        self.load_error: str | None = None
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.open_streams: set = set()
        self.loader: threading.Thread | None = None

    def start_loading(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loader = threading.Thread(target=self._load, name="fastrun-load", daemon=True)
        self.loader.start()

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            engine = self.load_engine()
        except Exception as e:  # a bad file etc.: one line, then the server stops
            self.load_error = str(e) if isinstance(e, FastrunError) else repr(e)
            log.error("fastrun: error: %s", self.load_error)
            if self.on_load_error:
                self.on_load_error(self.load_error)
            return
        self.engine = engine
        log.info("model ready in %.1f s", time.perf_counter() - started)

    def ready_engine(self):
        if self.stopping:
            raise ApiError(503, "the server is shutting down", kind="unavailable_error")
        if self.load_error:
            raise ApiError(503, f"the model failed to load: {self.load_error}",
                           kind="unavailable_error")  # fmt: skip
        if self.engine is None:
            raise ApiError(503, "the model is loading; try again shortly", kind="unavailable_error")
        return self.engine

    def stop(self) -> None:
        """Refuse new work and end the open streams (they finish with their usage, then
        [DONE]); called on the loop when a signal asks the server to stop."""
        self.stopping = True
        for stream in list(self.open_streams):
            stream.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class PiecePump:
    """Iterates a blocking stream in its own thread and hands each piece to the event loop."""

    _END = object()

    def __init__(self, stream):
        self.stream = stream
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._run, name="fastrun-stream", daemon=True).start()

    def _run(self) -> None:
        item = self._END
        try:
            for piece in self.stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)
        except BaseException as e:  # handed to the request, which answers with it
            item = e
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def __aiter__(self):
        while True:
            item = await self.queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class EventStream(Response):
    """A server-sent event stream that ends its generation whichever way the stream ends: the
    last event sent, the client gone (watched for all along, even before the first token), or
    a failed send."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async with anyio.create_task_group() as group:

                async def send_events() -> None:
                    try:
                        async for event in self.events:
                            await send({"type": "http.response.body", "body": event,
                                        "more_body": True})  # fmt: skip
                        await send({"type": "http.response.body", "body": b""})
                    except OSError:  # ASGI 2.4 servers: the client is gone
                        pass
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(send_events)
                group.start_soon(watch)
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()


class Generation:
    """One request's generation: submitted to the engine, its pieces arriving on the loop, its
    metrics recorded once when its response is over."""

    def __init__(self, state: ServerState, metrics: Metrics, stream, arrived: float):
        self.state = state
        self.metrics = metrics
        self.stream = stream
        self.arrived = arrived
        self.first_piece_at: float | None = None
        self.completed = False  # the stream ran to its end (finished, or cancelled by us)
        self.released = False
        state.open_streams.add(stream)

    async def pieces(self):
        async for piece in PiecePump(self.stream):
            now = time.monotonic()
            if self.first_piece_at is None:
                self.first_piece_at = now
                self.metrics.first_token(now - self.arrived)
            self.metrics.piece_streamed(now)
            yield piece
        self.completed = True

    def cancel(self) -> None:
        """The client went away: the engine frees the sequence at its next step."""
        self.stream.close()

    def release(self) -> None:
        """The response is over, whichever way it ended: cancel what still runs, count it."""
        if self.released:
            return
        self.released = True
        self.state.open_streams.discard(self.stream)
        if not self.completed:
            self.stream.close()
        completion = self.stream.completion
        cancelled = not self.completed or completion.finish_reason == "cancelled"
        self.metrics.generation_done(completion.prompt_tokens, len(completion.tokens), cancelled)


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"retry-after": "1"} if error.status == 503 else None
    return JSONResponse(error.body, status_code=error.status, headers=headers)


def create_app(
    state: ServerState,
    model_id: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
):
    """The ASGI app. The state's loader runs in a background thread once the server is up
    (so /health answers 503 while it loads)."""
    metrics = Metrics()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                           code="invalid_api_key")  # fmt: skip

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise ApiError(413, f"the request body is over {max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise ApiError(413, f"the request body is over {max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        return body

    def submit(engine, request: GenerationRequest):
        """Prompt ids and the engine's stream (in a worker thread: templates and tokenizing
        take a while on long prompts)."""
        if request.chat:
            ids, param = engine.chat_prompt(request.messages), "messages"
        elif isinstance(request.prompt, str):
            ids, param = engine.tokenize(request.prompt, special=True), "prompt"
        else:
            ids, param = request.prompt, "prompt"
            n_vocab = engine.tokenizer.n_vocab
            if max(ids) >= n_vocab:
                raise invalid(f"token id {max(ids)} is not below the vocabulary's {n_vocab}", param)
        if len(ids) >= engine.n_ctx:
            raise invalid(
                f"the prompt has {len(ids)} tokens; the context holds {engine.n_ctx} per "
                f"sequence (start the server with a larger --ctx-size)",
                param, "context_length_exceeded",
            )  # fmt: skip
        sampling = {"max_tokens": engine.n_ctx - len(ids), **request.sampling}
        if request.logprobs is not None:
            sampling["logprobs"] = request.logprobs
        try:
            return engine.generate(ids, **sampling)
        except QueueFull as e:
            raise ApiError(503, f"the server is busy: {e}", kind="unavailable_error") from None
        except FastrunError as e:
            raise invalid(str(e), param) from None

    async def generate(request: Request, chat: bool) -> Response:
        arrived = time.monotonic()
        authorize(request)
        engine = state.ready_engine()
        body = await read_json(request)
        parsed = parse_chat(body) if chat else parse_completion(body)
        with anyio.CancelScope(shield=True):  # a submitted stream is always released below
            stream = await anyio.to_thread.run_sync(submit, engine, parsed)
        if state.stopping:  # a signal came while it was submitted
            stream.close()
        generation = Generation(state, metrics, stream, arrived)
        builder = ResponseBuilder(parsed, model_id, lambda t: engine.detokenize([t]))
        if parsed.stream:
            return EventStream(_events(generation, builder), generation.release)
        try:
            return await _whole(request, generation, builder)
        finally:
            generation.release()

    async def _whole(request: Request, generation: Generation, builder) -> Response:
        pieces = []
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                await _wait_for_disconnect(request.receive)
                generation.cancel()

            group.start_soon(watch)
            try:
                async for piece in generation.pieces():
                    pieces.append(piece)
            finally:
                group.cancel_scope.cancel()
        return JSONResponse(builder.whole(pieces, generation.stream.completion))

    async def _events(generation: Generation, builder: ResponseBuilder):
        def event(obj) -> bytes:
            return b"data: " + _json_bytes(obj) + b"\n\n"

        first = builder.first_chunk()
        if first:
            yield event(first)
        pieces = generation.pieces()
        try:
            async for piece in pieces:
                chunk = builder.piece_chunk(piece)
                if chunk:
                    yield event(chunk)
        except Exception as e:  # headers are sent: the error goes into the stream
            log.exception("generation failed")
            yield event(ApiError(500, f"generation failed: {e}", kind="server_error").body)
            yield b"data: [DONE]\n\n"
            return
        finally:
            await pieces.aclose()
        completion = generation.stream.completion
        yield event(builder.last_chunk(completion))
        if builder.request.include_usage:
            yield event(builder.usage_chunk(completion))
        yield b"data: [DONE]\n\n"

    # -- endpoints ---------------------------------------------------------------------------

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def models(request: Request) -> Response:
        authorize(request)
        entry = {"id": model_id, "object": "model", "created": int(metrics.started_wall),
                 "owned_by": "fastrun"}  # fmt: skip
        if state.engine is not None:
            entry["meta"] = state.engine.stats()
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(request: Request) -> Response:
        if state.engine is not None and not state.stopping:
            return JSONResponse({"status": "ok"})
        status = "stopping" if state.stopping else "error" if state.load_error else "loading"
        return JSONResponse({"status": status}, status_code=503)

    async def stats(request: Request) -> Response:
        """The engine's counters as JSON (with speculative decoding: its drafts' acceptance)."""
        authorize(request)
        if state.engine is None:
            raise ApiError(503, "the model is not loaded yet", kind="server_error")
        return JSONResponse(state.engine.stats())

    async def metrics_text(request: Request) -> Response:
        authorize(request)
        stats = state.engine.stats() if state.engine is not None else None
        return PlainTextResponse(
            metrics.render(state.engine is not None, stats),
            media_type="text/plain; version=0.0.4",
        )

    # -- errors, lifespan ----------------------------------------------------------------------

    async def api_error(request: Request, error: ApiError) -> Response:
        return _error_response(error)

    async def http_error(request: Request, error: HTTPException) -> Response:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(error.status_code, str(error.detail), kind=kind))

    async def server_error(request: Request, error: Exception) -> Response:
        # Starlette re-raises it afterwards, so uvicorn logs the traceback
        return _error_response(ApiError(500, f"internal error: {error!r}", kind="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        yield
        state.stop()
        state.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },  # fmt: skip
    )
    known = {route.path for route in routes}
    return CountStatuses(app, metrics, known)


class CountStatuses:
    """ASGI middleware: counts every answered request by endpoint and status for /metrics."""

    def __init__(self, app, metrics: Metrics, endpoints: set[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"  # bounded label values

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request_done(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
