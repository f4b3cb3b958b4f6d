"""CUDABackend: the Backend contract on CuPy RawModule kernels (matmul.cu, ops.cu).

Weights are repacked once on the device (weights.py); activations are float32 CuPy arrays; the
KV cache is fp16. Matrix products of up to DENSE_ROWS - 1 tokens quantize the activation to 8
bits as llama.cpp's CPU path pairs it with the weight format, so they match the NumPy
reference backend; larger batches (prefill) go through cuBLAS in fp16.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from fastrun.backends import block
from fastrun.backends.base import Backend, RopeConfig, Weight
from fastrun.backends.cuda.graphs import ChainGraph, StepGraph, host_result
from fastrun.backends.cuda.launch import Launcher
from fastrun.backends.cuda.weights import FLOAT_FORMATS, KERNEL_FORMATS, repack, with_slack
from fastrun.backends.reference import rope_angles
from fastrun.formats.errors import FastrunError

SOURCES = Path(__file__).resolve().parent
MATVEC_TOKENS = (1, 2, 4, 8)  # a matvec kernel per count of tokens in a block
# matvec tuning, "rows per warp,groups in flight per lane at one token" (MV_ROWS, MV_UNROLL1);
# one row a warp doubles the blocks of small products (H200 decode steps: SmolLM2 0.631 ms
# against 0.655 at "2,4", Llama-2-7B 1.90 against 1.98)
MATVEC_TUNING = tuple(int(v) for v in os.environ.get("FASTRUN_MATVEC", "1,4").split(","))
MATVEC_ROWS = 8 * MATVEC_TUNING[0]  # weight rows per matvec block: 8 warps (matmul.cu)
# up to this many tokens: the dp4a matvec; from one more, the int8 tensor-core kernel
MATVEC_BATCH = int(os.environ.get("FASTRUN_MATVEC_BATCH", "4"))
# Products of 2..SMALL_BATCH tokens (checking passes of speculation, small batches) take
# matvec_tile (matmul.cu): each weight read once for all of them, the results bit-identical
# per token to the one-token matvec's. 0 turns it off: then the dp4a matvec up to
# MATVEC_BATCH tokens, the tensor-core kernel above, as before. 4 by default: measured on the
# H200 (scripts/gpu_kernel_check.py, 2026-12-02), matvec_tile wins at 2-4 tokens and the
# tensor-core kernel from 5 (at 16 tokens it gives 3982 tok/s of batched decode, matvec_tile 1707).
SMALL_BATCH = int(os.environ.get("FASTRUN_SMALL_BATCH", "4"))
# its shapes, "tokens a block:rows a warp:groups in flight a lane[:warps a block]" for each
# bucket of tokens (a product of n tokens takes the first that holds n, or blocks of the
# last), the warps a block where a shape names none, and the most bytes of a block's
# activations staged in shared memory (more: read through L1). 8 warps a block for 2
# tokens: H200, 7B Q4_0 shape, a checking pass's products alone (gpu_pass_profile.py
# products, eleventh session) 1.726 -> 1.636 ms, every shape faster (QKV 0.394 -> 0.382,
# O 0.216 -> 0.199, gate-up 0.601 -> 0.584, down 0.487 -> 0.445 ms for 32 copies), the pass
# 1.32 -> 1.26x a decode step; 16 warps exceed the kernel's launch bounds. A weight that
# would fill fewer blocks than the GPU has SMs keeps SMALL_WARPS (SmolLM2's and Qwen-1.5B's
# small products measured within their noise either way). "4:2:1:8" took the 7B shape's 3
# and 4 tokens from 2.141 / 2.440 to 1.918 / 2.182 ms, but matmul_chains takes those where
# K % 256 == 0 (1.87), and SmolLM2's (K = 576) looked slower: not taken.
SMALL_TILES = tuple(
    tuple(int(v) for v in tile.split(":"))
    for tile in os.environ.get("FASTRUN_SMALL_TILES", "2:2:2:8,4:2:2,8:4:1,16:4:1").split(",")
)
SMALL_WARPS = int(os.environ.get("FASTRUN_SMALL_WARPS", "4"))
SMALL_STAGE = int(os.environ.get("FASTRUN_SMALL_STAGE", str(100 * 1024)))
# From FEW_MMA_FROM tokens up to SMALL_BATCH (0: never), matmul_few instead: tensor cores,
# the weights loaded straight into registers (near matvec_q's results, not bit-identical),
# blocks of FEW_MMA_WARPS warps, FEW_MMA_UNROLL groups a lane in flight
FEW_MMA_FROM = int(os.environ.get("FASTRUN_FEW_MMA_FROM", "0"))
FEW_MMA_WARPS = int(os.environ.get("FASTRUN_FEW_MMA_WARPS", "8"))
FEW_MMA_UNROLL = 4
# Products of more than SMALL_BATCH and up to EXACT_BATCH tokens take matmul_exact
# (matmul.cu) instead of the tensor-core matmul_mma: int8 tensor cores too, and every token's
# result bit for bit the one-token matvec_q's (its float sums in matvec_q's order), so with
# matvec_tile below them a checking pass computes the numbers one-token steps do. Off (0) by
# default: on the H200 it is slower than matmul_mma (7B Q4_0 checking passes of 5-8 tokens
# 1.84-1.98x a decode step against 1.57-1.72x, 9 tokens 2.40x against 1.76x; batched decode
# of 16 sequences 3045 tok/s against 4041; BENCHMARKS.md, eighth session), and speed comes
# first. FASTRUN_EXACT_BATCH=16 makes every product of 2..16 tokens exact.
# EXACT_TUNING: "rounds of loads in flight a warp,blocks an SM must hold" (EXACT_ROUNDS,
# EXACT_MIN_BLOCKS; 2 or 4 rounds, or one block, were slower).
EXACT_BATCH = int(os.environ.get("FASTRUN_EXACT_BATCH", "0"))
# A pass over one sequence's 2..EXACT_PASS_TOKENS tokens (Backend.one_sequence: speculation's
# checking pass) computes every token's numbers bit for bit as a one-token step does, so that
# greedy speculation gives plain decoding's tokens (issue #19): matvec_tile (2 tokens),
# matmul_chains (3..8), matmul_exact (9..16) where rows hold whole 8-group chunks, else the
# dp4a matvec (matvec_q, in matvec_q's order for any count of tokens); attention by
# attn_split, each query split as a one-token step splits it. 0: the faster kernels of any
# batch (matmul_mma from 5 tokens, attn_few), whose last bits differ from a step's: on the
# real SmolLM2 two of four prompts then left plain decoding's greedy output (H200, 2026-12-04).
EXACT_PASS_TOKENS = int(os.environ.get("FASTRUN_EXACT_PASSES", "16"))
EXACT_TUNING = tuple(int(v) for v in os.environ.get("FASTRUN_EXACT", "1,2").split(","))
# Products of CHAINS[0]..CHAINS[1] tokens (2..8 at most) take matmul_chains (matmul.cu):
# matmul_mma's tensor-core pipeline with the float work in matvec_q's order, every token's
# result bit for bit the one-token matvec's, where the rows hold whole 8-group chunks
# (K % 256 == 0; else matvec_tile or matmul_mma as below). H200, 7B Q4_0 shape, a pass's
# products alone (scripts/gpu_pass_profile.py products, ninth session): 1.87-1.90 ms at 2..8
# tokens against matvec_tile's 1.73 (2), 2.14 (3), 2.44 (4) and the inexact matmul_mma's
# 1.44, so by default 3..4. CHAIN_SM_WARPS: the warps an SM must hold (caps the registers:
# 128 at 16; 20, 96 registers, was 5 % slower).
CHAINS = tuple(int(v) for v in os.environ.get("FASTRUN_CHAINS", "3,4").split(","))
CHAIN_SM_WARPS = int(os.environ.get("FASTRUN_CHAIN_SM_WARPS", "16"))
# one token through matvec_tile as well, "rows a warp:groups in flight:warps a block" (empty:
# matvec_q, tuned by FASTRUN_MATVEC)
ONE_TILE = tuple(int(v) for v in os.environ.get("FASTRUN_MATVEC1_TILE", "").split(":") if v)
# from this many tokens on: weights to fp16, then cuBLAS (fp16 activations)
DENSE_ROWS = int(os.environ.get("FASTRUN_DENSE_ROWS", "128"))
# The tensor-core kernel (matmul.cu): MMA_SM_WARPS, the warps an SM must hold (caps its
# registers: 80 at 24), in blocks of MMA_WARPS warps (they split K; the wider kind where every
# block is resident at once, _mma_warps), each streaming its chunks through a ring of tiles
# in MMA_SM_SHARED bytes of shared memory an SM (the rest stays L1 for the activations).
# H200, 7B shape, 16 sequences, graph replay a step: "4,12" 3.83 ms, "8,12" 3.88; 16 warps
# an SM ("4,8", "8,16") 3.94-3.99, 32 ("8,16") 4.01; one tile a warp instead of two 3.93;
# earlier designs: activation chunks staged in shared memory beside the weights 4.02, warps
# splitting rows around one shared activation tile (K split across blocks) 4.93
MMA_SM_WARPS = int(os.environ.get("FASTRUN_MMA_SM_WARPS", "24"))
# products of up to MMA_ONE_FRAGMENT tokens compute only the first 8-token fragment of the
# block's 16-token tile (half the mma and float work; 0: both fragments always)
MMA_ONE_FRAGMENT = int(os.environ.get("FASTRUN_MMA_ONE_FRAGMENT", "8"))
MMA_WARPS = tuple(int(v) for v in os.environ.get("FASTRUN_MMA_WARPS", "4,12").split(","))
MMA_SM_SHARED = int(os.environ.get("FASTRUN_MMA_SHARED", str(160 * 1024)))
MMA_CHUNK = 128  # bytes of a row's plane 0 per chunk (matmul.cu)
MMA_MAX_STAGES = 4  # tiles in a warp's copy ring at most (matmul.cu)
MMA_TOKENS = 16  # tokens per tensor-core block
EXACT_WARPS = 8  # matmul_exact's warps a block (matmul.cu)
MMA_ROW_GROUPS = 8  # the tensor-core kernel takes rows of whole 8-group chunks (matmul.cu)
ATTN_MIN_SHARE = 64  # the fewest cache positions worth an attention split of their own
# attn_split's blocks an SM must hold (ops.cu; caps its registers, which change no result)
ATTN_MIN_BLOCKS = int(os.environ.get("FASTRUN_ATTN_MIN_BLOCKS", "1"))
ATTN_MAX_SPLITS = 128  # at most as many splits as the merge's threads (ops.cu)
ATTN_TILE, ATTN_TILE_DIMS = 64, (64, 128, 256)  # prefill attention: queries a tile; head dims
HOST_VECTORS = 16  # host int vectors kept on the device by content (_ints)
# attention splits: enough for about this many blocks (one query; a batch of queries), each
# split at least a round of loads (7B shape, 16 sequences: 256 blocks 4.96 ms a step, 4096 6.05)
ATTN_BLOCKS = (512, int(os.environ.get("FASTRUN_ATTN_BLOCKS", "256")))
# a pass of 2..ATTN_FEW[0] queries (speculation's checking pass: mostly one sequence's, whose
# cache rows stay in L2) splits for about ATTN_FEW[1] blocks: with 256, the 9 queries of a 7B
# checking pass got one split each, every block walking the whole cache alone
ATTN_FEW = tuple(
    int(os.environ.get(name, default))
    for name, default in (("FASTRUN_ATTN_FEW_TOKENS", "9"), ("FASTRUN_ATTN_FEW_BLOCKS", "2048"))
)
# A pass of 2..ATTN_GROUP[0] queries (at most ATTN_GROUP_MAX) takes attn_group (ops.cu): one
# block for all of them a head and split, each round's K and V rows read once for the queries
# of one sequence, every query's numbers as attn_split gives them alone; splits for about
# ATTN_GROUP[1] blocks, as a one-token step's (ATTN_BLOCKS[0]), so a checking pass splits the
# cache as a step does. Off (0) by default: its blocks take their queries one after another,
# and on the H200 (7B Q4_0 shape, 512 cached tokens, ninth session) checking passes were
# slower with it, 9 tokens 2.22x a decode step against 1.78x with attn_split.
ATTN_GROUP = tuple(
    int(os.environ.get(name, default))
    for name, default in (("FASTRUN_ATTN_GROUP", "0"), ("FASTRUN_ATTN_GROUP_BLOCKS", "512"))
)
ATTN_GROUP_MAX = 16  # attn_group's most queries (ops.cu)
# A pass of ATTN_ONE_SEQUENCE[0]..ATTN_FEW_QUERIES queries of one sequence (a checking pass)
# takes attn_few (ops.cu): one block a head and split for all the queries, each chunk of
# cached rows read once for them, split for about ATTN_ONE_SEQUENCE[1] blocks, then
# attn_few_merge. From 5 tokens: the passes whose products are not a step's bit for bit
# either (2-4 keep attn_split, whose numbers are a step's). H200, 7B Q4_0, 512 cached tokens:
# passes of 5-8 tokens 1.37-1.53 -> 1.29-1.33x a decode step, 9: 1.78 -> 1.59.
ATTN_ONE_SEQUENCE = tuple(
    int(os.environ.get(name, default))
    for name, default in (("FASTRUN_ATTN_FEW_FROM", "5"), ("FASTRUN_ATTN_FEW_SPLITS", "512"))
)
ATTN_FEW_QUERIES, ATTN_FEW_CHUNK = 16, 32  # attn_few's most queries; rows a staged chunk
# A decode step whose every token is its sequence's only one takes its projections into
# attn_split raw: each block rotates its query, the last split of each stores the new K and V
# rows, and rope_kv is a launch a layer fewer (0: rope_kv always). H200, 7B Q4_0, graph
# replay: one sequence 1.911 -> 1.855 ms at depth 512, 1.856 -> 1.788 at 16; sixteen at 512
# 4.055 -> 3.987; Q4_K one at 512 2.172 -> 2.112. Not for
# checking passes: a block that rotates several rows before its loads made attn_split (2
# tokens) 4.8 us and attn_few (8) 12.7 us a layer slower, more than rope_kv's launch.
ROPE_IN_ATTENTION = int(os.environ.get("FASTRUN_ROPE_IN_ATTENTION", "1"))
GRAPH_MAX_TOKENS = 64  # the largest decode step captured as a graph (step_size)
# greedy decode steps chained on the device (Backend.chain_steps, run_chain): the host's turn
# between steps (the wait, the Python around a step) is paid once for them (1: none chained)
CHAIN_STEPS = max(1, int(os.environ.get("FASTRUN_CHAIN_STEPS", "8")))
# steps of up to this many tokens are captured at their own size, not padded to a power of
# two: a checking pass of 9 tokens computes 9, not 16 (0: powers of two throughout)
GRAPH_EXACT = int(os.environ.get("FASTRUN_GRAPH_EXACT", "16"))
SELECT_CHUNK, SELECT_MAX = 4096, 64  # logits per top_k block; the largest k (select.cu)
SELECT_LISTS = 128  # the most chunks a row's merge takes (select.cu: 4 lists a lane)
_i32 = np.int32
# cuBLAS's enums for gemmEx (library_types.h, cublas_api.h)
_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1
_NULL = np.uint64(0)  # a null pointer argument


class CUDAWeight(Weight):
    """A weight matrix as device planes (formats.cuh describes them)."""

    def __init__(self, planes: list, qtype: str, n_out: int, n_in: int):
        self.planes, self.qtype, self.n_out, self.n_in = planes, qtype, n_out, n_in
        self.kernel_format = KERNEL_FORMATS.get(qtype)  # None: a float weight
        self.per_256 = qtype.endswith("_K")  # activation quantized per 256 (Q8_K)

    def plane_args(self) -> tuple:
        return tuple(self.planes) + (self.planes[0],) * (6 - len(self.planes))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)


@dataclass(frozen=True)
class QuantizedRows:
    """Float rows [n, k] and the same rows in 8 bits per 32 values (_activation's layout),
    both written by one kernel: the attention's output, whose projection by a weight of a
    32-value block format then needs no quantization of its own. A backend value: model code
    hands it to matmul or matmul_add as it is."""

    values: cp.ndarray
    act: tuple  # (xq, xd, xs)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


class _Kernels:
    """The compiled modules; NVRTC compiles them on first use and CuPy caches the binaries."""

    def __init__(self):
        rows, unroll = MATVEC_TUNING
        options = ("-std=c++17", f"-I{SOURCES}", f"-DMV_ROWS={rows}", f"-DMV_UNROLL1={unroll}")
        options += (f"-DMMA_SM_WARPS={MMA_SM_WARPS}", f"-DCHAIN_SM_WARPS={CHAIN_SM_WARPS}")
        options += (f"-DATTN_MIN_BLOCKS={ATTN_MIN_BLOCKS}",)
        options += (f"-DEXACT_ROUNDS={EXACT_TUNING[0]}", f"-DEXACT_MIN_BLOCKS={EXACT_TUNING[1]}")
        names = []
        for f in KERNEL_FORMATS.values():
            names += [f"matvec_q<{f}, {t}>" for t in MATVEC_TOKENS]
            names += [f"matmul_mma<{f}, {w}, {nf}>" for w in MMA_WARPS for nf in (1, 2)]
            names += [f"embed_q<{f}>", f"dequant_f16<{f}>"]
            names += [f"matvec_tile<{f}, {r}, {t}, {u}>" for t, r, u in small_tiles()]
            names += [f"matmul_few<{f}, {nf}, {FEW_MMA_UNROLL}>" for nf in (1, 2)]
            names += [exact_name(f, n) for n in (8, 16)] + [f"matmul_chains<{f}, 1>"]
        for t in ("__half", "float"):
            names += [f"matvec_f<{t}, {n}>" for n in MATVEC_TOKENS] + [f"embed_f<{t}>"]
        self.matmul = cp.RawModule(
            code=(SOURCES / "matmul.cu").read_text(), options=options, name_expressions=names
        )
        self.ops = cp.RawModule(code=(SOURCES / "ops.cu").read_text(), options=options)
        self.select = cp.RawModule(code=(SOURCES / "select.cu").read_text(), options=options)
        self.launch = Launcher()
        self._shared_optin = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
        self._cache: dict[str, Callable] = {}

    def __call__(self, name: str) -> Callable:
        """The kernel as kernel(grid, block, args), launched with PDL where the GPU has it."""
        kernel = self._cache.get(name)
        if kernel is None:
            if "<" in name or name.startswith(("quantize", "dense")):
                module = self.matmul
            else:
                module = self.select if name == "top_k" else self.ops
            function = module.get_function(name)
            if name.startswith(
                ("matmul_mma", "matmul_chains", "attn_tiles", "attn_group", "attn_few")
            ):
                # past 48 KB: what the static shared memory leaves of the opt-in limit
                function.max_dynamic_shared_size_bytes = (
                    self._shared_optin - function.shared_size_bytes
                )
            elif name.startswith("matvec_tile"):
                function.max_dynamic_shared_size_bytes = self._shared_optin
            kernel = self._cache[name] = partial(self.launch, function)
        return kernel


def _tensor_cores(n: int, n_in: int, exact_pass: bool = False) -> bool:
    """Whether products of n tokens with rows of n_in weights take a tensor-core kernel,
    whose activations are tiled (quantize.cuh); else a matvec or cuBLAS. exact_pass: the
    products of a one-sequence pass (_exact_pass)."""
    if _exact(n, n_in, exact_pass) or _few_mma(n) or _chains(n, n_in, exact_pass):
        return True
    if _takes_tile(n):
        return False
    return MATVEC_BATCH < n < DENSE_ROWS and n_in % (32 * MMA_ROW_GROUPS) == 0


def _exact(n: int, n_in: int, exact_pass: bool = False) -> bool:
    """Whether a quantized product of n tokens takes matmul_exact (above matvec_tile's; in a
    one-sequence pass, above matmul_chains' 8 tokens where rows hold whole chunks)."""
    if max(SMALL_BATCH, 1) < n <= EXACT_BATCH:
        return True
    return exact_pass and 8 < n <= EXACT_PASS_TOKENS and n_in % (32 * MMA_ROW_GROUPS) == 0


def exact_name(kernel_format: str, n: int) -> str:
    """matmul_exact's instance for products of n tokens: one 8-token fragment up to 8, two
    above."""
    return f"matmul_exact<{kernel_format}, {1 if n <= 8 else 2}>"


def exact_launch(w: CUDAWeight, n: int):
    """(kernel name, grid, block) of matmul_exact for n tokens with w: blocks of 16 rows and
    a tile of MMA_TOKENS tokens."""
    grid = (-(-w.n_out // 16), -(-n // MMA_TOKENS))
    return exact_name(w.kernel_format, n), grid, (32 * EXACT_WARPS,)


def _chains(n: int, n_in: int, exact_pass: bool = False) -> bool:
    """Whether a quantized product of n tokens with rows of n_in weights takes matmul_chains
    (in a one-sequence pass: 3..8 tokens)."""
    last = 8 if exact_pass and n <= EXACT_PASS_TOKENS else min(CHAINS[1], 8)
    fits = max(CHAINS[0], 2) <= n <= last and n_in % (32 * MMA_ROW_GROUPS) == 0
    return fits and not _exact(n, n_in, exact_pass)


def _few_mma(n: int) -> bool:
    """Whether a quantized product of n tokens takes matmul_few."""
    return 0 < FEW_MMA_FROM <= n <= SMALL_BATCH and n > 1


def _takes_tile(n: int) -> bool:
    """Whether a quantized product of n tokens takes matvec_tile."""
    return (1 < n <= SMALL_BATCH and not _few_mma(n)) or (n == 1 and bool(ONE_TILE))


def few_mma_launch(w: CUDAWeight, n: int, warps: int, unroll: int):
    """(kernel name, grid, block) of matmul_few for n tokens (tiles of 16) with w, in blocks
    of `warps` warps (at most 8: its shared memory holds 8 warps' partial sums)."""
    fragments = 1 if n <= 8 else 2  # of 8 tokens
    name = f"matmul_few<{w.kernel_format}, {fragments}, {unroll}>"
    return name, (-(-w.n_out // 16), -(-n // 16)), (32 * min(warps, 8),)


def small_tiles() -> list[tuple[int, int, int]]:
    """(tokens a block, rows a warp, groups in flight) of every matvec_tile the backend may
    launch: SMALL_TILES, and ONE_TILE's for one token."""
    tiles = [tile[:3] for tile in SMALL_TILES]
    if ONE_TILE:
        tiles.append((1, ONE_TILE[0], ONE_TILE[1]))
    return tiles


def tile_launch(w: CUDAWeight, n: int, tile: tuple[int, int, int], warps: int, stage_max: int):
    """(kernel name, grid, block, shared bytes, stage) of matvec_tile for n tokens with w in
    blocks of `tile` (tokens, rows a warp, groups in flight) and `warps` warps; the block's
    activations staged in shared memory where they take at most stage_max bytes."""
    tokens, rows, unroll = tile
    grid = (-(-w.n_out // (warps * rows)), -(-n // tokens))
    shared = min(tokens, n) * (w.n_in + 8 * (w.n_in // 32))  # int8 values, d and s a group
    stage = shared <= stage_max
    name = f"matvec_tile<{w.kernel_format}, {rows}, {tokens}, {unroll}>"
    return name, grid, (32 * warps,), shared if stage else 0, stage


def _mma_ring(w: CUDAWeight, warps: int, sm_warps: int = 0) -> tuple[int, int]:
    """(stages, dynamic shared bytes) of the tensor-core kernel for w: as many tiles a warp as
    it has chunks, within MMA_SM_SHARED for an SM's warps and MMA_MAX_STAGES (one at least)."""
    groups = w.n_in // 32
    per_chunk = MMA_CHUNK * groups // (w.planes[0].nbytes // w.n_out)  # groups in a chunk
    tile = 0  # ChunkTile<F>::BYTES: 16 rows of each plane's part of a chunk
    for plane in w.planes:
        row = plane.nbytes // w.n_out  # bytes; a per-super-block plane's value: a word a row
        tile += 64 if row < groups else 16 * row // groups * per_chunk
    tile = (tile + 15) // 16 * 16
    chunks_per_warp = -(-(groups // per_chunk) // warps)
    fit = MMA_SM_SHARED // ((sm_warps or MMA_SM_WARPS) * tile)
    stages = max(1, min(MMA_MAX_STAGES, chunks_per_warp, fit))
    return stages, max(warps * stages * tile, warps * 8 * 32 * 4)  # or the partial sums


def _activation(n: int, k: int, tiled: bool) -> tuple:
    """Room for n rows of k values quantized to 8 bits: (xq, xd, xs) as quantize.cuh lays them
    out; tiled rounds n up to whole tiles of MMA_TOKENS tokens."""
    if tiled:
        n = (n + MMA_TOKENS - 1) // MMA_TOKENS * MMA_TOKENS
    groups = n * k // 32
    return cp.empty((n, k), cp.int8), cp.empty(groups, cp.float32), cp.empty(groups, cp.float32)


def _float_name(qtype: str) -> str:
    return "__half" if qtype == "F16" else "float"


class CUDABackend(Backend):
    """Raw CUDA kernels through CuPy; one device, one stream (CuPy's current one)."""

    name = "cuda"
    features = frozenset(block.FEATURES)
    chain_steps = CHAIN_STEPS
    batch_invariant = False
    captures_steps = True

    def __init__(self, device: int = 0):
        self.device = device
        try:
            cp.cuda.Device(device).use()
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise FastrunError(f"no usable CUDA device {device}: {e}") from None
        self.k = _Kernels()
        self._fused: dict[tuple[int, ...], CUDAWeight] = {}  # holds the fused members too
        self._rope_tables: dict[tuple, tuple] = {}
        self._exact_pass = False  # inside one_sequence(): a one-sequence pass's products
        self._graphs: dict[tuple, StepGraph] = {}
        # per (query, head) counters of finished attention splits; the last block resets its
        # own, so they are zero between launches (one buffer for good: graphs hold its address)
        self._tickets = cp.zeros(1 << 17, cp.int32)
        self._select_tickets = cp.zeros(1 << 10, cp.int32)  # likewise, per row of top_k
        self._sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._host_vectors: dict[bytes, cp.ndarray] = {}  # _ints, oldest first

    @contextmanager
    def one_sequence(self, on: bool = True):
        """Backend.one_sequence: the products of a pass of 2..EXACT_PASS_TOKENS tokens take the
        kernels that give each token a one-token step's bits (_exact_pass; the attention
        knows from its own one_sequence argument)."""
        before, self._exact_pass = self._exact_pass, on and EXACT_PASS_TOKENS > 1
        try:
            yield
        finally:
            self._exact_pass = before

    def use_on_this_thread(self):
        cp.cuda.Device(self.device).use()  # CuPy's current device is per thread

    # -- data movement ----------------------------------------------------------------------

    def load_weight(self, raw, qtype, n_out, n_in):
        if qtype not in KERNEL_FORMATS and qtype not in FLOAT_FORMATS:
            raise FastrunError(f"the CUDA backend has no matmul for {qtype} weights")
        try:
            return CUDAWeight(repack(raw, qtype, n_out, n_in), qtype, n_out, n_in)
        except cp.cuda.memory.OutOfMemoryError:
            free, total = cp.cuda.runtime.memGetInfo()
            raise FastrunError(
                f"the model does not fit in GPU memory ({free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB); try a smaller model or --backend cpu"
            ) from None

    def load_vector(self, x):
        return cp.asarray(np.asarray(x, np.float32))

    def zeros(self, shape):
        return cp.zeros(shape, cp.float16)  # the KV cache holds fp16, as llama.cpp's

    def to_host(self, x):
        if isinstance(x, QuantizedRows):
            x = x.values
        return host_result(cp.asnumpy(x))

    def gather_rows(self, x, rows):
        return x[self._ints(rows)]

    def _ints(self, a):
        """Token ids, positions or slots as a device int32 vector. Host vectors are kept by
        content for a while: an eager pass hands every layer the same ones, and each copy
        from pageable host memory waits for the stream to drain first, so a copy a layer
        would leave the GPU idle while the host catches up."""
        if isinstance(a, cp.ndarray):
            return a if a.dtype == cp.int32 else a.astype(cp.int32)
        host = np.ascontiguousarray(a, np.int32).reshape(-1)
        key = host.tobytes()
        dev = self._host_vectors.get(key)
        if dev is None:
            dev = self._host_vectors[key] = cp.asarray(host)
            if len(self._host_vectors) > HOST_VECTORS:
                del self._host_vectors[next(iter(self._host_vectors))]
        return dev

    # -- matrix products --------------------------------------------------------------------

    def _quantize(self, x, per_256: bool, norm=None, eps: float = 0.0, up=None, tiled=None):
        """x [n, k] (rows may be strided views) -> (xq int8 [n, k], xd [n, k/32], xs [n, k/32])
        as formats.cuh expects; first x / rms(x) * norm, or silu(x) * up, when given.
        tiled: the tensor-core kernel's layout (quantize.cuh); by default where the
        product of x takes that kernel."""
        n, k = x.shape
        if tiled is None:
            tiled = _tensor_cores(n, k, self._exact_pass)
        xq, xd, xs = _activation(n, k, tiled)
        args = (x, _i32(x.strides[0] // 4), _NULL if norm is None else norm, np.float64(eps))
        args += (_NULL, _i32(0)) if up is None else (up, _i32(up.strides[0] // 4))
        args += (_i32(k), _i32(per_256), _i32(tiled), xq, xd, xs)
        self.k("quantize_rows")(((k + 255) // 256, n), (256,), args)
        return xq, xd, xs

    def _dense_rows(self, x, norm, eps, up):
        """x (first x / rms(x) * norm, or silu(x) * up, when given) rounded to fp16 rows, the
        activation of the cuBLAS products."""
        n, k = x.shape
        out = cp.empty((n, k), cp.float16)
        args = (x, _i32(x.strides[0] // 4), _NULL if norm is None else norm, np.float64(eps))
        args += (_NULL, _i32(0)) if up is None else (up, _i32(up.strides[0] // 4))
        self.k("dense_rows")(((k + 255) // 256, n), (256,), (*args, _i32(k), out))
        return out

    def _product_f16(self, x16, w: CUDAWeight, y, accumulate: bool) -> None:
        """y (+)= x16 @ w.T through cuBLAS: w dequantized to fp16 scratch, fp32 accumulation
        and output (written or added in place: no conversions after). For prefill-sized
        batches, where it beats the int8 kernels."""
        w16 = cp.empty((w.n_out, w.n_in), cp.float16)
        groups = w.n_out * w.n_in // 32
        args = (*w.plane_args(), w16, _i32(w.n_in), np.int64(groups))
        self.k(f"dequant_f16<{w.kernel_format}>")(((4 * groups + 255) // 256,), (256,), args)
        # column-major: y.T [n_out, n] = w16 [n_in, n_out].T @ x16.T [n_in, n]
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        alpha, beta = np.ones(1, np.float32), np.full(1, float(accumulate), np.float32)
        n = x16.shape[0]
        cublas.gemmEx(
            handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, w.n_out, n, w.n_in,
            alpha.ctypes.data, w16.data.ptr, _CUDA_R_16F, w.n_in,
            x16.data.ptr, _CUDA_R_16F, x16.strides[0] // 2,
            beta.ctypes.data, y.data.ptr, _CUDA_R_32F, y.strides[0] // 4,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip

    def _product(self, x, act, w: CUDAWeight, y, accumulate: bool = False) -> None:
        """y [n, n_out] (+)= x @ w.T; act: x's quantization for w's kind (None for float w)."""
        n = x.shape[0]
        args = (_i32(w.n_in), _i32(w.n_out), _i32(n), _i32(accumulate))
        if w.kernel_format is None:
            t = next((t for t in MATVEC_TOKENS if t >= n), MATVEC_TOKENS[-1])
            grid = ((w.n_out + 7) // 8, (n + t - 1) // t)
            kernel = self.k(f"matvec_f<{_float_name(w.qtype)}, {t}>")
            kernel(grid, (256,), (w.planes[0], x, y, *args))
            return
        inputs = (*w.plane_args(), *act, y, *args)
        exact_pass = self._exact_pass
        if _exact(n, w.n_in, exact_pass):
            name, grid, block = exact_launch(w, n)
            self.k(name)(grid, block, inputs)
            return
        if _chains(n, w.n_in, exact_pass):
            group_bytes = w.planes[0].nbytes // (w.n_out * (w.n_in // 32))  # of plane 0
            warps = 32 * group_bytes // MMA_CHUNK  # 32 chains, a chunk's groups a warp
            stages, shared = _mma_ring(w, warps, CHAIN_SM_WARPS)
            shared = max(shared, 32 * 4 * 32 * 4)  # the chains, for the tree at the end
            grid = ((w.n_out + 15) // 16, 1)
            kernel = self.k(f"matmul_chains<{w.kernel_format}, 1>")
            kernel(grid, (32 * warps,), (*inputs, _i32(stages)), shared)
            return
        if _few_mma(n):
            name, grid, block = few_mma_launch(w, n, FEW_MMA_WARPS, FEW_MMA_UNROLL)
            self.k(name)(grid, block, inputs)
            return
        if _takes_tile(n):
            if n == 1:
                tile, warps = (1, *ONE_TILE[:2]), ONE_TILE[2]
            else:
                shape = next((t for t in SMALL_TILES if t[0] >= n), SMALL_TILES[-1])
                tile, warps = shape[:3], shape[3] if len(shape) > 3 else SMALL_WARPS
                if w.n_out < self._sms * warps * tile[1]:  # too few blocks: SMALL_WARPS
                    warps = min(warps, SMALL_WARPS)
            name, grid, block, shared, stage = tile_launch(w, n, tile, warps, SMALL_STAGE)
            self.k(name)(grid, block, (*inputs, _i32(stage)), shared)
            return
        if not _tensor_cores(n, w.n_in, exact_pass):
            t = next((t for t in MATVEC_TOKENS if t >= n), MATVEC_TOKENS[-1])
            grid = ((w.n_out + MATVEC_ROWS - 1) // MATVEC_ROWS, (n + t - 1) // t)
            self.k(f"matvec_q<{w.kernel_format}, {t}>")(grid, (256,), inputs)
            return
        grid = ((w.n_out + 15) // 16, (n + MMA_TOKENS - 1) // MMA_TOKENS)
        warps = self._mma_warps(grid[0] * grid[1], w.n_in // (32 * MMA_ROW_GROUPS))
        stages, shared = _mma_ring(w, warps)
        fragments = 1 if n <= min(MMA_ONE_FRAGMENT, 8) else 2
        kernel = self.k(f"matmul_mma<{w.kernel_format}, {warps}, {fragments}>")
        kernel(grid, (32 * warps,), (*inputs, _i32(stages)), shared)

    def _mma_warps(self, blocks: int, chunks: int) -> int:
        """Warps per tensor-core block: the wider kind where every block of them is resident
        at once and each warp still gets a chunk; its warps then walk fewer chunks each (the
        7B shape's 4096-row products; its batch-16 step 4.09 -> 3.98 ms on the H200)."""
        narrow, wide = MMA_WARPS
        fits = blocks <= self._sms * (MMA_SM_WARPS // wide)
        return wide if fits and chunks >= wide else narrow

    def _rows(self, x):
        if isinstance(x, QuantizedRows):  # transformed before a product: the float rows
            x = x.values
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        return x.reshape(-1, x.shape[-1])

    def _product_input(self, x) -> tuple:
        """x as float rows and the 8-bit form that came with it (QuantizedRows), or None."""
        if isinstance(x, QuantizedRows):
            return x.values, x.act
        return self._rows(x), None

    def matmul(self, x, w):
        rows, act = self._product_input(x)
        return self._many(rows, [w], act=act)[0]

    def matmul_many(self, x, ws):
        rows, act = self._product_input(x)
        return self._many(rows, ws, act=act)

    def norm_matmul_many(self, x, weight, eps, ws):
        return self._many(self._rows(x), ws, norm=weight, eps=eps)

    def matmul_add(self, x, w, residual):
        rows, act = self._product_input(x)
        self._many(rows, [w], out=residual, act=act)
        return residual

    def silu_mul_matmul_add(self, gate, up, w, residual):
        self._many(gate, [w], up=up, out=residual)
        return residual

    def _many(self, x, ws, norm=None, eps=0.0, up=None, out=None, act=None) -> list:
        """Products of x (first normalized, or silu(x) * up, when given) with each of ws.
        Weights of one format are fused into one matrix on first use (their planes become
        views of it), so Q, K and V or gate and up take one launch; the others share the
        activation's quantization. out: add the (single) product into it instead. act: x
        already in 8 bits per 32 (QuantizedRows), for the weights of such formats."""
        if len(ws) > 1 and len({(w.qtype, w.n_in) for w in ws}) == 1:
            key = tuple(id(w) for w in ws)
            fused = self._fused.get(key) or self._fused.setdefault(key, self._fuse(ws))
            y = self._many(x, [fused], norm, eps, up, act=act)[0]
            edges = np.cumsum([0] + [w.n_out for w in ws])
            return [y[:, a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
        acts: dict[bool, tuple] = {}  # per_256 -> x quantized for such weights
        if act is not None and norm is None and up is None:
            acts[False] = act
        dense = None  # the transformed x in float, for float weights
        x16 = None  # in fp16, for cuBLAS
        outs = []
        for w in ws:
            y = out if out is not None else cp.empty((x.shape[0], w.n_out), cp.float32)
            if w.kernel_format is None:
                if dense is None:
                    dense = x if norm is None else self.rms_norm(x, norm, eps)
                    dense = self._rows(dense if up is None else self.silu_mul(dense, up))
                self._product(dense, None, w, y, out is not None)
            elif x.shape[0] >= DENSE_ROWS:
                if x16 is None:
                    x16 = self._dense_rows(x, norm, eps, up)
                self._product_f16(x16, w, y, out is not None)
            else:
                if w.per_256 not in acts:
                    acts[w.per_256] = self._quantize(x, w.per_256, norm, eps, up)
                self._product(x, acts[w.per_256], w, y, out is not None)
            outs.append(y)
        return outs

    @staticmethod
    def _fuse(ws: list[CUDAWeight]) -> CUDAWeight:
        planes = [
            with_slack(cp.concatenate(group, axis=0))
            for group in zip(*(w.planes for w in ws), strict=True)
        ]
        start = 0
        for w in ws:  # the originals become views: no second copy stays on the device
            w.planes = [p[start : start + w.n_out] for p in planes]
            start += w.n_out
        fused = CUDAWeight(planes, ws[0].qtype, start, ws[0].n_in)
        fused.members = ws  # they stay alive, so their ids in the cache key stay theirs
        return fused

    def embed(self, w, ids):
        ids = self._ints(ids)
        out = cp.empty((ids.size, w.n_in), cp.float32)
        if w.kernel_format is None:
            self.k(f"embed_f<{_float_name(w.qtype)}>")(
                (ids.size,), (256,), (w.planes[0], ids, out, _i32(w.n_in))
            )
        else:
            kernel = self.k(f"embed_q<{w.kernel_format}>")
            kernel((ids.size,), (256,), (*w.plane_args(), ids, out, _i32(w.n_in)))
        return out

    # -- element-wise -----------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        x = self._rows(x)
        y = cp.empty_like(x)
        self.k("rms_norm")((x.shape[0],), (256,), (x, weight, y, _i32(x.shape[1]), np.float64(eps)))
        return y

    def _rope_table(self, rope: RopeConfig):
        key = (
            rope.n_dims,
            rope.freq_base,
            None if rope.freq_factors is None else rope.freq_factors.tobytes(),
        )
        table = self._rope_tables.get(key)
        if table is None:
            # theta at position 1 is the per-pair power, accumulated as llama.cpp does
            unit = RopeConfig(n_dims=rope.n_dims, freq_base=rope.freq_base)
            powers = cp.asarray(rope_angles(np.ones(1, np.int32), unit)[0])
            factors = (
                None if rope.freq_factors is None else cp.asarray(rope.freq_factors, cp.float32)
            )
            table = self._rope_tables[key] = (powers, factors)
        return table

    def rope(self, x, positions, rope):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, heads, hd = x.shape
        powers, factors = self._rope_table(rope)
        total = n * heads * (rope.n_dims // 2)
        args = (x, self._ints(positions), powers, np.uint64(0) if factors is None else factors)
        args += (_i32(n), _i32(heads), _i32(hd), _i32(rope.n_dims), np.float32(rope.freq_scale))
        self.k("rope")(((total + 255) // 256,), (256,), (*args, _i32(rope.neox)))
        return x

    def silu_mul(self, gate, up):
        gate, up = cp.ascontiguousarray(gate), cp.ascontiguousarray(up)
        y = cp.empty_like(gate)
        self.k("silu_mul")(((gate.size + 255) // 256,), (256,), (gate, up, y, np.int64(gate.size)))
        return y

    def gelu_mul(self, gate, up):
        gate, up = cp.ascontiguousarray(gate), cp.ascontiguousarray(up)
        y = cp.empty_like(gate)
        self.k("gelu_mul")(((gate.size + 255) // 256,), (256,), (gate, up, y, np.int64(gate.size)))
        return y

    def scale(self, x, factor):
        x *= np.float32(factor)
        return x

    def softcap(self, x, cap):
        x = cp.ascontiguousarray(x)
        self.k("softcap")(((x.size + 255) // 256,), (256,), (x, np.int64(x.size), np.float32(cap)))
        return x

    def add(self, x, y):
        x += y
        return x

    def add_bias(self, x, bias):
        x += bias
        return x

    def top_k(self, logits, k):
        logits = self._rows(logits)
        n, vocab = logits.shape
        chunks = (vocab + SELECT_CHUNK - 1) // SELECT_CHUNK
        if k > SELECT_MAX or chunks * k > SELECT_CHUNK or chunks > SELECT_LISTS:
            return super().top_k(logits, k)
        if n > self._select_tickets.size:
            raise FastrunError(f"token selection over {n} rows at once is too many")
        part_v, part_i = cp.empty((n, chunks, k), cp.float32), cp.empty((n, chunks, k), cp.int32)
        out_v, out_i = cp.empty((n, k), cp.float32), cp.empty((n, k), cp.int32)
        args = (logits, _i32(vocab), np.int64(logits.strides[0] // 4), _i32(k), part_v, part_i)
        args += (self._select_tickets, out_v, out_i)
        self.k("top_k")((chunks, n), (512,), args)
        return out_i, out_v

    # -- attention --------------------------------------------------------------------------

    def kv_write(self, k_cache, v_cache, k, v, slots):
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        v = cp.ascontiguousarray(v, dtype=cp.float32)
        n, width = k.shape[0], k.size // k.shape[0]
        grid = ((k.size + 255) // 256,)
        self.k("kv_write")(
            grid, (256,), (k, v, k_cache, v_cache, self._ints(slots), _i32(n), _i32(width))
        )

    def _raw_inputs(self, q, k, v):
        """q [n, h * hd], k and v [n, hk * hd] as the kernels read them: rows of unit-stride
        floats, k and v with one row stride (views of a fused product stay views)."""
        if k.strides != v.strides or q.strides[1] != 4 or k.strides[1] != 4:
            q, k, v = (cp.ascontiguousarray(a) for a in (q, k, v))
        return q, k, v

    def _inputs_args(self, q, k, v, biases, slots, rope) -> tuple:
        """The kernels' arguments for a layer's projections before RoPE (ops.cu AttnInputs,
        less q): k, v, their row strides, the biases, the slots, the RoPE table."""
        powers, factors = self._rope_table(rope)
        bq, bk, bv = biases if biases is not None else (_NULL, _NULL, _NULL)
        args = (k, v, _i32(q.strides[0] // 4), _i32(k.strides[0] // 4), bq, bk, bv)
        args += (self._ints(slots), powers, _NULL if factors is None else factors)
        return args + (_i32(rope.n_dims), np.float32(rope.freq_scale), _i32(rope.neox))

    def attention_inputs(self, q, k, v, biases, k_cache, v_cache, positions, slots, rope):
        n, hk, hd = q.shape[0], k_cache.shape[1], k_cache.shape[2]
        h = q.size // (n * hd)
        q, k, v = self._raw_inputs(q, k, v)
        q_out = cp.empty((n, h, hd), cp.float32)
        inputs = self._inputs_args(q, k, v, biases, slots, rope)
        args = (q, *inputs[:7], q_out, k_cache, v_cache, self._ints(positions), *inputs[7:10])
        args += (_i32(h), _i32(hk), _i32(hd), *inputs[10:])
        self.k("rope_kv")((n, h + hk), (64,), args)
        return q_out

    def rope_attention(
        self, q, k, v, biases, rope, slots, k_cache, v_cache, positions, scale, starts=None,
        window=0, softcap=0.0, ring=0, offsets=None, one_sequence=False, one_token_each=False,
    ):  # fmt: skip
        n, hd = q.shape[0], k_cache.shape[2]
        kind = self._attention_kind(n, hd, positions, one_sequence)
        if not (one_token_each and kind == "split" and ROPE_IN_ATTENTION):
            return super().rope_attention(
                q, k, v, biases, rope, slots, k_cache, v_cache, positions, scale, starts,
                window, softcap, ring, offsets, one_sequence,
            )  # fmt: skip
        # attn_split rotates the queries and stores the new rows itself (ops.cu)
        q, k, v = self._raw_inputs(q, k, v)
        inputs = self._inputs_args(q, k, v, biases, slots, rope)
        args = (q, q.shape[1] // hd, k_cache, v_cache, positions, scale, starts, window, softcap)
        return self._attention(*args, ring, offsets, kind, inputs)

    def _attention_kind(self, n: int, hd: int, positions, one_sequence: bool) -> str:
        """The kernel that takes attention of n queries: "tiles" (prefill), "exact" (a checking
        pass: attn_split, each query split as a one-token step's), "few" (a checking pass,
        with EXACT_PASS_TOKENS below it), "grouped" or "split"."""
        if n >= DENSE_ROWS and hd in ATTN_TILE_DIMS and not isinstance(positions, cp.ndarray):
            return "tiles"
        if one_sequence and 1 < n <= EXACT_PASS_TOKENS:
            return "exact"
        few = one_sequence and ATTN_ONE_SEQUENCE[0] <= n <= ATTN_FEW_QUERIES
        if few and hd in ATTN_TILE_DIMS and n < DENSE_ROWS:
            return "few"
        return "grouped" if 1 < n <= min(ATTN_GROUP[0], ATTN_GROUP_MAX) else "split"

    def attention(
        self, q, k_cache, v_cache, positions, scale, starts=None, window=0, softcap=0.0,
        ring=0, offsets=None, one_sequence=False,
    ):  # fmt: skip
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        n, h, hd = q.shape
        kind = self._attention_kind(n, hd, positions, one_sequence)
        if kind == "tiles":
            args = (q, k_cache, v_cache, positions, scale, starts, window, softcap, ring)
            return self._attention_tiles(*args, self._offsets(offsets, ring))
        args = (q, h, k_cache, v_cache, positions, scale, starts, window, softcap, ring)
        return self._attention(*args, offsets, kind, None)

    def _offsets(self, offsets, ring: int):
        # ring > 0: a sliding-window layer's ring; the kernels read each query's offset from
        # the device (a graph's replays take the offsets of their step, not of its capture)
        return _NULL if ring <= 0 else self._ints(offsets)

    def _attention(
        self, q, h, k_cache, v_cache, positions, scale, starts, window, softcap, ring, offsets,
        kind, inputs,
    ):  # fmt: skip
        """Attention of n queries (q: [n, h, hd] rotated, or with inputs, attn_split's only,
        the raw q rows of _inputs_args' projections) by attn_split, attn_group or attn_few."""
        n, hk, hd = q.shape[0], k_cache.shape[1], k_cache.shape[2]
        if isinstance(positions, cp.ndarray):  # inside a graph: sized for the whole cache
            longest = k_cache.shape[0]
        else:
            longest = int(np.max(positions)) + 1
        offsets = self._offsets(offsets, ring)
        few, grouped = kind == "few", kind == "grouped"
        if window > 0:  # a sliding-window layer reads at most its window (attn_few: a span)
            longest = min(longest, window + (n - 1 if few else 0))
        # enough blocks to fill the GPU at decode; each split takes an equal share of a query's
        # positions (in whole rounds of loads, ops.cu) and the combine merges them
        splits = (longest + ATTN_MIN_SHARE - 1) // ATTN_MIN_SHARE
        if grouped:  # one block takes all n queries: the splits of a one-token step
            budget = ATTN_GROUP[1] * n
        elif kind == "exact":  # each query split as a one-token step splits it
            budget = ATTN_BLOCKS[0] * n
        else:
            budget = ATTN_FEW[1] if 1 < n <= ATTN_FEW[0] else ATTN_BLOCKS[n > 1]
        splits = max(1, min(splits, budget // (n * h), ATTN_MAX_SPLITS))
        if few:  # each split a whole number of attn_few's chunks
            splits = (longest + ATTN_FEW_CHUNK - 1) // ATTN_FEW_CHUNK
            splits = max(1, min(splits, ATTN_ONE_SEQUENCE[1] // h, ATTN_MAX_SPLITS))
        pos = self._ints(positions)
        starts = cp.zeros(n, cp.int32) if starts is None else self._ints(starts)
        part_o = cp.empty((n, h, splits, hd), cp.float32)
        part_ml = cp.empty((n, h, splits, 2), cp.float32)
        out = cp.empty((n, h * hd), cp.float32)
        if n * h > self._tickets.size:
            raise FastrunError(f"attention over {n} x {h} query heads at once is too many")
        args = (q, k_cache, v_cache, pos, starts, part_o, part_ml, self._tickets, out)
        args += (_i32(h), _i32(hk), _i32(hd), _i32(splits), np.float32(scale))
        # the output also in 8 bits per 32 (groups within a head), for an output projection of
        # a 32-block format (Q4_0 ... Q8_0); a kernel launch fewer per layer
        act = None
        if hd % 32 == 0 and n < DENSE_ROWS:
            tiled = _tensor_cores(n, h * hd, self._exact_pass)
            act = _activation(n, h * hd, tiled)
            args += (*act, _i32(tiled))
        else:
            args += (_NULL, _NULL, _NULL, _i32(0))
        args += (_i32(window), np.float32(softcap), offsets, _i32(max(ring, 0)))
        if few:
            # the queries' rows as floats, a chunk's K and V rows in halves (ops.cu)
            shared = ATTN_FEW_QUERIES * hd * 4 + 2 * ATTN_FEW_CHUNK * (hd + 8) * 2
            few_args = (q, k_cache, v_cache, pos, starts, part_o, part_ml, _i32(h), _i32(hk))
            few_args += (_i32(splits), np.float32(scale), _i32(window), np.float32(softcap))
            few_args += (offsets, _i32(max(ring, 0)), _i32(n))
            self.k(f"attn_few_{hd}")((h, splits), (128,), few_args, shared)
            merge = (part_o, part_ml, self._tickets, out, pos, _i32(h), _i32(hd), _i32(splits))
            merge += (*args[14:18], _i32(window), _i32(n))  # the 8-bit output (xq, xd, xs, tiled)
            self.k("attn_few_merge")((h, n), (128,), merge)
        elif grouped:
            shared = n * (10 * 128 + hd) * 4  # each thread's streams of the n queries; q rows
            self.k("attn_group")((h, splits, 1), (128,), (*args, _i32(n), _i32(n)), shared)
        else:
            if inputs is None:  # q rotated, the new rows stored (ops.cu AttnInputs: k null)
                inputs = (_NULL, _NULL, _i32(0), _i32(0), _NULL, _NULL, _NULL, _NULL, _NULL)
                inputs += (_NULL, _i32(0), np.float32(0), _i32(0))
            self.k("attn_split")((h, splits, n), (128,), (*args, *inputs))
        return out if act is None else QuantizedRows(out, act)

    def _attention_tiles(
        self, q, k_cache, v_cache, positions, scale, starts, window, softcap, ring, offsets
    ):
        """Attention of many queries (prefill) in tiles of up to ATTN_TILE queries of one
        sequence at consecutive positions, each tile reading its keys once (ops.cu)."""
        n, h, hd = q.shape
        positions = np.asarray(positions, np.int32)
        starts = np.zeros(n, np.int32) if starts is None else np.asarray(starts, np.int32)
        # a tile starts at every change of sequence or break in the positions, and every
        # ATTN_TILE queries within a run
        breaks = np.ones(n, bool)
        breaks[1:] = (starts[1:] != starts[:-1]) | (positions[1:] != positions[:-1] + 1)
        run_first = np.flatnonzero(breaks)
        run_len = np.diff(np.append(run_first, n))
        firsts = np.concatenate(
            [np.arange(f, f + c, ATTN_TILE) for f, c in zip(run_first, run_len, strict=True)]
        )
        counts = np.minimum(ATTN_TILE, np.append(firsts[1:], n) - firsts)
        order = np.argsort(positions[firsts + counts - 1], kind="stable")  # longest last
        tiles = np.stack([firsts[order], counts[order]], axis=1).astype(np.int32)
        out = cp.empty((n, h * hd), cp.float32)
        args = (q, k_cache, v_cache, self._ints(positions), self._ints(starts))
        args += (self._ints(tiles), out, _i32(h), _i32(k_cache.shape[1]), np.float32(scale))
        row = hd + 8  # halves a staged row (ops.cu)
        shared = (ATTN_TILE + 2 * 32) * row * 2 + ATTN_TILE * 33 * 4
        args += (_i32(window), np.float32(softcap), offsets, _i32(max(ring, 0)))
        self.k(f"attn_tiles_{hd}")((h, len(tiles)), (128,), args, shared)
        return out

    def kv_copy(self, k_cache, v_cache, src, dst, n, shift=0, rope=None):
        layers, rows = k_cache.shape[:2]
        if not (0 <= src and src + n <= rows and 0 <= dst and dst + n <= rows) or n <= 0:
            return
        if layers == 0:  # no layers of this storage (kv_cache.py): nothing to launch
            return
        width = k_cache[0, 0].size
        ks, vs = k_cache[:, src : src + n], v_cache[:, src : src + n]
        if abs(src - dst) < n:  # overlapping rows: the kernel reads a copy
            ks, vs = ks.copy(), vs.copy()
        stride = ks.strides[0] // 2
        if rope is None:
            rope, shift = RopeConfig(n_dims=2), 0
        powers, factors = self._rope_table(rope)
        total = layers * n * width
        args = (ks, vs, np.int64(stride), k_cache[:, dst:], v_cache[:, dst:])
        args += (np.int64(k_cache.strides[0] // 2), _i32(layers), _i32(n), _i32(width))
        args += (_i32(k_cache.shape[3]), _i32(shift), powers, _NULL if factors is None else factors)
        args += (_i32(rope.n_dims), np.float32(rope.freq_scale), _i32(rope.neox))
        self.k("kv_copy")(((total + 255) // 256,), (256,), args)

    def kv_move(self, k_cache, v_cache, src_rows, dst_rows):
        src = cp.asarray(np.asarray(src_rows, np.int64))
        dst = cp.asarray(np.asarray(dst_rows, np.int64))
        k, v = k_cache[:, src], v_cache[:, src]  # copies: every row read before any written
        k_cache[:, dst] = k
        v_cache[:, dst] = v

    # -- CUDA graphs ------------------------------------------------------------------------

    def step_size(self, n: int) -> int:
        """Decode steps run as graphs captured per size up to GRAPH_EXACT tokens, then per
        power-of-two bucket up to GRAPH_MAX_TOKENS, so sequences joining and leaving reuse the
        captured ones."""
        if n > GRAPH_MAX_TOKENS or n <= GRAPH_EXACT:
            return n
        return 1 << max(0, (n - 1).bit_length())

    def run_step(self, owner, key, step, *vectors):
        """step(*vectors on the device) as a CUDA graph: captured on the first call for this
        owner (the KV cells, whose buffers the graph holds), key and shape of inputs (int32
        vectors: ids, positions, slots, starts), replayed after. Returns the host result(s)."""
        return self._graph(StepGraph, owner, key, step, vectors)(*vectors)

    def run_chain(self, owner, key, step, steps: int, *vectors) -> np.ndarray:
        """Backend.run_chain: step's own graph, captured once more with the feed of its picks
        to its inputs at its end, replayed `steps` times with no wait between."""
        return self._graph(ChainGraph, owner, key, step, vectors)(steps, *vectors)

    def _graph(self, kind: type[StepGraph], owner, key, step, vectors) -> StepGraph:
        """The graph of this kind for (owner, key, shape of the vectors), captured on its
        first call."""
        shape = (len(vectors), len(vectors[0]))
        graph_key = (id(owner), kind, key, shape)
        graph = self._graphs.get(graph_key)
        if graph is None or graph.owner() is not owner:
            # graphs of cells gone (a closed model's) give back their memory
            for dead in [k for k, g in self._graphs.items() if g.owner() is None]:
                del self._graphs[dead]

            def recorded(*inputs):  # kernels overlap their predecessors' tails in the graph
                with self.k.launch.recording():
                    return step(*inputs)

            graph = self._graphs[graph_key] = kind(owner, recorded, *shape)
        return graph
