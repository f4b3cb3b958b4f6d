"""`fastrun serve`: the HTTP layer in-process against a fake engine (errors, logprobs, metrics,
loading), then the real server in a subprocess through the official `openai` client."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastrun.formats.errors import FastrunError  # noqa: E402
from fastrun.runner.engine import QueueFull  # noqa: E402
from fastrun.runner.generate import Completion, Token  # noqa: E402
from fastrun.runner.server import ServerState, create_app  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m-instruct"
# One CPU thread: on a busy 2-core machine OpenMP's second thread waits on the first far more
# than it helps (8x slower decoding measured); the Python API reference uses the same.
SPEED = ["--backend", "cpu", "--threads", "1"]


# -- in-process, a fake engine with the engine's API ---------------------------------------------


class FakeStream:
    """Echoes the prompt's characters back, each with a logprob when asked for."""

    def __init__(self, ids, max_tokens=256, logprobs=None, **sampling):
        self.ids = ids[:max_tokens]
        self.logprobs = logprobs
        self.completion = Completion(prompt_tokens=len(ids), prefilled_tokens=len(ids))
        self.closed = False

    def __iter__(self):
        for i in self.ids:
            piece = Token(chr(i), i)
            piece.logprob = -0.5 if self.logprobs is not None else None
            piece.top_logprobs = [(i, -0.5), (i + 1, -1.5)][: self.logprobs] or None
            self.completion.tokens.append(i)
            self.completion.text += piece
            yield piece
        self.completion.finish_reason = "length"

    def close(self):
        self.closed = True


class FakeTokenizer:
    n_vocab = 1000


class FakeEngine:
    n_ctx = 64
    tokenizer = FakeTokenizer()

    def __init__(self):
        self.queue_full = False
        self.last_sampling = None

    def tokenize(self, text, add_bos=None, special=False):
        return [ord(c) for c in text]

    def chat_prompt(self, messages):
        return self.tokenize("".join(m["content"] for m in messages))

    def detokenize(self, ids):
        return "".join(chr(i) for i in ids)

    def generate(self, ids, **sampling):
        if self.queue_full:
            raise QueueFull("64 waiting")
        if not ids:
            raise FastrunError("the prompt is empty")
        self.last_sampling = sampling
        return FakeStream(ids, **sampling)

    def stats(self):
        return {"active": 0, "queued": 0, "parallel": 4, "n_ctx": self.n_ctx}

    def close(self):
        pass


@pytest.fixture
def fake():
    from starlette.testclient import TestClient

    engine = FakeEngine()
    release = threading.Event()

    def load():
        release.wait(10)
        return engine

    app = create_app(ServerState(load), "fake", api_key=KEY, max_body_bytes=4096)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503  # loading
        release.set()
        for _ in range(100):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        yield client, engine


def chat_body(**fields):
    return {"model": "fake", "messages": [{"role": "user", "content": "hello"}], **fields}


def test_fake_chat_and_completion_bodies(fake):
    client, engine = fake
    r = client.post("/v1/chat/completions", headers=AUTH, json=chat_body(max_tokens=3, seed=-1))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hel"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert engine.last_sampling["max_tokens"] == 3 and engine.last_sampling["seed"] >= 0
    body = {"prompt": "abc", "temperature": 0, "some_future_field": {"x": 1}}  # unknown: ignored
    r = client.post("/v1/completions", headers=AUTH, json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
    assert engine.last_sampling["max_tokens"] == FakeEngine.n_ctx - 3  # default: to the context


def test_fake_stream_with_logprobs_and_usage(fake):
    client, _ = fake
    body = chat_body(stream=True, logprobs=True, top_logprobs=1,
                     stream_options={"include_usage": True})  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", headers=AUTH, json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "hello"
    scored = chunks[1]["choices"][0]["logprobs"]["content"]
    h = {"token": "h", "logprob": -0.5, "bytes": [104]}
    assert scored == [{**h, "top_logprobs": [h]}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "ab", "logprobs": 2})
    legacy = r.json()["choices"][0]["logprobs"]
    assert legacy["tokens"] == ["a", "b"] and legacy["text_offset"] == [0, 1]
    assert legacy["top_logprobs"][1] == {"b": -0.5, "c": -1.5}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", {"model": "x"}, "messages"),
        ("/v1/chat/completions", chat_body(n=2), "n"),
        ("/v1/chat/completions", chat_body(tools=[{"type": "function"}]), "tools"),
        ("/v1/chat/completions", chat_body(temperature="hot"), "temperature"),
        ("/v1/chat/completions", chat_body(top_logprobs=2), "top_logprobs"),
        (
            "/v1/chat/completions",
            chat_body(response_format={"type": "json_object"}),
            "response_format",
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            chat_body(stream_options={"include_usage": True}),
            "stream_options",
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),  # fmt: skip
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 5000]}, "prompt"),  # not in the vocabulary
        ("/v1/completions", {"prompt": "x" * 100}, "prompt"),  # over the fake's 64 tokens
    ],
)
def test_fake_bad_bodies_are_400_with_openai_errors(fake, path, body, param):
    client, _ = fake
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, headers=AUTH, content=data)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if path == "/v1/completions" and param == "prompt" and "x" in str(body):
        assert error["code"] == "context_length_exceeded" and "100 tokens" in error["message"]


