"""The server's counters and their Prometheus text exposition (GET /metrics).

All methods run on the event loop's thread (the server hands pieces to it), so no lock."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import Counter, deque

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_SECONDS = 10.0


def resident_memory_bytes() -> int:
    """This process's resident set size now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class Metrics:
    def __init__(self):
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cancelled = 0  # generations whose client went away
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # the last: above every bucket
        self.ttft_sum = 0.0
        self.recent_pieces: deque[float] = deque()  # arrival times within the rate window

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests[endpoint, status] += 1

    def first_token(self, seconds: float) -> None:
        self.ttft_sum += seconds
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1
                return
        self.ttft_counts[-1] += 1

    def piece_streamed(self, now: float) -> None:
        self.recent_pieces.append(now)
        self._forget_before(now - RATE_WINDOW_SECONDS)

    def generation_done(self, prompt_tokens: int, generated_tokens: int, cancelled: bool) -> None:
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.cancelled += cancelled

    def _forget_before(self, cutoff: float) -> None:
        while self.recent_pieces and self.recent_pieces[0] < cutoff:
            self.recent_pieces.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_SECONDS (pieces ~ tokens)."""
        now = time.monotonic()
        self._forget_before(now - RATE_WINDOW_SECONDS)
        span = min(RATE_WINDOW_SECONDS, now - self.started)
        return len(self.recent_pieces) / span if span > 0 else 0.0

    def render(self, ready: bool, stats: dict | None) -> str:
        """Prometheus text format 0.0.4."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        metric(
            "fastrun_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
            [
                (f'{{endpoint="{endpoint}",status="{status}"}}', n)
                for (endpoint, status), n in sorted(self.requests.items())
            ],
        )
        metric("fastrun_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
               [("", self.prompt_tokens)])  # fmt: skip
        metric("fastrun_generated_tokens_total", "counter", "Tokens generated.",
               [("", self.generated_tokens)])  # fmt: skip
        metric("fastrun_cancelled_generations_total", "counter",
               "Generations cancelled because the client went away or the server stopped.",
               [("", self.cancelled)])  # fmt: skip
        metric("fastrun_tokens_per_second", "gauge",
               f"Generated tokens per second over the last {RATE_WINDOW_SECONDS:g} s.",
               [("", round(self.tokens_per_second(), 3))])  # fmt: skip
        stats = stats or {}
        for key in ("active", "queued", "parallel", "n_ctx"):
            help_text = {
                "active": "Sequences generating now.",
                "queued": "Requests waiting for a free sequence.",
                "parallel": "Sequences that can generate at once.",
                "n_ctx": "Context length per sequence.",
            }[key]
            name = "fastrun_context_tokens" if key == "n_ctx" else f"fastrun_{key}_sequences"
            metric(name, "gauge", help_text, [("", stats.get(key, 0))])
        drafts = stats.get("speculative")
        if drafts:
            metric("fastrun_draft_rounds_total", "counter",
                   "Target passes that checked drafted tokens (per sequence).",
                   [("", drafts["rounds"])])  # fmt: skip
            metric("fastrun_drafted_tokens_total", "counter", "Tokens drafted.",
                   [("", drafts["drafted_tokens"])])  # fmt: skip
            metric("fastrun_accepted_tokens_total", "counter", "Drafted tokens accepted.",
                   [("", drafts["accepted_tokens"])])  # fmt: skip
            metric("fastrun_draft_acceptance_rate", "gauge",
                   "Accepted over drafted tokens, since the start.",
                   [("", drafts["acceptance_rate"])])  # fmt: skip
            metric("fastrun_mean_accepted_length", "gauge",
                   "Drafted tokens accepted per checking pass, since the start.",
                   [("", drafts["mean_accepted_length"])])  # fmt: skip
        metric("fastrun_model_ready", "gauge", "1 once the model is loaded.", [("", int(ready))])
        cumulative, samples = 0, []
        for bound, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts, strict=True):
            cumulative += count
            samples.append((f'_bucket{{le="{bound}"}}', cumulative))
        samples += [("_sum", round(self.ttft_sum, 6)), ("_count", cumulative)]
        metric("fastrun_time_to_first_token_seconds", "histogram",
               "From the request's arrival to its first generated piece.", samples)  # fmt: skip
        metric("process_resident_memory_bytes", "gauge", "Resident memory of the server.",
               [("", resident_memory_bytes())])  # fmt: skip
        return "\n".join(lines) + "\n"
