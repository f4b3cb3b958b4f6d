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
    for cmd in ("info", "pull", "run", "chat"):
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
