"""The CLI from a subprocess, as scripts use it: clean stdout, one error line, exit codes."""

import json
import subprocess
import sys

import pytest


def fastrun(*args, input=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "fastrun.runner.cli", *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
    )


def test_version_and_help():
    r = fastrun("--version")
    assert r.returncode == 0 and r.stdout.startswith("fastrun ")
    for cmd in ("info", "pull", "run", "chat", "serve", "quantize", "perplexity"):
        r = fastrun(cmd, "--help")
        assert r.returncode == 0, (cmd, r.stderr)


def test_info_json(smollm2_path):
    r = fastrun("info", str(smollm2_path), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["architecture"] == "llama" and data["vocab_size"] == 49152
    assert data["tensor_types"]["Q4_1"] == 210 and data["chat_template"] is True
    assert 130e6 < data["parameters"] < 140e6


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "/no/such/file.gguf"], "no such file"),
        (["info", "no-such-model"], "unknown model"),
        (["info", "--bogus", "x"], "No such option"),
        (["info", "pyproject.toml"], "not a GGUF file"),
    ],
)
def test_user_errors_are_one_line(args, message):
    r = fastrun(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastrun: error: ") and message in lines[0]


def test_pull_list():
    r = fastrun("pull", "--list")
    assert r.returncode == 0 and "smollm2-135m-instruct" in r.stdout


def test_run_json_from_a_subprocess(smollm2_path):
    r = fastrun(
        "run", str(smollm2_path), "The capital of France is", "-n", "8", "--temp", "0", "--json"
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {
        "text",
        "tokens",
        "prompt_tokens",
        "finish_reason",
        "context_shifts",
        "timings",
    }
    assert (
        data["prompt_tokens"] == 5
        and len(data["tokens"]) == 8
        and data["finish_reason"] == "length"
    )
    assert data["timings"]["decode_tokens_per_second"] > 0
    assert "Paris" in data["text"]


def test_run_streams_text_only_and_reads_stdin(smollm2_path):
    r = fastrun(
        "run", str(smollm2_path), "-", "-n", "6", "--temp", "0", input="The capital of France is"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("Paris")
    r2 = fastrun("run", str(smollm2_path), "-", "-n", "6", "--temp", "0", "--chat",
                 input="Say hi")  # fmt: skip
    assert r2.returncode == 0 and r2.stdout.strip()


def test_run_user_errors(smollm2_path, tmp_path):
    long_prompt = "word " * 300
    r = fastrun("run", str(smollm2_path), long_prompt, "-c", "64")
    assert r.returncode == 2 and "context holds 64" in r.stderr and r.stdout == ""
    r = fastrun("run", str(smollm2_path), "hi", "--no-such-flag")
    assert r.returncode == 2 and r.stderr.startswith("fastrun: error: No such option")
    from helpers import write_tiny_model

    other = write_tiny_model(tmp_path / "m.gguf", arch="mamba")
    r = fastrun("run", str(other), "hi")
    assert r.returncode == 2 and "unsupported architecture 'mamba'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_chat_in_a_terminal(smollm2_path):
    """Two turns, a Ctrl-C in the middle of a reply (the session goes on), then Ctrl-D."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable, ["-m", "fastrun.runner.cli", "chat", str(smollm2_path), "--temp", "0",
                         "-n", "400"],
        encoding="utf-8", timeout=120, dimensions=(40, 200),
    )  # fmt: skip
    try:
        _chat_session(child, pexpect)
    except (pexpect.EOF, pexpect.TIMEOUT) as e:
        raise AssertionError(
            f"chat session ended unexpectedly; last output:\n{child.before}"
        ) from e


def _chat_session(child, pexpect):
    child.expect(">>> ")
    child.sendline("What is the capital of France?")
    child.expect(">>> ")
    first = child.before
    assert "Paris" in first or len(first.strip()) > 0
    child.sendline("Write a very long story about a dragon.")
    child.expect("dragon.\r\n")  # the echo of the line typed
    child.expect(r"\w+ \w+ \w+")  # the reply has started streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"prompt (\d+) tokens \((\d+) run")
    assert int(child.match.group(2)) < int(
        child.match.group(1)
    )  # earlier turns came from the cache
    child.expect(">>> ")
    child.sendline("Thanks!")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_run_ctrl_c_exits_130(smollm2_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "fastrun.runner.cli", "run", str(smollm2_path), "Once upon a time", "-n", "2000"],
        encoding="utf-8", timeout=120,
    )  # fmt: skip
    child.expect(r"\w+ \w+ \w+")  # streaming has begun
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130


def test_cuda_backend_without_a_gpu_is_one_line(tiny_model):
    from fastrun.backends.cuda import cuda_available

    if cuda_available():
        pytest.skip("a GPU is here")
    r = fastrun("run", str(tiny_model), "hi", "--backend", "cuda")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == r.stderr.strip().splitlines()[0]
    assert "the CUDA backend needs CuPy and an NVIDIA GPU" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repeat-penalty", "0"], "repeat penalty must be above 0"),
        (["--ctx-size", "1000000000"], "for its KV cache"),
        (["--presence-penalty", "nan"], "presence penalty must be a finite number"),
        (["--seed", "-5"], "seed must be -1"),
    ],
)
def test_bad_arguments_are_one_line(tiny_model, args, message):
    r = fastrun("run", str(tiny_model), "hi", "-n", "1", "--backend", "cpu", *args)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastrun: error: ") and message in lines[0]


def test_random_seed_invalid_utf8_and_training_context(tiny_model):
    r = subprocess.run(
        [sys.executable, "-m", "fastrun.runner.cli", "run", str(tiny_model), b"hi \xff\xfe",
         "-n", "1", "--seed", "-1", "--backend", "cpu", "-c", "512"],
        capture_output=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.decode().strip().splitlines() == [
        "fastrun: warning: context size 512 is above the model's training context (256): "
        "output past it may degrade"
    ]
    r = subprocess.run(
        [sys.executable, "-m", "fastrun.runner.cli", "run", str(tiny_model), "-", "-n", "1"],
        input=b"caf\xe9 \xff", capture_output=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_info_refuses_bad_metadata_in_one_line(tiny_model, tmp_path):
    from mutants import STRING, Value, parse, serialize

    m = parse(tiny_model.read_bytes())
    m.set("tokenizer.ggml.eos_token_id", Value(STRING, "</s>"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(serialize(m))
    r = fastrun("info", str(bad))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "metadata tokenizer.ggml.eos_token_id is str '</s>', expected an integer" in r.stderr


def test_ctrl_c_during_start_up_is_one_line(tiny_model):
    """SIGINT while the modules are still importing (the console script's entry), loading or
    generating: exit 130, one line, no traceback."""
    import signal
    import time

    for delay in (0.0, 0.1, 0.3, 1.0, 2.0):
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys; from fastrun.runner.entry import main; "
             "print('up', flush=True); "
             f"sys.argv[1:] = ['run', '{tiny_model}', 'hi', '-n', '1', '--backend', 'cpu']; "
             "sys.exit(main())"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert p.stdout.readline() == "up\n"  # the console script's entry runs
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        if p.returncode in (0, -signal.SIGINT):  # done before the signal, or while exiting
            # a signal that lands after main() returned is raised in this harness's own line
            # (`-c`), outside fastrun and its handler (seen once on a loaded CI machine)
            after_main = 'File "<string>", line 1' in err and "fastrun" not in err
            assert not err.strip() or after_main, err
            continue
        assert "Traceback" not in err, err
        assert p.returncode == 130 and err.strip() == "fastrun: interrupted", (delay, err)


def test_info_leaves_other_architectures_keys_alone(tmp_path):
    """An architecture fastrun does not run may use its keys otherwise (per-layer arrays)."""
    from helpers import write_tiny_model
    from mutants import Value, parse, serialize

    from fastrun.runner.cli import model_info

    m = parse(write_tiny_model(tmp_path / "m.gguf", arch="openelm").read_bytes())
    m.set("openelm.attention.head_count_kv", Value(9, (5, [2, 2])))
    path = tmp_path / "openelm.gguf"
    path.write_bytes(serialize(m))
    info = model_info(path)
    assert info["architecture"] == "openelm" and info["runs"] is False
    assert {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"} <= set(
        info["supported_architectures"]
    )


def test_bench_after_cached_tokens(tiny_model):
    """-d fills the cache before each test, as llama-bench -d, and names the tests as it does."""
    r = fastrun("bench", str(tiny_model), "-p", "8", "-n", "4", "-r", "1", "-d", "40", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [row["test"] for row in rows] == ["pp8 @ d40", "tg4 @ d40"]
    assert all(row["depth"] == 40 and row["mean"] > 0 for row in rows)
    r = fastrun("bench", str(tiny_model), "--parallel", "1,2", "-d", "8")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--depth" in r.stderr
