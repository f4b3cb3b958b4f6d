"""The engine: one thread owns the model's backend and runs every request of every caller as
parallel sequences over one pool of KV cells (a continuous batcher).

Each step gathers one batch: the next token of every decoding sequence first, then prefill
chunks of new prompts up to `batch_size` tokens, so a long prompt never freezes the sequences
that stream. Requests past `parallel` wait in a bounded queue. Callers on any thread submit and
get a Stream of Token pieces; closing it cancels the request, whose cells are free at the next
step. A new request starts from the longest common prefix held by any sequence, live or
finished (a shared system prompt, the previous chat turn), copying those cells instead of
running them again.

Sequences do not see each other: every operation works row by row, so a sequence's tokens are
the same alone or in a batch (bit for bit on the CPU).

With a Speculator (speculative.py), a decoding sequence may bring drafted tokens after its last
one: the pass returns logits for each, the sampler keeps the accepted prefix and one token of
the target's own, and the cells of the rest are trimmed. The batch stays mixed: other
sequences' single tokens and prefill chunks share the pass.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from fastrun.backends.base import top_k_host
from fastrun.formats.errors import FastrunError
from fastrun.runner.batch import MAX_STEP_TOKENS, Batch
from fastrun.runner.generate import Completion, Continuation, Token, log_softmax
from fastrun.runner.kv_cache import KVCache
from fastrun.runner.sampling import Candidates, Sampler, SamplingParams
from fastrun.runner.speculative import Draft, Speculator, check_draft


class QueueFull(FastrunError):
    """More requests wait than the engine's queue holds."""


@dataclass(frozen=True)
class EngineSettings:
    parallel: int = 1  # sequences decoding at once
    n_ctx: int = 4096  # cells of each sequence
    batch_size: int = 512  # tokens of one pass at most (decode tokens + prefill chunks)
    n_keep: int = 4  # tokens kept at the start on a context shift; -1: the whole prompt
    context_shift: bool = True  # False: a full context ends the generation ("length")
    max_queue: int = 256  # requests waiting for a sequence, at most


_DONE = object()  # the end of a stream's events


