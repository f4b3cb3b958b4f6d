"""The `fastrun quantize` pipeline: one GGUF (or Hugging Face folder) in, a GGUF out, tensor
by tensor.

Each tensor is read from the input's memory map in slabs of rows, converted to float32,
quantized to the type its recipe picks, and streamed to the writer; at most one slab of floats
is in memory at a time. Tensors that keep their type are copied byte for byte.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from fastrun.formats import keys
from fastrun.formats.errors import FastrunError
from fastrun.formats.gguf import GGUFFile, TensorInfo
from fastrun.formats.writer import UINT32, GGUFWriter, MetadataValue, TensorSpec, metadata_of
from fastrun.quant.float_types import FLOAT_TYPES, float_rows, float_values
from fastrun.quant.formats import block_format
from fastrun.quant.numpy_quantize import BLOCK_BYTES, quantize_blocks32
from fastrun.quant.recipes import FileType, TypeChooser, file_type, llama_order

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: the block layouts of this generation
SLAB_VALUES = 1 << 20  # floats per unit of work (4 MiB): fine enough to spread over threads
# Converted output waiting for its turn to be written: enough for a small model's NumPy tensors
# to run ahead (whole) while Numba loads for its K-quant tensors; a bound on memory otherwise
WINDOW_BYTES = 256 << 20
WARM_SWITCH_INTERVAL = 3e-5  # seconds (Python's default is 5 ms): see _warm_numba


@dataclass
class QuantizeResult:
    """What a run did: sizes of the tensor data, weights, time and the types written."""

    in_bytes: int = 0
    out_bytes: int = 0
    n_weights: int = 0
    seconds: float = 0.0
    types: Counter = field(default_factory=Counter)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.out_bytes / max(1, self.n_weights)


@dataclass(frozen=True)
class TensorJob:
    source: TensorInfo
    target: TensorSpec

    @property
    def converts(self) -> bool:
        return self.source.format.id != self.target.format.id


def open_source(path: str | os.PathLike):
    """The input: a GGUF file, or a Hugging Face folder read as the GGUF that llama.cpp's
    convert_hf_to_gguf.py would make of it (formats/hf_model.py)."""
    if os.path.isdir(path):  # the Hugging Face reader's imports stay out of a GGUF run
        from fastrun.formats.hf_model import HFModel, is_hf_folder

        if is_hf_folder(path):
            return HFModel(path)
    return GGUFFile(path)


def plan(src, ftype: FileType) -> list[TensorJob]:
    """Each tensor of src (a GGUFFile or HFModel) with the type it gets, in the order
    llama.cpp's tools write them: llama-quantize's, or for a Hugging Face folder and a type the
    converter writes itself, the converter's."""
    names = llama_order(src.tensors)  # the mixes' layer counters count in this order
    arch = src.architecture
    n_layer = int(src.get(keys.BLOCK_COUNT, 0) or 0)
    n_head = src.get(keys.HEAD_COUNT)
    n_head_kv = src.get(keys.HEAD_COUNT_KV, n_head)
    chooser = TypeChooser(
        ftype,
        names,
        arch,
        n_layer,
        n_expert=int(src.get("{arch}.expert_count", 0) or 0),
        is_70b=arch == "llama" and n_layer == 80 and n_head != n_head_kv,
    )
    jobs = []
    for name in names:
        info = src.tensors[name]
        fmt = chooser.choose(name, info.shape, info.format)
        jobs.append(TensorJob(info, TensorSpec(name, info.shape, fmt)))
    if ftype.name in getattr(src, "direct_file_types", ()):
        position = {name: i for i, name in enumerate(src.tensors)}
        jobs.sort(key=lambda job: position[job.source.name])
    return jobs


