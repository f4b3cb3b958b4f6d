"""Load test of `fastrun serve` on 127.0.0.1: many concurrent clients, random cancellations,
overlong prompts and malformed bodies, bounded in time.

    python scripts/load_test.py             # starts `fastrun serve smollm2-135m-instruct` itself
    python scripts/load_test.py --url http://127.0.0.1:8080 --api-key KEY    # a running server

Pass: no 5xx other than deliberate 503s (full queue), every greedy answer equals its serial text
(no stuck or mixed streams), /metrics shows 0 active and 0 queued sequences afterwards, and the
server's resident memory is flat after warm-up (within --rss-slack-mb). Prints the requests by
outcome, p50/p99 time to first token and the aggregate tokens per second; with
--throughput-clients, also the aggregate rate of that many greedy streams (compare it with
`fastrun bench --parallel N`, or pass --bench-tps to check it is >= 0.9x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
QUESTIONS = [
    "What is 2+2?",
    "Name three colors.",
    "Say hello in French.",
    "What is the capital of Italy?",
    "Write one sentence about the sea.",
    "List two fruits.",
    "Why is the sky blue? Answer briefly.",
    "Count from one to five.",
]
MALFORMED = [
    b"{not json",
    b"[1, 2, 3]",
    json.dumps({"model": "x"}).encode(),  # no messages
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
    json.dumps({"messages": "hello"}).encode(),
]


@dataclass
class Results:
    outcomes: Counter = field(default_factory=Counter)  # kind/status -> count
    failures: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    done: int = 0


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def stream_chat(http: httpx.AsyncClient, body: dict, stop_after: int | None = None):
    """POST a streaming chat; returns (status, text, ttft, completion tokens, error body).
    stop_after: close the connection after that many content chunks (a cancellation)."""
    started = time.perf_counter()
    text, ttft, tokens, chunks = "", None, 0, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, "", None, 0, (await r.aread()).decode(errors="replace")
        if stop_after == 0:
            return 200, "", None, 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 500, text, ttft, tokens, json.dumps(event)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text += piece
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        return 200, text, ttft, chunks, None  # leaving closes the connection
    return 200, text, ttft, tokens, None


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def one_request(http, kind, args, serial, rng, results: Results) -> None:
    question = rng.choice(QUESTIONS)
    body = {"messages": chat(question), "temperature": 0, "max_tokens": args.max_tokens}
    try:
        if kind == "malformed":
            r = await http.post("/v1/chat/completions", content=rng.choice(MALFORMED))
            status, expected = r.status_code, {400}
        elif kind == "overlong":
            long = chat("Tell me about this. " * (args.ctx_size // 2))
            r = await http.post("/v1/chat/completions", json={**body, "messages": long})
            status, expected = r.status_code, {400}
            if status == 400 and r.json()["error"]["code"] != "context_length_exceeded":
                results.failures.append(f"overlong prompt: {r.text}")
        elif kind == "cancel":
            status, *_ = await stream_chat(http, {**body, "stream": True}, rng.randint(0, 3))
            expected = {200}
        elif kind == "whole":
            r = await http.post("/v1/chat/completions", json=body)
            status, expected = r.status_code, {200}
            if status == 200:
                reply = r.json()
                results.tokens += reply["usage"]["completion_tokens"]
                if reply["choices"][0]["message"]["content"] != serial[question]:
                    results.failures.append(f"whole answer to {question!r} differs from serial")
        else:
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            status, text, ttft, tokens, error = await stream_chat(http, stream)
            expected = {200}
            if status == 200:
                results.tokens += tokens
                if ttft is not None:
                    results.ttft.append(ttft)
                if text != serial[question]:
                    results.failures.append(
                        f"streamed answer to {question!r} differs: {text!r} != {serial[question]!r}"
                    )
            elif error:
                results.failures.append(f"stream error {status}: {error[:200]}")
    except httpx.HTTPError as e:
        results.outcomes[f"{kind} {type(e).__name__}"] += 1
        results.failures.append(f"{kind}: {type(e).__name__} {e}")
        return
    results.outcomes[f"{kind} {status}"] += 1
    if status == 503:
        return  # deliberate: the queue is full
    if status not in expected:
        results.failures.append(f"{kind}: status {status}, expected {sorted(expected)}")


def pick_kind(rng: random.Random, args) -> str:
    x = rng.random()
    for kind, share in (("cancel", args.cancel), ("overlong", args.overlong),
                        ("malformed", args.malformed)):  # fmt: skip
        if x < share:
            return kind
        x -= share
    return "whole" if rng.random() < 0.2 else "stream"


async def run_load(http: httpx.AsyncClient, args, serial: dict) -> tuple[Results, float, float]:
    """The concurrent phase; returns the results, the wall seconds, and the server's resident
    memory after warm-up (once every client has finished one request)."""
    rng = random.Random(args.seed)
    kinds = [pick_kind(rng, args) for _ in range(args.requests)]
    results = Results()
    queue: asyncio.Queue = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    warm_rss: list[float] = []

    async def client(index: int) -> None:
        client_rng = random.Random(args.seed * 1000 + index)
        while not queue.empty():
            kind = queue.get_nowait()
            await one_request(http, kind, args, serial, client_rng, results)
            results.done += 1
            if results.done == min(args.clients, args.requests) and not warm_rss:
                warm_rss.append((await metrics(http))["process_resident_memory_bytes"])

    started = time.perf_counter()
    tasks = [asyncio.create_task(client(i)) for i in range(args.clients)]
    _, pending = await asyncio.wait(tasks, timeout=args.time_limit)
    for task in pending:
        task.cancel()
    if pending:
        results.failures.append(
            f"time limit {args.time_limit} s: {len(pending)} clients still waiting "
            f"({queue.qsize()} requests not sent)"
        )
    return results, time.perf_counter() - started, warm_rss[0] if warm_rss else float("nan")


async def throughput(http: httpx.AsyncClient, clients: int, max_tokens: int) -> float:
    """Aggregate tokens per second of `clients` greedy streams that do not stop at EOS."""

    async def one(i: int) -> int:
        body = {"messages": chat(QUESTIONS[i % len(QUESTIONS)]), "temperature": 0,
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        status, _, _, tokens, error = await stream_chat(http, body)
        if status != 200:
            raise RuntimeError(f"throughput request failed: {status} {error}")
        return tokens

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(clients)))
    return sum(tokens) / (time.perf_counter() - started)


async def settle(http: httpx.AsyncClient, seconds: float = 30.0) -> dict[str, float]:
    """/metrics once no sequence is active or queued (cancellations free at the next step)."""
    deadline = time.monotonic() + seconds
    while True:
        values = await metrics(http)
        if values["fastrun_active_sequences"] == 0 and values["fastrun_queued_sequences"] == 0:
            return values
        if time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.2)


async def main_async(args, url: str) -> bool:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.time_limit, connect=30)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=timeout) as http:  # fmt: skip
        serial = {}
        for question in QUESTIONS:  # one at a time: the reference texts, and the warm-up
            body = {"messages": chat(question), "temperature": 0, "max_tokens": args.max_tokens}
            r = await http.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            serial[question] = r.json()["choices"][0]["message"]["content"]
        print(f"serial answers: {len(serial)} prompts", flush=True)
        results, wall, warm_rss = await run_load(http, args, serial)
        after = await settle(http)
        tps = None
        if args.throughput_clients:
            tps = await throughput(http, args.throughput_clients, args.throughput_tokens)
            after = await settle(http)

    final_rss = after["process_resident_memory_bytes"]
    if after["fastrun_active_sequences"] or after["fastrun_queued_sequences"]:
        results.failures.append(
            f"/metrics afterwards: {after['fastrun_active_sequences']:.0f} active, "
            f"{after['fastrun_queued_sequences']:.0f} queued"
        )
    growth_mb = (final_rss - warm_rss) / 2**20
    if growth_mb > args.rss_slack_mb:
        results.failures.append(f"resident memory grew {growth_mb:.1f} MB after warm-up")

    print(f"requests: {results.done} of {args.requests} with {args.clients} clients "
          f"in {wall:.1f} s")  # fmt: skip
    for outcome, n in sorted(results.outcomes.items()):
        print(f"  {outcome}: {n}")
    print(f"time to first token: p50 {percentile(results.ttft, 50):.3f} s, "
          f"p99 {percentile(results.ttft, 99):.3f} s ({len(results.ttft)} streams)")  # fmt: skip
    print(f"aggregate: {results.tokens} tokens, {results.tokens / wall:.2f} tok/s")
    print(f"resident memory: {warm_rss / 2**20:.1f} MB after warm-up, "
          f"{final_rss / 2**20:.1f} MB at the end ({growth_mb:+.1f} MB)")  # fmt: skip
    if tps is not None:
        line = f"throughput, {args.throughput_clients} greedy streams: {tps:.2f} tok/s"
        if args.bench_tps:
            line += f" = {tps / args.bench_tps:.2f}x bench's {args.bench_tps:.2f}"
            if tps < 0.9 * args.bench_tps:
                results.failures.append(f"throughput {tps:.2f} < 0.9x bench {args.bench_tps}")
        print(line)
    for failure in results.failures[:20]:
        print(f"FAIL: {failure}")
    if len(results.failures) > 20:
        print(f"... and {len(results.failures) - 20} more failures")
    print("PASS" if not results.failures else f"FAILED ({len(results.failures)})")
    return not results.failures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(args):
    """`fastrun serve` on a free loopback port, ready; its log in a temporary file."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="fastrun-serve-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "fastrun.runner.cli", "serve", args.model]
    command += ["--port", str(port), "--parallel", str(args.parallel)]
    command += ["--ctx-size", str(args.ctx_size), "--backend", args.backend]
    if args.threads:
        command += ["--threads", str(args.threads)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = {"url": f"http://127.0.0.1:{port}", "exit_code": None}
    url = server["url"]
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"fastrun serve exited with {proc.returncode}; log: {log.name}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.25)
        print(f"server: {' '.join(command[2:])} (log: {log.name})", flush=True)
        yield server
    finally:
        proc.terminate()
        server["exit_code"] = proc.wait(timeout=60)
        print(f"server exited with {server['exit_code']} on SIGTERM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (127.0.0.1 only); default: start one")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--ctx-size", type=int, default=512)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cancel", type=float, default=0.2, help="share of cancelled streams")
    parser.add_argument("--overlong", type=float, default=0.05, help="share of overlong prompts")
    parser.add_argument("--malformed", type=float, default=0.05, help="share of bad bodies")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds, whole phase")
    parser.add_argument("--rss-slack-mb", type=float, default=50.0)
    parser.add_argument("--throughput-clients", type=int, default=0)
    parser.add_argument("--throughput-tokens", type=int, default=128)
    parser.add_argument("--bench-tps", type=float, help="fastrun bench --parallel N's tok/s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.url:
        if urlparse(args.url).hostname not in LOOPBACK:
            sys.exit("load_test: only a server on 127.0.0.1 (or localhost) is allowed")
        ok = asyncio.run(main_async(args, args.url))
    else:
        with started_server(args) as server:
            ok = asyncio.run(main_async(args, server["url"]))
        if server["exit_code"] != 0:
            print("FAIL: the server did not exit 0 on SIGTERM")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