def test_fake_auth_size_limit_queue_full_and_routes(fake):
    client, engine = fake
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
    r = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    big = chat_body(messages=[{"role": "user", "content": "x" * 5000}])
    assert client.post("/v1/chat/completions", headers=AUTH, json=big).status_code == 413
    engine.queue_full = True
    r = client.post("/v1/chat/completions", headers=AUTH, json=chat_body())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "unavailable_error"
    assert client.get("/nowhere").json()["error"]["type"] == "not_found_error"
    assert client.get("/v1/chat/completions", headers=AUTH).status_code == 405
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "fake" and models["data"][0]["meta"]["parallel"] == 4
    metrics = client.get("/metrics", headers=AUTH).text
    assert 'fastrun_requests_total{endpoint="/v1/chat/completions",status="503"} 1' in metrics
    for name in ("fastrun_active_sequences 0", "fastrun_queued_sequences 0",
                 "fastrun_time_to_first_token_seconds_count", "fastrun_tokens_per_second",
                 "fastrun_prompt_tokens_total", "process_resident_memory_bytes"):  # fmt: skip
        assert name in metrics


def test_fake_stats_and_speculative_metrics(fake):
    client, engine = fake
    drafts = {"kind": "lookup", "rounds": 4, "drafted_tokens": 12, "accepted_tokens": 9,
              "acceptance_rate": 0.75, "mean_accepted_length": 2.25}  # fmt: skip
    engine.stats = lambda: {**FakeEngine.stats(engine), "speculative": drafts}
    assert client.get("/stats").status_code == 401
    assert client.get("/stats", headers=AUTH).json()["speculative"] == drafts
    metrics = client.get("/metrics", headers=AUTH).text
    expected = (
        "fastrun_drafted_tokens_total 12",
        "fastrun_accepted_tokens_total 9",
        "fastrun_draft_acceptance_rate 0.75",
        "fastrun_mean_accepted_length 2.25",
    )
    assert all(line in metrics for line in expected)


# -- the real server in a subprocess -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model, *args, tmp_path):
    port = free_port()
    log = open(tmp_path / f"serve-{port}.log", "w+")
    command = [sys.executable, "-m", "fastrun.runner.cli", "serve", str(model), "--port",
               str(port), "--api-key", KEY, "--ctx-size", "512", *SPEED, *args]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a fresh checkout compiles the CPU kernels first
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(log.name).read()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from helpers import real_model

    path = real_model(MODEL)
    with serve(MODEL, tmp_path=tmp_path_factory.mktemp("serve")) as (proc, url):
        yield url, path


@pytest.fixture(scope="module")
def reference(server):
    """Greedy texts from the Python API, the same chat template and engine."""
    import fastrun

    model = fastrun.load(server[1], backend="cpu", n_ctx=512, threads=1)
    cache = {}

    def greedy(messages=None, prompt=None, max_tokens=6):
        key = json.dumps([messages, prompt, max_tokens])
        if key not in cache:
            settings = dict(temperature=0, max_tokens=max_tokens)
            stream = (
                model.chat(messages, **settings) if messages else model.generate(prompt, **settings)
            )
            cache[key] = "".join(stream)
        return cache[key]

    yield greedy
    model.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_streamed_chat_equals_the_python_api(client, reference):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(QUESTION)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens > 6


def test_whole_chat_and_completions_equal_the_python_api(client, reference):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=6
    )
    assert reply.choices[0].message.content == reference(QUESTION)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    prompt = "The three primary colors are"
    done = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    assert done.choices[0].text == reference(prompt=prompt)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=6, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reference(prompt=prompt)


