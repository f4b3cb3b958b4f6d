"""One decode step captured as a CUDA graph and replayed for every later token.

The step's inputs (token ids and positions) live in a device buffer that each replay
overwrites first, so the graph stays valid as the sequence grows: the upload from pinned
memory is the graph's first node and the downloads of its results its last, so a step is one
launch and one wait. Attention kernels size their grids for the whole cache and read the
lengths from that buffer. Everything the step allocates comes from a private memory pool
that lives as long as the graph, so no other array can ever be handed the graph's scratch
memory.
"""

from __future__ import annotations

import weakref

import cupy as cp
import numpy as np

_RELAXED = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2)


def host_result(a: np.ndarray, copy: bool = False) -> np.ndarray:
    """A device result once on the host, as the backend hands results out: floating point as
    float32; copy: never a view of a (whose buffer is rewritten)."""
    if a.dtype.kind == "f":
        return a.astype(np.float32, copy=copy)
    return a.copy() if copy else a


def _pinned(shape: tuple, dtype) -> np.ndarray:
    """A host array in pinned memory (which graph copies may target)."""
    size, dtype = int(np.prod(shape)), np.dtype(dtype)
    pinned = cp.cuda.alloc_pinned_memory(size * dtype.itemsize)
    return np.frombuffer(pinned, dtype, size).reshape(shape)


def _pinned_like(a: cp.ndarray) -> np.ndarray:
    return _pinned(a.shape, a.dtype)


class StepGraph:
    """step(*int_vectors) -> device array(s), captured once per owner (a KV cache) for inputs of
    a fixed shape: k int32 vectors of n values each (token ids, positions, ...)."""

    def __init__(self, owner, step, k: int, n: int):
        self.owner = weakref.ref(owner)
        self.step, self.shape = step, (k, n)
        self.inputs = cp.zeros((k, n), cp.int32)
        self.host = cp.cuda.alloc_pinned_memory(k * n * 4)  # staging for the async upload
        self.staged = np.frombuffer(self.host, np.int32, k * n).reshape(k, n)
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = None
        self.many = False  # whether the step returns a tuple of arrays
        self.outs: tuple = ()  # the step's device result(s), and pinned host copies of them
        self.out_host: list[np.ndarray] = []

    def __call__(self, *vectors):
        self.staged[...] = vectors
        # after the work already queued on the current stream (a copy of cells, a prefill)
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        if self.graph is None:
            return self._capture()
        self.graph.launch(self.stream)
        self.stream.synchronize()
        return self._result([host_result(h, copy=True) for h in self.out_host])

    # through the runtime: CuPy's own copy methods refuse a capturing stream, while the
    # runtime records a copy from or to pinned memory as a node of the graph
    def _upload(self):
        rt = cp.cuda.runtime
        size, kind = self.inputs.nbytes, rt.memcpyHostToDevice
        rt.memcpyAsync(self.inputs.data.ptr, self.host.ptr, size, kind, self.stream.ptr)

    def _download(self):
        rt = cp.cuda.runtime
        for device, host in zip(self.outs, self.out_host, strict=True):
            size, kind = host.nbytes, rt.memcpyDeviceToHost
            rt.memcpyAsync(host.ctypes.data, device.data.ptr, size, kind, self.stream.ptr)

    def _result(self, arrays: list):
        return tuple(arrays) if self.many else arrays[0]

    def _capture(self):
        inputs = [self.inputs[i] for i in range(self.shape[0])]
        with self.stream, cp.cuda.using_allocator(self.pool.malloc):
            # an eager run gives this step's result and fills the pool with every buffer
            # size the step needs, so the capture below allocates nothing new
            self._upload()
            eager = self.step(*inputs)
            self.many = isinstance(eager, tuple)
            eager = eager if self.many else (eager,)
            result = self._result([host_result(cp.asnumpy(a, stream=self.stream)) for a in eager])
            self.out_host = [_pinned_like(a) for a in eager]  # the graph downloads into these
            self.stream.begin_capture(_RELAXED)
            self._upload()
            out = self.step(*inputs)
            self.outs = out if self.many else (out,)
            for device in self.outs:
                assert device.flags.c_contiguous  # the kernels write whole rows
            self._download()
            self.graph = self.stream.end_capture()
        return result


class ChainGraph(StepGraph):
    """Greedy steps chained on the device: a step's graph that ends by writing its picks over
    its own token ids and moving the positions on (the last input vector: 1 for a real token,
    0 for padding), launched once a step with no wait between. Its inputs are uploaded once,
    before the first launch, so the upload is not one of its nodes; each step's picks are
    copied to the host after its launch. One capture serves chains of every length."""

    def __init__(self, owner, step, k: int, n: int):
        super().__init__(owner, step, k, n)
        self.picks = np.empty((0, n), np.int32)  # pinned, a row per step; grows

    def __call__(self, steps: int, *vectors) -> np.ndarray:
        self.staged[...] = vectors
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        if self.graph is None:
            self._capture()
        if len(self.picks) < steps:
            self.picks = _pinned((steps, self.shape[1]), np.int32)
        rt, (picked,) = cp.cuda.runtime, self.outs
        self._upload()
        for row in self.picks[:steps]:
            self.graph.launch(self.stream)
            kind = rt.memcpyDeviceToHost
            rt.memcpyAsync(row.ctypes.data, picked.data.ptr, row.nbytes, kind, self.stream.ptr)
        self.stream.synchronize()
        return self.picks[:steps].copy()

    def _step_and_feed(self, inputs):
        picked = self.step(*inputs)
        inputs[0][...] = picked  # (int32, as the ids)
        inputs[1] += inputs[-1]
        return picked

    def _capture(self):
        inputs = [self.inputs[i] for i in range(self.shape[0])]
        with self.stream, cp.cuda.using_allocator(self.pool.malloc):
            # an eager step fills the pool (as StepGraph's); it writes the cells the first
            # launch writes again, with the same values, and its picks are not kept
            self._upload()
            self._step_and_feed(inputs)
            self.stream.begin_capture(_RELAXED)
            picked = self._step_and_feed(inputs)
            self.graph = self.stream.end_capture()
        assert picked.dtype == cp.int32 and picked.shape == (self.shape[1],)
        self.outs = (picked,)
