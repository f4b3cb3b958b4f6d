"""A first run's second compiling process (backends/cpu/side_compile.py): what it compiles are
the very kernels the blocks' stack and the output head call, so that this process loads them
from the cache instead of compiling them again."""

import json
import os
import subprocess
import sys

import pytest
from helpers import write_tiny_model

# In a fresh Numba cache: a llama model (SiLU), then a Gemma 3 one (GELU, head norms, ring
# layers); for each kernel the side process compiled, this process's cache misses and hits.
SCRIPT = """
import json, sys
import numpy as np
from fastrun.backends import get_backend
from fastrun.backends.cpu import fused, matmul, ops, stack
from fastrun.formats.gguf import GGUFFile
from fastrun.runner.models import model_class

kernels = {"rope_kv": fused.rope_kv, "attention": ops.attention, "_add_branch": stack._add_branch,
           "silu_mul": ops.silu_mul, "gelu_mul": ops.gelu_mul, "qmatmul": matmul.qmatmul}
report = {}
for path in sys.argv[1:]:
    f = GGUFFile(path)
    tf = model_class(f.architecture)(f, get_backend("cpu", threads=1))
    assert tf._stack is not None and tf._stack._side_compile is not None, path
    tf.forward(list(range(1, 20)), tf.new_cache(32))
for name, kernel in kernels.items():
    report[name] = [sum(kernel.stats.cache_misses.values()), sum(kernel.stats.cache_hits.values())]
print(json.dumps(report))
"""


def _run(tmp_path, models, **env) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), **env)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, models)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the side process needs a second core")
def test_the_stack_loads_what_the_side_process_compiled(tmp_path):
    llama = write_tiny_model(tmp_path / "llama.gguf", qtype="Q4_0", n_layer=2)
    gemma = write_tiny_model(tmp_path / "gemma.gguf", arch="gemma3", qtype="Q8_0", n_layer=6)
    report = _run(tmp_path, [llama, gemma])
    for name in ("rope_kv", "attention", "_add_branch", "silu_mul", "gelu_mul", "qmatmul"):
        misses, hits = report[name]
        assert misses == 0, f"{name}: compiled here, not loaded: its side signature is stale"
        assert hits >= 1, f"{name}: never loaded from the cache"
