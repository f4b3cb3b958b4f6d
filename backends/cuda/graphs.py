"""One decode step captured as a CUDA graph and replayed for every later token.

The step's inputs (token ids and positions) live in a device buffer that each replay
overwrites first, so the graph stays valid as the sequence grows; attention kernels size
their grids for the whole cache and read the lengths from that buffer. Everything the step
allocates comes from a private memory pool that lives as long as the graph, so no other
array can ever be handed the graph's scratch memory.
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
        self.inputs.data.copy_from_host_async(self.host.ptr, self.inputs.nbytes, self.stream)
        if self.graph is None:
            return self._capture()
        self.graph.launch(self.stream)
        for device, host in zip(self.outs, self.out_host, strict=True):
            device.data.copy_to_host_async(host.ctypes.data, host.nbytes, self.stream)
        self.stream.synchronize()
        return self._result([host_result(h, copy=True) for h in self.out_host])

    def _result(self, arrays: list):
        return tuple(arrays) if self.many else arrays[0]

    def _capture(self):
        inputs = [self.inputs[i] for i in range(self.shape[0])]
        with self.stream, cp.cuda.using_allocator(self.pool.malloc):
            # an eager run gives this step's result and fills the pool with every buffer
            # size the step needs, so the capture below allocates nothing new
            eager = self.step(*inputs)
            self.many = isinstance(eager, tuple)
            eager = eager if self.many else (eager,)
            result = self._result([host_result(cp.asnumpy(a, stream=self.stream)) for a in eager])
            self.stream.begin_capture(_RELAXED)
            out = self.step(*inputs)
            self.graph = self.stream.end_capture()
        self.outs = out if self.many else (out,)
        for device in self.outs:
            assert device.flags.c_contiguous  # the kernels write whole rows
            pinned = cp.cuda.alloc_pinned_memory(device.nbytes)
            host = np.frombuffer(pinned, device.dtype, device.size)
            self.out_host.append(host.reshape(device.shape))
        return result
