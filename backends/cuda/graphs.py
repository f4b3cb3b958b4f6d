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


def _pinned_like(a: cp.ndarray) -> np.ndarray:
    """A host array of a's shape and type in pinned memory (which graph copies may target)."""
    pinned = cp.cuda.alloc_pinned_memory(a.nbytes)
    return np.frombuffer(pinned, a.dtype, a.size).reshape(a.shape)


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
