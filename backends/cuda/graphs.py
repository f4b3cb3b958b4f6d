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
    """step(*int_vectors) -> device array, captured once per owner (a KV cache) for inputs of
    a fixed shape: k int32 vectors of n values each (token ids, positions, ...)."""

    def __init__(self, owner, step, k: int, n: int):
        self.owner = weakref.ref(owner)
        self.step, self.shape = step, (k, n)
        self.inputs = cp.zeros((k, n), cp.int32)
        self.host = cp.cuda.alloc_pinned_memory(k * n * 4)  # staging for the async upload
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = None
        self.out = None

    def __call__(self, *vectors) -> np.ndarray:
        staged = np.frombuffer(self.host, np.int32, self.inputs.size).reshape(self.shape)
        staged[...] = vectors
        inputs = [self.inputs[i] for i in range(self.shape[0])]
        with self.stream, cp.cuda.using_allocator(self.pool.malloc):
            self.inputs.data.copy_from_host_async(self.host.ptr, self.inputs.nbytes, self.stream)
            if self.graph is None:
                # an eager run gives this step's result and fills the pool with every buffer
                # size the step needs, so the capture below allocates nothing new
                result = cp.asnumpy(self.step(*inputs), stream=self.stream)
                self.stream.begin_capture(_RELAXED)
                self.out = self.step(*inputs)
                self.graph = self.stream.end_capture()
                return result.astype(np.float32, copy=False)
            self.graph.launch(self.stream)
            return cp.asnumpy(self.out, stream=self.stream).astype(np.float32, copy=False)
