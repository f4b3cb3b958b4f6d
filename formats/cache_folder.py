"""Where fastrun keeps what it derives from a model file once, to skip that work at later
loads: the CPU backend's repacked tiles (backends/cpu/tile_cache.py) and the tokenizer's
decoded vocabulary (runner/vocab_cache.py). $FASTRUN_TILE_CACHE (default
$XDG_CACHE_HOME/fastrun/tiles; "off" disables both)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder() -> Path | None:
    """The folder of the derived files; None when disabled."""
    setting = os.environ.get("FASTRUN_TILE_CACHE")
    if setting is not None:
        return None if setting.lower() in ("", "0", "off") else Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastrun" / "tiles"