class Request:
    """One generation: its prompt and sampler, its events for the caller, its sequence."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: SamplingParams, tokenizer):
        self.id = next(Request._ids)
        self.prompt = prompt
        self.params = params
        self.completion = Completion(prompt_tokens=len(prompt))
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # Token, exceptions, _DONE
        self.submitted = time.perf_counter()
        # the engine thread's own state
        self.tokenizer = tokenizer
        self.cache: KVCache | None = None
        self.pending: list[int] = []  # prompt ids not yet run
        self.next_token = -1  # the last sampled token, run in the next step
        self.sampler: Sampler | None = None
        self.continuation: Continuation | None = None
        self.speculation = None  # the Speculator's state of this sequence

    def start(self, cache: KVCache, reused: int) -> None:
        self.cache = cache
        self.pending = self.prompt[reused:]
        out = self.completion
        out.prefilled_tokens = len(self.pending)
        out.queue_seconds = time.perf_counter() - self.submitted
        banned = self.tokenizer.eog_ids if self.params.ignore_eos else frozenset()
        self.sampler = Sampler(self.params, banned)
        self.continuation = Continuation(self.tokenizer, self.params, out)

    @property
    def candidates(self) -> int:
        return self.sampler.candidates


class Stream:
    """The Token pieces of one request, as the engine makes them; `completion` fills in as it
    runs. close() (or leaving a `with` block, or Ctrl-C while waiting) cancels the request."""

    def __init__(self, engine: Engine, request: Request):
        self._engine = engine
        self._request = request
        self._done = False

    @property
    def completion(self) -> Completion:
        return self._request.completion

    def __iter__(self):
        return self

    def __next__(self) -> Token:
        if self._done:
            raise StopIteration
        try:
            event = self._request.events.get()
        except KeyboardInterrupt:
            self.close("interrupted")
            raise
        if event is _DONE:
            self._done = True
            raise StopIteration
        if isinstance(event, BaseException):
            self._done = True
            raise event
        return event

    def close(self, reason: str = "cancelled") -> None:
        """Cancel the request (its cells are free at the next step); a finished one stays."""
        if not self._done:
            self._done = True
            if self.completion.finish_reason is None:
                self.completion.finish_reason = reason
            self._engine.cancel(self._request, reason)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_done", True):
            self.close()


class Engine:
    """Runs requests on a Transformer in a thread of its own; see the module's docstring."""

    def __init__(
        self, transformer, tokenizer, settings: EngineSettings, speculator: Speculator | None = None
    ):
        if settings.parallel < 1 or settings.batch_size < 1:
            raise FastrunError("--parallel and --batch-size must be at least 1")
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.settings = settings
        self.speculator = speculator
        # a pass adds at most batch_size tokens to a sequence (a decode step with drafts: up
        # to MAX_STEP_TOKENS); that sizes the sliding-window layers' rings
        max_pass = max(settings.batch_size, MAX_STEP_TOKENS)
        self.cells = transformer.new_cells(settings.parallel, settings.n_ctx, max_pass)
        self._free: deque[KVCache] = deque(self.cells.sequences)  # least recently used first
        self._waiting: deque[Request] = deque()
        self._prefilling: deque[Request] = deque()
        self._decoding: list[Request] = []
        self._calls: deque = deque()  # (fn, result queue): work for the backend's thread
        self._cancels: deque = deque()
        self._wake = threading.Condition()
        self._closed = False
        self.steps = 0  # passes run
        self.generated = 0  # tokens sampled
        self.prompt_tokens = 0  # prompt tokens run (prefix reuse spares the rest)
        self.step_seconds = 0.0  # in steps, of which
        self.pass_seconds = 0.0  # in the model's passes (the rest: scheduling and sampling)
        self._warmed: set[int] = set()  # checking-pass sizes captured (_warm_checking_passes)
        self._thread = threading.Thread(target=self._loop, name="fastrun-engine", daemon=True)
        self._thread.start()
        if speculator is not None:
            self.call(self._warm_checking_passes)

    # -- callers (any thread) -------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams) -> Stream:
        """Queue a generation; raises QueueFull when max_queue requests already wait."""
        if len(prompt) >= self.settings.n_ctx:
            raise FastrunError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.settings.n_ctx}"
            )
        request = Request(list(prompt), params, self.tokenizer)
        with self._wake:
            self._check_open()
            if len(self._waiting) >= self.settings.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already; try later")
            self._waiting.append(request)
            self._wake.notify()
        return Stream(self, request)

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        with self._wake:
            self._cancels.append((request, reason))
            self._wake.notify()

    def call(self, fn):
        """Run fn() on the engine's thread between two steps (the backend is not shared between
        threads); returns its result or raises its exception."""
        result: queue.SimpleQueue = queue.SimpleQueue()
        with self._wake:
            self._check_open()
            self._calls.append((fn, result))
            self._wake.notify()
        ok, value = result.get()
        if not ok:
            raise value
        return value

    def set_speculator(self, speculator: Speculator | None) -> None:
        """Speculate with another Speculator (or none) from the next request on; refused while
        any request runs or waits (their sequences carry the old one's state)."""

        def swap():
            if self._waiting or self._prefilling or self._decoding:
                raise FastrunError("speculation can change only while no request runs")
            self.speculator = speculator
            self._warm_checking_passes()

        self.call(swap)

    def _warm_checking_passes(self) -> None:
        """Where the backend captures steps (a CUDA graph a size: about 45 ms of host work,
        more than a short reply's whole decode), capture a greedy sequence's checking passes
        of every size its drafts can make now, and its one-token step, before any request (as
        vLLM captures its batch sizes at start-up): a request then pays no capture that plain
        decoding does not. The least recently used free sequence runs each pass (its tokens
        meaningless) and is emptied after; on the engine's thread, while no request runs."""
        spec = self.speculator
        if spec is None or not self.transformer.backend.captures_steps or not self._free:
            return
        cache = self._free[0]
        sizes = [n for n in range(1, spec.settings.draft_max + 2) if n not in self._warmed]
        if not sizes:
            return
        cache.trim(0)
        for n in sizes:
            if n > cache.free_slots:
                break
            batch = Batch()
            batch.add(cache, [0] * n, "all")
            try:
                self.transformer.run(batch, self.cells, 1)  # a greedy request's candidates
            finally:
                cache.trim(0)
            self._warmed.add(n)
            spec.target_costs.warmed(n)

    def stats(self) -> dict:
        with self._wake:
            return {
                "parallel": self.settings.parallel,
                "n_ctx": self.settings.n_ctx,
                "active": len(self._decoding) + len(self._prefilling),
                "queued": len(self._waiting),
                "steps": self.steps,
                "generated": self.generated,
                "prompt_tokens": self.prompt_tokens,
                "step_seconds": self.step_seconds,
                "pass_seconds": self.pass_seconds,
                **({"speculative": self.speculator.stats()} if self.speculator else {}),
            }

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _check_open(self) -> None:
        if self._closed:
            raise FastrunError("the model is closed")

    # -- the engine's thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        self.transformer.backend.use_on_this_thread()
        while True:
            with self._wake:
                while not (self._closed or self._calls or self._cancels or self._has_work()):
                    self._wake.wait()
                if self._closed:
                    break
                calls, self._calls = self._calls, deque()
                cancels, self._cancels = self._cancels, deque()
                self._admit()
            for request, reason in cancels:
                self._cancel(request, reason)
            for fn, result in calls:
                try:
                    result.put((True, fn()))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    result.put((False, e))
            if self._decoding or self._prefilling:
                try:
                    self._step()
                except Exception as e:  # noqa: BLE001 - a bug must not strand every caller
                    for request in [*self._prefilling, *self._decoding]:
                        self._cancel_with(request, e)
        for request in [*self._waiting, *self._prefilling, *self._decoding]:
            self._finish(request, "cancelled")
        self.cells.free()
        for _fn, result in self._calls:
            result.put((False, FastrunError("the model is closed")))

    def _has_work(self) -> bool:
        return bool(self._decoding or self._prefilling or (self._waiting and self._free))

    def _admit(self) -> None:
        """Waiting requests take free sequences, starting from the longest cached prefix."""
        while self._waiting and self._free:
            request = self._waiting.popleft()
            cache, reused = self._place(request.prompt)
            request.start(cache, reused)
            if self.speculator is not None:
                self.speculator.start(request)
            self._prefilling.append(request)

    def _place(self, prompt: list[int]) -> tuple[KVCache, int]:
        """A free sequence for a prompt and how many of its ids are already in it (copied from
        the sequence, live or finished, that shares the longest prefix)."""
        limit = len(prompt) - 1  # the last id always runs: its logits start the generation
        # (a sliding-window layer's ring may no longer hold what a prefix needs: reusable_prefix)
        best_free = max(self._free, key=lambda s: s.reusable_prefix(prompt, limit))
        reused = best_free.reusable_prefix(prompt, limit)
        live = [r.cache for r in [*self._decoding, *self._prefilling]]
        source = max(live, key=lambda s: s.reusable_prefix(prompt, limit), default=None)
        shared = 0 if source is None else source.reusable_prefix(prompt, limit)
        if shared > reused:  # copy from a live sequence into the least recently used free one
            cache = self._free.popleft()
            cache.copy_prefix(source, shared)
            return cache, shared
        self._free.remove(best_free)
        best_free.trim(reused)
        return best_free, reused

    def _cancel(self, request: Request, reason: str) -> None:
        if request in self._waiting:
            self._waiting.remove(request)
        elif request in self._prefilling:
            self._prefilling.remove(request)
        elif request in self._decoding:
            self._decoding.remove(request)
        else:
            return  # finished already
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str | None = None, error=None) -> None:
        """End a request: its last piece and the end of its stream go to the caller; its
        sequence is free (its cells stay for a later prefix)."""
        if request.continuation is not None:
            last = request.continuation.finish(reason)
            if last is not None:
                request.events.put(last)
        elif reason:
            request.completion.finish_reason = reason
        if request.cache is not None:
            self._free.append(request.cache)
            request.cache = None
        request.events.put(error if error is not None else _DONE)

    def _step(self) -> None:
        """One pass: every decoding sequence's next token, then prefill chunks."""
        started = time.perf_counter()
        try:
            self._gather_run_sample()
        finally:
            self.step_seconds += time.perf_counter() - started

    def _gather_run_sample(self) -> None:
        batch, rows = Batch(), []  # rows: (request, its first output's place, its Draft)
        budget = self.settings.batch_size
        decoding = self._ready_to_decode(budget)
        steps = self._chain_length(decoding)
        if steps > 1:
            self._run_chain(decoding, steps)
            return
        budget -= len(decoding)
        drafts = {}
        if self.speculator is not None and decoding:
            most = self._chain_length(decoding, speculating=True)
            drafts = self.speculator.drafts(decoding, budget, chainable=most > 1)
            steps = self.speculator.quiet_steps(decoding, most) if most > 1 and not drafts else 1
            if steps > 1:  # none drafts: greedy steps chained, as plain decoding's
                started = time.perf_counter()
                if self._run_chain(decoding, steps):
                    self.speculator.chained(decoding, steps, time.perf_counter() - started)
                return
        started = time.perf_counter()  # a step's cost, for speculation's plans: drafts apart
        for request in decoding:
            draft = drafts.get(request)
            if draft is None:
                rows.append((request, batch.add(request.cache, [request.next_token]), None))
            else:
                tokens = [request.next_token, *draft.tokens]
                rows.append((request, batch.add(request.cache, tokens, "all"), draft))
                budget -= len(draft.tokens)
        only_decoding = True
        prompted = []  # requests whose prompts end in this pass
        for request in list(self._prefilling):
            if budget <= 0:
                break
            take = budget
            if not self.transformer.backend.batch_invariant and len(request.pending) > 1:
                take = min(budget, len(request.pending) - 1)  # the last id: a pass of its own
            chunk, request.pending = request.pending[:take], request.pending[take:]
            budget -= len(chunk)
            self.prompt_tokens += len(chunk)
            only_decoding = False
            if request.pending:
                batch.add(request.cache, chunk, "none")
            else:  # its last chunk: the prompt's logits start the generation
                rows.append((request, batch.add(request.cache, chunk), None))
                prompted.append(request)
                self._prefilling.remove(request)
                self._decoding.append(request)
        if batch.n == 0:
            return
        in_batch = [r for r, _, _ in rows] + [r for r in self._prefilling if r.cache is not None]
        try:
            logits = self._run(batch, [r for r, _, _ in rows])
        except Exception as e:  # noqa: BLE001 - the requests of this pass end with it
            for request in in_batch:
                self._cancel_with(request, e)
            return
        self.steps += 1
        if self.speculator is not None and prompted:  # a draft model reads the prompts too
            self.speculator.prefill(prompted)
        for request, row, draft in rows:
            if draft is None:
                self._advance(request, logits, row)
            else:
                self._advance_drafted(request, logits, row, draft)
        if self.speculator is not None and only_decoding:
            self.speculator.step_done(batch.n, time.perf_counter() - started)

    def _chain_length(self, decoding: list[Request], speculating: bool = False) -> int:
        """Greedy steps this pass may chain on the backend (Transformer.run_chain): where
        every sequence decodes and picks the argmax alone and nothing else runs (no drafts, no
        prompt), the backend's number, or fewer where a sequence has room or budget for fewer;
        else 1. A request that arrives meanwhile waits for the chain's end. speculating: the
        number for a step in which speculation drafts nothing (else a speculator forbids
        chains: its plans look at every step)."""
        steps = self.transformer.backend.chain_steps
        busy = self._prefilling or (self.speculator and not speculating)
        alone = not busy and len(decoding) == len(self._decoding)
        if steps <= 1 or not decoding or not alone:
            return 1
        for r in decoding:
            if not r.sampler.argmax_only:
                return 1
            steps = min(steps, r.cache.free_slots, r.continuation.remaining)
        return max(steps, 1)

    def _run_chain(self, decoding: list[Request], steps: int) -> bool:
        """`steps` greedy steps of the decoding sequences in one pass; each request takes its
        picks until its generation ends, and one that ends inside the chain keeps the cells a
        step at a time would have left. False where the pass failed (its requests ended)."""
        batch = Batch()
        for request in decoding:
            batch.add(request.cache, [request.next_token])
        try:
            picked = self._timed(lambda: self.transformer.run_chain(batch, self.cells, steps))
        except Exception as e:  # noqa: BLE001 - the requests of this pass end with it
            for request in decoding:
                self._cancel_with(request, e)
            return False
        self.steps += steps
        for request, ids in zip(decoding, picked.T, strict=True):
            cache = request.cache
            taken = self._emit(request, [(int(t), None) for t in ids])
            if taken < steps:  # its last pick was never run, nor the ones after
                cache.trim(cache.length - steps + taken)
        return True

    def _ready_to_decode(self, budget: int) -> list[Request]:
        """The decoding requests of this step (a full one shifts its context first)."""
        ready = []
        for request in list(self._decoding):
            if len(ready) >= budget:
                break
            if request.cache.free_slots == 0 and not self._make_room(request):
                continue
            ready.append(request)
        return ready

    def _cancel_with(self, request: Request, error: Exception) -> None:
        for group in (self._prefilling, self._decoding):
            if request in group:
                group.remove(request)
        self._finish(request, "error", error)

    def _run(self, batch: Batch, requests: list[Request]):
        """The pass; returns its logits as what each request's sampler needs: a full row for
        any that needs one, else the most candidates any of them asks for."""
        needs = [r.candidates for r in requests]
        top_k = 0 if 0 in needs or not needs else max(needs)
        return self._timed(lambda: self.transformer.run(batch, self.cells, top_k))

    def _timed(self, run_pass):
        """run_pass(), its seconds counted as the backend's (pass_seconds)."""
        started = time.perf_counter()
        try:
            return run_pass()
        finally:
            self.pass_seconds += time.perf_counter() - started

    def _choice(self, request: Request, logits, row: int):
        """What the request's sampler takes from output `row`: its candidates or the whole row,
        and the whole row where there is one (for log-probabilities)."""
        k = request.candidates
        if isinstance(logits, tuple):  # (ids, values) of the batch's most candidates
            return Candidates(logits[0][row, :k], logits[1][row, :k]), None
        full = logits[row]
        if k:  # a neighbour needed whole rows; this sampler takes its own candidates
            ids, values = top_k_host(full[None], k)
            return Candidates(ids[0], values[0]), full
        return full, full

    def _advance(self, request: Request, logits, row: int) -> None:
        choice, full = self._choice(request, logits, row)
        token = request.sampler(choice, request.cache.tokens)
        self._emit(request, [(token, full)])

    def _advance_drafted(self, request: Request, logits, row: int, draft: Draft) -> None:
        """Check a draft against the target's outputs row, row + 1, ...: the accepted tokens
        and the target's own next one are emitted, the cells of the rejected ones trimmed."""
        cache = request.cache
        before = cache.length - len(draft.tokens) - 1  # where the sequence's last token went
        fulls = {}

        def target(j: int):  # the sampler's distribution after the j-th drafted token
            choice, fulls[j] = self._choice(request, logits, row + j)
            return request.sampler.distribution(choice, cache.tokens[: before + j + 1])

        kept, accepted = check_draft(draft, target, request.sampler)
        cache.trim(before + 1 + accepted)
        self.speculator.checked(request, draft, accepted)
        self.speculator.rolled_back(request)
        self._emit(request, [(t, fulls[j]) for j, t in enumerate(kept)])

    def _emit(self, request: Request, tokens: list) -> int:
        """Hand sampled tokens (token, its whole row of logits or None) to the request's
        continuation, up to the end of its generation; returns how many it took."""
        for taken, (token, full) in enumerate(tokens, 1):
            self.generated += 1
            logprobs = None
            if request.params.logprobs is not None and full is not None:
                logprobs = log_softmax(full)
            piece, done = request.continuation.push(token, logprobs)
            if piece is not None:
                request.events.put(piece)
            if done:
                self._decoding.remove(request)
                self._finish(request)
                return taken
            request.next_token = token
        return len(tokens)

    def _make_room(self, request: Request) -> bool:
        """A full sequence: shift its context (drop half of what follows the kept start), or
        end it when context shift is off or nothing can go."""
        cache, settings = request.cache, self.settings
        keep = len(request.prompt) if settings.n_keep < 0 else settings.n_keep
        keep = min(keep, cache.length - 1)
        discard = (cache.length - keep) // 2
        if not settings.context_shift or discard <= 0:
            self._decoding.remove(request)
            self._finish(request, "length")
            return False
        cache.shift(keep, discard, self.transformer.layer_ropes(cache.cells))
        if self.speculator is not None:
            self.speculator.shifted(request, keep, discard)
        request.completion.context_shifts += 1
        return True