QUESTIONS = ("What is 2+2?", "Name a color.", "Say hi.", "What is the capital of France?",
             "Count to three.", "Name a fruit.", "What is water?", "Say goodbye.")  # fmt: skip


def concurrent_answers(client, n_clients: int):
    def ask(messages):
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=6, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    questions = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                 for i in range(n_clients)]  # fmt: skip
    with ThreadPoolExecutor(n_clients) as pool:
        return questions, list(pool.map(ask, questions))


def test_logprobs_of_a_greedy_reply(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    scored = reply.choices[0].logprobs.content
    assert len(scored) == 4 and "".join(t.token for t in scored) == reply.choices[0].message.content
    for entry in scored:  # greedy: each token is its step's most likely one
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_concurrent_greedy_clients_equal_their_serial_text(client, reference):
    questions, answers = concurrent_answers(client, 4)
    assert answers == [reference(q, max_tokens=6) for q in questions]


@pytest.mark.slow
def test_16_concurrent_greedy_clients_equal_their_serial_text(client, reference):
    questions, answers = concurrent_answers(client, 16)
    assert answers == [reference(q, max_tokens=6) for q in questions]


def test_errors_through_the_openai_client(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=2)
    long = [{"role": "user", "content": "hello " * 600}]
    with pytest.raises(openai.BadRequestError, match=r"the prompt has \d+ tokens.*holds 512"):
        client.chat.completions.create(model=MODEL, messages=long)


def first_words(lines) -> None:
    """Read a stream up to its first generated text."""
    next(line for line in lines if '"content":"' in line and '"content":""' not in line)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_models_health_metrics_and_a_disconnect_cancels(server, client):
    url = server[0]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    cancelled = metric(url, "fastrun_cancelled_generations_total")
    # 400 tokens whatever the model says: a few seconds on a CPU, so the client below gives up
    body = {"messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json=body,
                      timeout=120) as r:  # fmt: skip
        first_words(r.iter_lines())
    with pytest.raises(httpx.ReadTimeout):  # a whole answer's client gives up waiting
        httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=body | {"stream": False},
                   timeout=1.0)  # fmt: skip
    for _ in range(300):  # the engine frees the sequences at its next step
        if metric(url, "fastrun_active_sequences") == 0:
            break
        time.sleep(0.1)
    assert metric(url, "fastrun_active_sequences") == 0
    assert metric(url, "fastrun_cancelled_generations_total") == cancelled + 2
    assert metric(url, 'fastrun_requests_total{endpoint="/v1/models",status="200"}') >= 1
    assert metric(url, "fastrun_generated_tokens_total") > 0


def test_prompt_lookup_server_answers_as_plain_decoding(reference, tmp_path):
    """`serve --lookup`: greedy text as without speculation; drafts counted in /stats."""
    with serve(MODEL, "--lookup", tmp_path=tmp_path) as (proc, url):
        lookup = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Repeat exactly: one two three, one two three."}]
        reply = lookup.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=24
        )
        assert reply.choices[0].message.content == reference(messages, max_tokens=24)
        stats = httpx.get(f"{url}/stats", headers=AUTH).json()["speculative"]
        assert stats["kind"] == "lookup" and stats["drafted_tokens"] > 0
        assert metric(url, "fastrun_drafted_tokens_total") == stats["drafted_tokens"]


def test_full_queue_503_then_sigterm_ends_open_streams_and_exits_0(tmp_path):
    from helpers import real_model

    real_model(MODEL)
    with serve(MODEL, "--parallel", "1", "--max-queue", "1", tmp_path=tmp_path) as (proc, url):
        # long enough not to end before the SIGTERM, however fast decoding is (no EOS)
        body = {"messages": QUESTION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with contextlib.ExitStack() as streams:

            def open_stream():
                return streams.enter_context(httpx.stream(
                    "POST", f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=120
                ))  # fmt: skip

            running = open_stream().iter_lines()
            first_words(running)
            waiting = open_stream()  # the one sequence is busy: this one waits in the queue
            r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
            proc.send_signal(signal.SIGTERM)
            assert [line for line in running if line][-1] == "data: [DONE]"
            assert [line for line in waiting.iter_lines() if line][-1] == "data: [DONE]"
        assert proc.wait(timeout=30) == 0
