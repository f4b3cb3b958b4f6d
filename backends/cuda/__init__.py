"""The CuPy CUDA backend: raw CUDA kernels in .cu files, decode steps as CUDA graphs."""

from __future__ import annotations


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def require_cuda() -> None:
    """Raise the one-line error a user sees when the CUDA backend cannot run here."""
    from fastrun.formats.errors import FastrunError

    if not cuda_available():
        raise FastrunError(
            "the CUDA backend needs CuPy and an NVIDIA GPU "
            "(pip install 'fastrun[cuda12]' or 'fastrun[cuda13]'); use --backend cpu"
        )


def CUDABackend(**options):  # noqa: N802 - imports CuPy only when a GPU backend is asked for
    require_cuda()
    from fastrun.backends.cuda.backend import CUDABackend as Backend

    return Backend(**options)