def output_metadata(src, ftype: FileType) -> dict[str, MetadataValue]:
    """The input's metadata with file type and quantization version set (appended last, as
    llama-quantize does) and the split keys of a multi-part input dropped."""
    meta = metadata_of(src) if isinstance(src, GGUFFile) else src.metadata_values()
    for key in (*keys.SPLIT_KEYS, keys.QUANTIZATION_VERSION, keys.FILE_TYPE):
        meta.pop(key, None)
    meta[keys.QUANTIZATION_VERSION] = MetadataValue(UINT32, QUANTIZATION_VERSION)
    meta[keys.FILE_TYPE] = MetadataValue(UINT32, ftype.id)
    return meta


_dequantize_lock = threading.Lock()  # quant.fast's dequantizers are parallel Numba kernels


def _dequantized(raw: np.ndarray, fmt_name: str, n: int) -> np.ndarray:
    from fastrun.quant.fast import dequantize

    with _dequantize_lock:
        return dequantize(raw, fmt_name, n)


def _slab_bytes(job: TensorJob, slab: np.ndarray) -> np.ndarray:
    """One slab of rows of a tensor in its target type (runs on a worker thread)."""
    if not job.converts:
        return slab
    rows, n_cols = slab.shape[0], job.source.shape[0]
    source, target = job.source.format.name, job.target.format.name
    if target in FLOAT_TYPES:  # NumPy alone: no Numba to import, no kernels to load
        if source in FLOAT_TYPES:
            x = float_values(slab, source)
        else:
            x = _dequantized(slab, source, rows * n_cols)
        return float_rows(x.reshape(rows, n_cols), target)
    if target in BLOCK_BYTES:  # NumPy alone, as above; F16 is widened chunk by chunk
        if source in FLOAT_TYPES:
            x = float_values(slab, source, widen=source != "F16")
        else:
            x = _dequantized(slab, source, rows * n_cols)
        return quantize_blocks32(x.reshape(rows, n_cols), target)
    from fastrun.quant.fast_quantize import quantize_rows

    if source in FLOAT_TYPES:
        x = float_values(slab, source)
    else:
        x = _dequantized(slab, source, rows * n_cols)
    return quantize_rows(x.reshape(rows, n_cols), target)


