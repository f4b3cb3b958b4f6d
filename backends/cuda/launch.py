"""Kernel launches with programmatic dependent launch (PDL) on Hopper and newer GPUs.

A kernel launched this way may start while the kernel before it in the stream is finishing:
its blocks become resident once every block of the previous kernel has passed
`griddepcontrol.launch_dependents` (pdl_trigger in launch.cuh), load what no earlier kernel
writes (weights), then wait in `griddepcontrol.wait` (pdl_wait) for the previous kernel to
complete. In a captured decode step that hides most of the gap between its ~300 small
kernels (SmolLM2's step replays in 0.73 ms instead of 0.98 ms). CuPy's launch call takes no
launch attributes, so this calls the driver's cuLaunchKernelEx through ctypes; FASTRUN_PDL=0
turns it off.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager

import cupy as cp
import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
MIN_COMPUTE_CAPABILITY = 90  # griddepcontrol: sm_90


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)),
        ("n_attrs", ctypes.c_uint),
    ]


_SCALARS = {
    np.int32: ctypes.c_int32,
    np.int64: ctypes.c_int64,
    np.uint64: ctypes.c_uint64,
    np.float32: ctypes.c_float,
    np.float64: ctypes.c_double,
}


def _driver():
    """The driver's cuLaunchKernelEx, or None where PDL is off or unavailable."""
    if os.environ.get("FASTRUN_PDL", "1") == "0":
        return None
    if int(cp.cuda.Device().compute_capability) < MIN_COMPUTE_CAPABILITY:
        return None
    try:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return launch


class Launcher:
    """kernel(grid, block, args) for a CuPy RawKernel: through cuLaunchKernelEx with the PDL
    attribute while a graph is being recorded (`recording()`) and the device has it, else
    through CuPy (whose launch costs the host about 20 us less than this ctypes call)."""

    def __init__(self):
        self._launch = _driver()
        self._attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed
        self._recording = False

    @property
    def enabled(self) -> bool:
        return self._launch is not None

    def disable(self) -> None:
        """Launch through CuPy from now on (graphs captured before keep their PDL edges)."""
        self._launch = None

    @contextmanager
    def recording(self):
        """Launches in this block use PDL (a graph keeps the overlap for every replay)."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def __call__(
        self, kernel: cp.RawKernel, grid: tuple, block: tuple, args: tuple, shared: int = 0
    ) -> None:
        """Launch with `shared` bytes of dynamic shared memory."""
        if self._launch is None or not self._recording:
            kernel(grid, block, args, shared_mem=shared)
            return
        values = [_argument(a) for a in args]
        pointers = (ctypes.c_void_p * len(values))(
            *(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values)
        )
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        config = _Config(
            grid=(ctypes.c_uint * 3)(*grid),
            block=(ctypes.c_uint * 3)(*block),
            shared_bytes=shared,
            stream=cp.cuda.get_current_stream().ptr,
            attrs=ctypes.pointer(self._attr),
            n_attrs=1,
        )
        status = self._launch(ctypes.byref(config), kernel.kernel.ptr, pointers, None)
        if status != 0:
            raise cp.cuda.driver.CUDADriverError(status)


def _argument(a):
    if isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    return _SCALARS[type(a)](a)
