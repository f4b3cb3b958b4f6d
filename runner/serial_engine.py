"""TEMPORARY adapter (until the engine of issue #14 lands): the engine-backed Model's API on
top of the single-session Model, one generation at a time under a lock.

The server is written for the engine's API only:

    engine = open_engine(path, backend=..., n_ctx=..., parallel=..., threads=...)
    stream = engine.generate(ids, **sampling)  # validates and submits; raises QueueFull
    for piece in stream: ...                   # Token pieces
    stream.completion; stream.close()          # the Completion; cancel
    engine.chat_prompt(messages); engine.stats(); engine.n_ctx; engine.detokenize(ids)

When the engine is in, `open_engine` becomes `fastrun.load(...)` and `QueueFull` is imported
from fastrun.runner.engine; this module is then deleted. Logprobs exist only with the engine.
"""

from __future__ import annotations

import inspect
import threading

import fastrun
from fastrun.formats.errors import FastrunError
from fastrun.runner.api import Model
from fastrun.runner.generate import Completion

MAX_WAITING = 64  # generations waiting for the lock before QueueFull (the engine's bounded queue)

try:
    from fastrun.runner.engine import QueueFull
except ImportError:

    class QueueFull(FastrunError):
        """The waiting queue is full: the server answers 503 at once."""


def open_engine(path, backend="auto", n_ctx=None, parallel=4, threads=None):
    """The engine-backed Model where it exists, else the serial adapter."""
    if "parallel" in inspect.signature(Model.__init__).parameters:
        return fastrun.load(path, backend=backend, n_ctx=n_ctx, parallel=parallel, threads=threads)
    return SerialEngine(fastrun.load(path, backend=backend, n_ctx=n_ctx, threads=threads))


class SerialEngine:
    """The engine API over a single-session Model: generations take turns under one lock."""

    def __init__(self, model: Model):
        self.model = model
        self.n_ctx = model.n_ctx
        self.path = model.path
        self.tokenizer = model.tokenizer
        self.lock = threading.Lock()
        self.counts_lock = threading.Lock()
        self.active = 0
        self.queued = 0
        # Numba's thread count is per thread: the CPU backend set it in the loading thread, and
        # each stream's thread must do the same (the engine's one thread will, once)
        self.cpu_threads = None
        if model.backend.name == "cpu":
            import numba

            self.cpu_threads = numba.get_num_threads()

    def generate(self, prompt_or_ids, **sampling) -> SerialStream:
        sampling.pop("logprobs", None)  # only the engine computes them
        sampling.pop("ignore_eos", None)
        ids = self.model.prompt_ids(prompt_or_ids)  # raises for an empty or overlong prompt
        with self.counts_lock:
            if self.queued >= MAX_WAITING:
                raise QueueFull(f"{self.queued} requests are waiting; try again shortly")
            self.queued += 1
        return SerialStream(self, ids, sampling)

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False):
        return self.model.tokenize(text, add_bos=add_bos, special=special)

    def chat_prompt(self, messages) -> list[int]:
        return self.model.chat_prompt(messages)

    def detokenize(self, ids) -> str:
        return self.model.detokenize(ids)

    def stats(self) -> dict:
        return {"active": self.active, "queued": self.queued, "parallel": 1, "n_ctx": self.n_ctx}

    def close(self) -> None:
        self.model.close()


class SerialStream:
    """One submitted generation: iterate it (blocking) for its Token pieces."""

    def __init__(self, engine: SerialEngine, ids: list[int], sampling: dict):
        self.engine = engine
        self.ids = ids
        self.sampling = sampling
        self.cancelled = threading.Event()
        self.completion = Completion(finish_reason="cancelled")  # until it runs
        self.started = False

    def __iter__(self):
        engine = self.engine
        with engine.lock:
            with engine.counts_lock:
                if self.started:  # closed while it waited
                    return
                self.started = True
                engine.queued -= 1
                engine.active += 1
            try:
                if engine.cpu_threads:
                    import numba

                    numba.set_num_threads(engine.cpu_threads)
                pieces = engine.model.generate(self.ids, **self.sampling)
                self.completion = engine.model.last
                for piece in pieces:
                    yield piece
                    if self.cancelled.is_set():
                        pieces.close()
                        self.completion.finish_reason = "cancelled"
                        return
            finally:
                with engine.counts_lock:
                    engine.active -= 1

    def close(self) -> None:
        """Cancel: takes effect after the current token (thread-safe)."""
        self.cancelled.set()
        with self.engine.counts_lock:
            if not self.started:  # never ran: leave the queue now
                self.started = True
                self.engine.queued -= 1
