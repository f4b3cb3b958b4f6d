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
        self.out = None  # the step's device result(s), and pinned host copies of them
        self.out_host: list[np.ndarray] = []

    def __call__(self, *vectors):
        self.staged[...] = vectors
        self.inputs.data.copy_from_host_async(self.host.ptr, self.inputs.nbytes, self.stream)
        if self.graph is None:
            return self._capture()
        self.graph.launch(self.stream)
        outs = self.out if isinstance(self.out, tuple) else (self.out,)
        for device, host in zip(outs, self.out_host, strict=True):
            device.data.copy_to_host_async(host.ctypes.data, host.nbytes, self.stream)
        self.stream.synchronize()
        results = tuple(self._readable(h) for h in self.out_host)
        return results if isinstance(self.out, tuple) else results[0]

    def _capture(self):
        inputs = [self.inputs[i] for i in range(self.shape[0])]
        with self.stream, cp.cuda.using_allocator(self.pool.malloc):
            # an eager run gives this step's result and fills the pool with every buffer
            # size the step needs, so the capture below allocates nothing new
            result = self._to_host(self.step(*inputs))
            self.stream.begin_capture(_RELAXED)
            self.out = self.step(*inputs)
            self.graph = self.stream.end_capture()
        outs = self.out if isinstance(self.out, tuple) else (self.out,)
        for device in outs:
            assert device.flags.c_contiguous  # the kernels write whole rows
            pinned = cp.cuda.alloc_pinned_memory(device.nbytes)
            host = np.frombuffer(pinned, device.dtype, device.size)
            self.out_host.append(host.reshape(device.shape))
        return result

    @staticmethod
    def _readable(host: np.ndarray) -> np.ndarray:
        """A copy the caller may keep (the pinned buffer is rewritten by the next replay)."""
        return host.astype(np.float32) if host.dtype.kind == "f" else host.copy()

    def _to_host(self, out):
        """The step's device array, or tuple of arrays, on the host (float as float32)."""
        if isinstance(out, tuple):
            return tuple(map(self._to_host, out))
        host = cp.asnumpy(out, stream=self.stream)
        return host.astype(np.float32, copy=False) if host.dtype.kind == "f" else host
