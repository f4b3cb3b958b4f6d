"""CPUBackend: the Backend contract on Numba kernels over memory-mapped weights."""

from __future__ import annotations

import time

import numba
import numpy as np

from fastrun.backends import block
from fastrun.backends.base import Backend, RopeConfig
from fastrun.backends.cpu import fused, matmul, ops, stack
from fastrun.backends.cpu.float_tiles import matmul_float
from fastrun.backends.cpu.threads import AdaptiveThreads, FixedThreads
from fastrun.backends.cpu.weights import CPUWeight
from fastrun.quant import dequantize

_NO_FACTORS = np.zeros(0, np.float32)


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads share a core's SIMD units)."""
    import glob
    import os

    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = set()
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"):
        cpu = int(path.split("/")[-3][3:])
        if allowed is None or cpu in allowed:
            with open(path) as fh:
                cores.add(fh.read().strip())
    return len(cores) or os.cpu_count() or 1


class _Group:
    """Weights multiplied by the same activations (Q, K, V): shared quantization if their
    formats pair with the same activation format."""

    def __init__(self, ws: list[CPUWeight]):
        self.ws = list(ws)  # held, so their ids (the cache key) cannot be reused
        fmt = ws[0].format
        same = all(
            w.format.activation == fmt.activation and w.format.block_size == fmt.block_size
            for w in ws
        )
        self.kernels = None
        if same and all(w.fusable for w in ws):
            self.kernels = np.array([w.kernel for w in ws], np.int64)
            self.formats = matmul.format_set({w.qtype for w in ws})
            self.raws = tuple(w.kernel_bytes for w in ws)
            self.block_size = fmt.block_size
            self.q8k = fmt.activation == "Q8_K"


