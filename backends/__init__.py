"""Backends: the contract (base), the NumPy reference, the Numba CPU and the CuPy CUDA backends."""

from __future__ import annotations

from fastrun.backends.base import Backend, RopeConfig, Weight
from fastrun.formats.errors import FastrunError

__all__ = ["Backend", "RopeConfig", "Weight", "get_backend"]


def get_backend(name: str = "cpu", **options) -> Backend:
    """A backend by name: cpu, reference, cuda, or auto (CUDA when CuPy finds a GPU; the CPU's
    options, such as threads, then apply only if it is the CPU)."""
    if name == "auto":
        from fastrun.backends.cuda import cuda_available

        name = "cuda" if cuda_available() else "cpu"
        if name == "cuda":
            options.pop("threads", None)
    if name == "cpu":
        from fastrun.backends.cpu import CPUBackend

        return CPUBackend(**options)
    if name == "reference":
        from fastrun.backends.reference import ReferenceBackend

        return ReferenceBackend()
    if name == "cuda":
        from fastrun.backends.cuda import CUDABackend

        return CUDABackend(**options)
    raise FastrunError(f"unknown backend {name!r} (cpu, cuda, auto, reference)")
