"""The CuPy CUDA backend (raw CUDA kernels in .cu files)."""

from __future__ import annotations

from fastrun.formats.errors import FastrunError


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def CUDABackend(**options):  # noqa: N802 - stands in for the class until the backend lands
    raise FastrunError("the CUDA backend is not available in this build yet; use --backend cpu")
