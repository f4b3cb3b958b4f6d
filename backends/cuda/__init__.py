"""The CuPy CUDA backend: raw CUDA kernels in .cu files, decode steps as CUDA graphs."""

from __future__ import annotations

MIN_COMPUTE_CAPABILITY = 80  # int8 mma.sync m16n8k32 (Ampere and newer)


def cuda_available() -> bool:
    """True when CuPy imports and its first GPU can run the kernels."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return False
        return int(cupy.cuda.Device(0).compute_capability) >= MIN_COMPUTE_CAPABILITY
    except Exception:  # no CuPy, no driver, no device
        return False


def require_cuda() -> None:
    """Raise the one-line error a user sees when the CUDA backend cannot run here."""
    from fastrun.formats.errors import FastrunError

    if not cuda_available():
        raise FastrunError(
            "the CUDA backend needs CuPy and an NVIDIA GPU of compute capability 8.0 or newer "
            "(pip install 'fastrun[cuda12]' or 'fastrun[cuda13]'); use --backend cpu"
        )


def CUDABackend(**options):  # noqa: N802 - imports CuPy only when a GPU backend is asked for
    require_cuda()
    from fastrun.backends.cuda.backend import CUDABackend as Backend

    return Backend(**options)