class CPUBackend(Backend):
    """Numba kernels. Threads: OpenMP is preferred among Numba's threading layers for its
    lower cost per parallel region (about 3 us measured); TBB, then workqueue, otherwise.
    threads=N runs everything on N threads; None: passes on every physical core, decode
    steps on as many as are free (threads.AdaptiveThreads measures it)."""

    name = "cpu"
    features = frozenset(block.FEATURES)

    def __init__(self, threads: int | None = None):
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
        self._groups: dict[tuple[int, ...], _Group] = {}
        most = max(1, min(threads or physical_cores(), numba.config.NUMBA_NUM_THREADS))
        self.threads = most
        adaptive = not threads and most > 1  # one core: nothing to choose
        self.thread_policy = AdaptiveThreads(most) if adaptive else FixedThreads(most)
        self.use_on_this_thread()

    def use_on_this_thread(self):
        numba.set_num_threads(self.threads)  # Numba keeps the count per calling thread

    def run_step(self, owner, key, step, *vectors):
        """A decode step on the count the thread policy picks for steps of its size, timed
        for it; other passes (prefill) keep every thread."""
        threads = self.thread_policy.for_step(key)
        numba.set_num_threads(threads)
        try:
            start = time.perf_counter()
            out = super().run_step(owner, key, step, *vectors)
            self.thread_policy.record(key, threads, time.perf_counter() - start)
        finally:
            numba.set_num_threads(self.threads)
        return out

    def load_weight(self, raw, qtype, n_out, n_in):
        raw = np.asarray(raw).view()
        raw.flags.writeable = False  # one compiled signature: read-only weight bytes
        return CPUWeight(raw, qtype, n_out, n_in)

    def head_prefix(self, head, raw, n_out):
        # the head's own product, which the stack compiled for its formats (stack.py): no
        # compile of another
        weight = self.load_weight(raw, head.qtype, n_out, head.n_in)
        if hasattr(head, "kernel"):
            weight.formats, weight.kernel = head.formats, head.kernel
        return weight

    def load_vector(self, x):
        return np.ascontiguousarray(x, np.float32).copy()

    def zeros(self, shape):
        return np.zeros(shape, np.float32)

    def to_host(self, x):
        return np.asarray(x)

    def matmul(self, x, w):
        x = np.ascontiguousarray(x, np.float32)
        if w.qtype in ("F32", "F16", "BF16"):
            # llama.cpp rounds the activation to fp16 for fp16 weights
            out = matmul_float(w.float_tiles, x, w.qtype == "F16")
            return out if out.shape[1] == w.n_out else out[:, : w.n_out]  # tile padding off
        out = matmul.qmatmul(
            w.formats,
            w.kernel_bytes,
            x,
            w.kernel,
            w.format.block_size,
            w.format.activation == "Q8_K",
        )
        return out if out.shape[1] == w.n_out else out[:, : w.n_out]  # tile padding off

    def _group(self, ws) -> _Group:
        key = tuple(id(w) for w in ws)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(ws)
        return group

    def matmul_many(self, x, ws):
        group = self._group(ws)
        if group.kernels is None:
            return [self.matmul(x, w) for w in ws]
        x = np.ascontiguousarray(x, np.float32)
        args = (group.kernels, group.block_size, group.q8k)
        return matmul.qmatmul_many(group.formats, group.raws, x, *args)

    # -- fused steps: one compiled call each (fused.py), same arithmetic as the composition --

    def norm_matmul_many(self, x, weight, eps, ws):
        group = self._group(ws)
        if group.kernels is None:
            return super().norm_matmul_many(x, weight, eps, ws)
        x = np.ascontiguousarray(x, np.float32)
        args = (group.kernels, group.block_size, group.q8k)
        return fused.norm_qmatmul_many(group.formats, group.raws, x, weight, float(eps), *args)

    def matmul_add(self, x, w, residual):
        if not w.fusable:
            return super().matmul_add(x, w, residual)
        x = np.ascontiguousarray(x, np.float32)
        args = (w.kernel, w.format.block_size, w.format.activation == "Q8_K")
        return fused.qmatmul_add(w.formats, w.kernel_bytes, x, residual, *args)

    def silu_mul_matmul_add(self, gate, up, w, residual):
        if not w.fusable:
            return super().silu_mul_matmul_add(gate, up, w, residual)
        gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
        args = (w.kernel, w.format.block_size, w.format.activation == "Q8_K")
        return fused.silu_qmatmul_add(w.formats, w.kernel_bytes, gate, up, residual, *args)

    def attention_inputs(self, q, k, v, biases, k_cache, v_cache, positions, slots, rope):
        q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
        biases = (_NO_FACTORS,) * 3 if biases is None else tuple(biases)
        factors = _NO_FACTORS if rope.freq_factors is None else rope.freq_factors
        config = (rope.n_dims, float(rope.freq_base), float(rope.freq_scale), rope.neox)
        return fused.rope_kv(
            q,
            k,
            v,
            biases,
            k_cache,
            v_cache,
            np.ascontiguousarray(positions, np.int32),
            np.ascontiguousarray(slots, np.int32),
            config,
            np.ascontiguousarray(factors, np.float32),
        )

    def layer_stack(self, layers, eps, block, source=None, head=None):
        if not stack.supported(layers, block):
            return None
        return stack.CompiledBlocks(layers, eps, block, source, head)

    def embed(self, w, ids):
        rows = np.ascontiguousarray(w.raw[np.asarray(ids, np.int64)])
        return dequantize(rows, w.qtype, rows.shape[0] * w.n_in).reshape(-1, w.n_in)

    def rms_norm(self, x, weight, eps):
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty_like(x)
        ops.rms_norm(x, weight, float(eps), out)
        return out

    def rope(self, x, positions, rope: RopeConfig):
        factors = _NO_FACTORS if rope.freq_factors is None else rope.freq_factors
        ops.rope(
            x,
            np.ascontiguousarray(positions, np.int32),
            rope.n_dims,
            float(rope.freq_base),
            float(rope.freq_scale),
            rope.neox,
            np.ascontiguousarray(factors, np.float32),
        )
        return x

    def silu_mul(self, gate, up):
        out = np.empty_like(gate)
        ops.silu_mul(gate, up, out)
        return out

    def gelu_mul(self, gate, up):
        gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
        out = np.empty_like(gate)
        ops.gelu_mul(gate, up, out)
        return out

    def scale(self, x, factor):
        np.multiply(x, np.float32(factor), out=x)
        return x

    def softcap(self, x, cap):
        cap = np.float32(cap)
        np.multiply(np.tanh(x / cap), cap, out=x)
        return x

    def add(self, x, y):
        np.add(x, y, out=x)
        return x

    def add_bias(self, x, bias):
        np.add(x, bias, out=x)
        return x

    def kv_write(self, k_cache, v_cache, k, v, slots):
        ops.kv_store(k_cache, v_cache, k, np.ascontiguousarray(v), np.asarray(slots, np.int32))

    def attention(
        self, q, k_cache, v_cache, positions, scale, starts=None, window=0, softcap=0.0,
        ring=0, offsets=None, one_sequence=False,
    ):  # fmt: skip
        n, h, hd = q.shape
        out = np.empty((n, h, hd), np.float32)
        positions = np.ascontiguousarray(positions, np.int32)
        starts = np.zeros_like(positions) if starts is None else np.asarray(starts, np.int32)
        offsets = np.zeros_like(positions) if offsets is None else np.asarray(offsets, np.int32)
        q = np.ascontiguousarray(q)
        args = (np.float32(scale), np.int64(window), np.float32(softcap), np.int64(ring))
        threads = np.int64(numba.get_num_threads())
        ops.attention(q, k_cache, v_cache, positions, starts, *args, offsets, threads, out)
        return out.reshape(n, h * hd)


def kernels_cached() -> bool:
    """True when Numba's on-disk cache already holds compiled CPU kernels."""
    import os
    from pathlib import Path

    custom = os.environ.get("NUMBA_CACHE_DIR")
    if custom:
        return any(Path(custom).glob("**/matmul.*.nbi"))
    return any((Path(__file__).resolve().parent / "__pycache__").glob("matmul.*.nbi"))
