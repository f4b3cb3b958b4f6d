"""The Numba CPU backend."""

from fastrun.backends.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
