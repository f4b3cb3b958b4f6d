"""A first run's kernels compiled on two cores instead of one.

Numba compiles one function at a time, holding a lock for the whole process, and compiling
the blocks' stack (stack.run_blocks) is most of a first run: 15 s on 2 cores, against half a
second once Numba's cache holds it. So where the cache lacks them, a second process compiles
the stack's kernels that do not depend on the model's weight formats (attention, RoPE and the
cache store, the residual branch, the gating) into the same cache, while this one compiles
the format-specific products. Whenever this process comes to compile one of the second
process's kernels, it waits until that one is in the cache, then loads it from there.

The signatures are the ones run_blocks calls these kernels with, whatever the model (every
run_blocks argument has one type: see stack.py); tests/test_side_compile.py checks that they
still are. A kernel the second process did not finish (it failed, or was killed) this one
compiles as it would have anyway.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

from fastrun.backends.cpu.cache import in_cache

GATINGS = {"silu": "silu_mul", "gelu_tanh": "gelu_mul"}


def _kernels(activation: str, formats: tuple[str, ...]) -> list[tuple[str, object, tuple]]:
    """(name, dispatcher, signature) of the kernels the second process compiles, in the order
    this one first calls them: run_blocks's format-independent ones, then the output head's
    product for the layers' and head's weight formats `formats` (none: the head has a float
    format, or no product of its own). The head's product compiles the product kernel that
    run_blocks calls too, which it then loads from the cache this process made of it."""
    from numba import typeof, types

    from fastrun.backends.cpu import fused, matmul, ops, stack

    vector, rows, heads = (types.Array(types.float32, d, "C") for d in (1, 2, 3))
    cache = heads  # one layer's [rows, hk, hd] of a [layers, rows, hk, hd] cache
    int_rows = types.Array(types.int32, 1, "C")  # positions, slots, starts, ring offsets
    rope_config = types.Tuple((types.int64, types.float64, types.float64, types.boolean))
    i64, f32 = types.int64, types.float32
    gating = GATINGS[activation]
    kernels = [
        ("rope_kv", fused.rope_kv, (rows, rows, rows, types.UniTuple(vector, 3), cache, cache,
                                    int_rows, int_rows, rope_config, vector)),
        ("attention", ops.attention, (heads, cache, cache, int_rows, int_rows, f32, i64, f32,
                                      i64, int_rows, i64, heads)),
        ("_add_branch", stack._add_branch, (rows, rows, vector, types.float64)),
        (gating, getattr(ops, gating), (rows, rows, rows)),
    ]  # fmt: skip
    if formats:
        tiles = types.Array(types.uint8, 2, "C", readonly=True)  # memory-mapped
        format_set = typeof(matmul.format_set(formats))
        head = (format_set, tiles, rows, i64, i64, types.boolean)
        kernels.append(("qmatmul", matmul.qmatmul, head))
    return kernels


class SideCompile:
    """The second process, and this process's kernels waiting on it."""

    def __init__(self, activation: str, formats: tuple[str, ...], kernels: list):
        self._done: set[str] = set()
        # this process's import path: the same fastrun, however this one found it
        path = os.pathsep.join(p for p in sys.path if p)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "fastrun.backends.cpu.side_compile", activation, *formats],
            env=dict(os.environ, PYTHONPATH=path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        _RUNNING.append(self)
        atexit.register(self.stop)
        for name, dispatcher, _ in kernels:
            self._wait_before_compiling(name, dispatcher)

    def _wait_before_compiling(self, name: str, dispatcher) -> None:
        compile_here = dispatcher.compile

        def compile_after_the_side(sig):
            dispatcher.__dict__.pop("compile", None)  # once: Numba's own method again
            self.wait_for(name)
            return compile_here(sig)  # now a load from the cache, where the side made it

        dispatcher.compile = compile_after_the_side

    def wait_for(self, name: str) -> None:
        """Until the second process has cached kernel `name`, or has ended."""
        out = self._process.stdout
        while name not in self._done and out is not None:
            line = out.readline()
            if not line:  # it ended (or failed): whatever is left compiles here
                self.stop()
                return
            self._done.add(line.strip())

    def stop(self) -> None:
        """The second process ended (killed if still compiling: at exit, say)."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
            self._process.stdout = None


_RUNNING: list[SideCompile] = []


def stop_all() -> None:
    """Every second process this one started, ended (an interrupted start's exit)."""
    for side in _RUNNING:
        side.stop()


def start(activation: str, formats: tuple[str, ...] = ()) -> SideCompile | None:
    """A SideCompile (see _kernels for the arguments) where Numba's cache lacks any of
    run_blocks's format-independent kernels and a second core is free to compile them; else
    None (a warm start: the stack loads from the cache)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) < 2:
        return None
    kernels = _kernels(activation, formats)
    if all(in_cache(dispatcher) for _, dispatcher, _ in kernels[: len(kernels) - bool(formats)]):
        return None
    try:
        return SideCompile(activation, formats, kernels)
    except OSError:
        return None


def main(activation: str, formats: tuple[str, ...]) -> None:
    """The second process: each kernel compiled into the cache, its name printed when done."""
    for name, dispatcher, sig in _kernels(activation, formats):
        dispatcher.compile(sig)
        print(name, flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1], tuple(sys.argv[2:]))
    except (KeyboardInterrupt, BrokenPipeError):
        pass