def _slabs(src, jobs: list[TensorJob]):
    """(job, slab of raw rows) for every tensor, in file order."""
    for job in jobs:
        data = src.tensor_bytes(job.source.name)
        n_rows, n_cols = job.source.matrix_shape
        step = max(1, SLAB_VALUES // n_cols)
        for r0 in range(0, n_rows, step):
            yield job, data[r0 : r0 + step]


def _needs_numba(job: TensorJob) -> bool:
    """Whether a job's slabs run Numba kernels (K-quant searches, dequantizing a block type)."""
    if not job.converts:
        return False
    return job.target.format.name not in (*FLOAT_TYPES, *BLOCK_BYTES) or (
        job.source.format.name not in FLOAT_TYPES
    )


def _warm_numba(jobs: list[TensorJob]) -> None:
    """Import Numba and load the cached kernels the jobs will call, on a side thread while the
    workers convert the tensors NumPy does alone. Both are mostly Python holding the GIL, so the
    interval at which waiting threads get it back is shortened meanwhile: a worker needs it for a
    moment between NumPy calls that run without it."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(WARM_SWITCH_INTERVAL)
    try:
        from fastrun.quant.fast_quantize import quantize_rows

        for name in {j.target.format.name for j in jobs if _needs_numba(j)} - set(BLOCK_BYTES):
            if name not in FLOAT_TYPES:
                n = block_format(name).block_size
                quantize_rows(np.zeros((1, n), np.float32), name)
    finally:
        sys.setswitchinterval(interval)


def _after(ready: Future | None, pool: ThreadPoolExecutor, fn, *args) -> Future:
    """fn(*args) on the pool once `ready` is done, without holding a worker while waiting."""
    if ready is None or ready.done():
        return pool.submit(fn, *args)
    result: Future = Future()

    def start(_) -> None:
        if result.cancelled():
            return
        try:
            inner = pool.submit(fn, *args)
        except RuntimeError as e:  # the pool shut down meanwhile (an error elsewhere)
            result.set_exception(e)
            return
        inner.add_done_callback(lambda f: _pass_on(f, result))

    ready.add_done_callback(start)
    return result


def _pass_on(done: Future, to: Future) -> None:
    if to.cancelled():
        return
    if done.exception() is not None:
        to.set_exception(done.exception())
    else:
        to.set_result(done.result())


def _convert_all(src, jobs: list[TensorJob], writer: GGUFWriter, threads: int, advance):
    """Convert slabs on `threads` workers, a bounded window ahead, and write them in order.
    Slabs that need Numba wait for it to load (on a side thread) without holding a worker, so
    the window runs ahead on the NumPy tensors meanwhile."""
    window: deque = deque()
    pending = 0  # bytes of output in the window
    warm = ThreadPoolExecutor(max_workers=1) if any(_needs_numba(j) for j in jobs) else None
    numba_ready = warm.submit(_warm_numba, jobs) if warm is not None else None
    with ThreadPoolExecutor(max_workers=threads) as pool:
        try:
            for job, slab in _slabs(src, jobs):
                ready = numba_ready if _needs_numba(job) else None
                n_bytes = slab.shape[0] * job.target.format.row_bytes(job.source.shape[0])
                window.append((job, _after(ready, pool, _slab_bytes, job, slab), n_bytes))
                pending += n_bytes
                while len(window) > 2 * threads and pending > WINDOW_BYTES:
                    pending -= _write_done(window.popleft(), writer, advance)
            while window:
                _write_done(window.popleft(), writer, advance)
        except BaseException:
            for _, future, _ in window:
                future.cancel()
            raise
        finally:
            if warm is not None:
                warm.shutdown(wait=False)


def _write_done(item, writer: GGUFWriter, advance) -> int:
    """Write one slab once converted; its size in bytes."""
    job, future, n_bytes = item
    out = future.result()
    writer.write_tensor(job.target.name, out)
    advance(out.size // job.target.format.block_bytes * job.target.format.block_size, job)
    return n_bytes


def quantize_model(
    src_path: str | os.PathLike,
    dst_path: str | os.PathLike,
    type_name: str,
    allow_requantize: bool = False,
    progress=None,
    threads: int | None = None,
) -> QuantizeResult:
    """Quantize src_path into dst_path (written atomically) on `threads` threads (default:
    the CPU count). progress, if given, has `start(total_weights)` and
    `advance(n_weights, tensor_name)`."""
    ftype = file_type(type_name)
    if os.path.abspath(src_path) == os.path.abspath(dst_path):
        raise FastrunError("the output would overwrite the input; choose another output path")
    start = time.perf_counter()
    result = QuantizeResult()
    with open_source(src_path) as src:
        jobs = plan(src, ftype)
        for job in jobs:
            name = job.source.format.name
            if job.converts and name not in FLOAT_TYPES and not allow_requantize:
                raise FastrunError(
                    f"{os.path.basename(src_path)} is already quantized ({job.source.name} is "
                    f"{name}); pass --allow-requantize to convert it anyway"
                )
        total = sum(j.source.n_elements for j in jobs)
        if progress is not None:
            progress.start(total)
        writer = GGUFWriter(dst_path, output_metadata(src, ftype), [j.target for j in jobs])

        def advance(n: int, job: TensorJob) -> None:
            if progress is not None:
                progress.advance(n, job.source.name)

        with writer:
            _convert_all(src, jobs, writer, threads or os.cpu_count() or 1, advance)
        for job in jobs:
            result.in_bytes += job.source.n_bytes
            result.out_bytes += job.target.n_bytes
            result.n_weights += job.source.n_elements
            result.types[job.target.format.name] += 1
    result.seconds = time.perf_counter() - start
    return result
