#!/usr/bin/env python3
"""Where a CUDA decode step's time goes: the step's graph replayed alone (device time per
step), the same with the host's per-token work (tok/s), and with --kernels each kernel's own
duration as Nsight Compute reports it (run under ncu, see below).

    python scripts/gpu_decode_profile.py --shape llama2-7b --type Q4_0
    python scripts/gpu_decode_profile.py --shape llama2-7b --model /tmp/q40.gguf -p 16 512 \\
        --batch 1 16   # every depth and batch in one process; the model file kept for the next
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file k.csv \\
        --nvtx --nvtx-include decode/ python scripts/gpu_decode_profile.py --steps 1 --replays 0
    python scripts/gpu_decode_profile.py --kernels k.csv   # per-kernel table of one step

FASTRUN_PDL=0 turns programmatic dependent launch off, for comparison.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def kernel_table(path: Path) -> None:
    """Sum ncu's per-launch durations by kernel name, over the last decode step's launches."""
    rows = [r for r in csv.reader(line for line in path.open() if line.startswith('"'))]
    header, rows = rows[0], rows[1:]
    name, value = header.index("Kernel Name"), header.index("Metric Value")
    per = defaultdict(list)
    for r in rows:
        per[r[name].split("(")[0]].append(float(r[value].replace(",", "")))
    total = sum(sum(v) for v in per.values())
    print(f"{len(rows)} launches, {total / 1e3:.1f} us of kernel time")
    for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        print(f"{k:40s} {len(v):5d} x {np.mean(v) / 1e3:7.2f} us = {sum(v) / 1e3:8.1f} us")


def main() -> None:
    from gpu_bench import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("-p", "--n-prompt", type=int, nargs="+", default=[512], help="cache depths")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed with the host")
    ap.add_argument("--replays", type=int, default=200, help="graph replays timed alone")
    ap.add_argument("--both", action="store_true", help="then again without PDL")
    ap.add_argument("--chain", type=int, default=1, help="greedy steps chained (run_chain)")
    ap.add_argument("--top-k", type=int, default=1, help="candidates the replayed step picks")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences decoded together")
    ap.add_argument("--model", type=Path, help="this GGUF file (else a random one of --shape)")
    ap.add_argument("--kernels", type=Path, help="print the table of an ncu CSV and stop")
    args = ap.parse_args()
    if args.kernels:
        kernel_table(args.kernels)
        return
    from helpers import write_tiny_model

    from fastrun.backends import get_backend
    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner.models import model_class

    arch, d, ff, n_layer, h, hk, vocab = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None or not path.exists():  # a given path that is missing: written there
            path = path or Path(tmp) / "m.gguf"
            shape = (d, ff, n_layer, h, hk, vocab, 4096)
            write_tiny_model(path, arch, args.type, *shape, tied=False, fast=True)
        f = GGUFFile(str(path))
        backend = get_backend("cuda")
        model = model_class(f.architecture)(f, backend)
        for pdl in (True, False) if args.both else (True,):
            if not pdl and backend.k.launch.enabled:
                backend.k.launch.disable()
            for n_prompt in args.n_prompt:
                for batch in args.batch:
                    measure(model, backend, args, n_prompt, batch)


def measure(model, backend, args, n_prompt: int, n_batch: int) -> None:
    import time

    import cupy as cp

    from fastrun.runner.batch import Batch

    chain = args.chain
    n_ctx, prompt = n_prompt + args.steps + chain + 8, list(range(1, n_prompt + 1))
    cells = model.new_cells(n_batch, n_ctx)
    for seq in cells.sequences:
        model.forward(prompt, seq)

    def batch_of(tokens):  # a token of each sequence
        batch = Batch()
        for seq, token in zip(cells.sequences, tokens, strict=True):
            batch.add(seq, [token])
        return batch

    def step(tokens):  # `chain` greedy steps chained on the device
        return model.run_chain(batch_of(tokens), cells, chain)[-1]

    tokens = step([1] * n_batch)  # eager run + capture
    length = n_prompt + chain
    cp.cuda.Device().synchronize()
    cp.cuda.nvtx.RangePush("decode")  # ncu --nvtx --nvtx-include decode/ profiles only this
    t0 = time.perf_counter()
    for _ in range(args.steps // chain):
        tokens = step(tokens)
    host_s = time.perf_counter() - t0
    cp.cuda.nvtx.RangePop()
    pdl = backend.k.launch.enabled
    if args.steps:
        per = host_s / (args.steps // chain * chain)
        rate = n_batch / per
        print(
            f"depth {n_prompt}, batch {n_batch}, chain {chain}, pdl={pdl}: decode with the host"
            f" {rate:.0f} tok/s ({per * 1e3:.3f} ms/step)"
        )
    if args.replays:
        # one plain step's graph (a chain's, with its upload and download, at --top-k 1)
        from fastrun.backends.cuda.graphs import ChainGraph

        for c in cells.sequences:
            c.trim(length)
        model.run(batch_of(tokens), cells, top_k=args.top_k)
        for c in cells.sequences:
            c.trim(length)
        graph = next(
            g
            for (owner, kind, *_), g in backend._graphs.items()
            if owner == id(cells) and kind is not ChainGraph
        )
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(graph.stream)
        for _ in range(args.replays):
            graph.graph.launch(graph.stream)
        stop.record(graph.stream)
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop) / args.replays
        print(
            f"depth {n_prompt}, batch {n_batch}, top-k {args.top_k}, pdl={pdl}: graph replay"
            f" {ms:.3f} ms/step"
        )
    cells.free()


if __name__ == "__main__":
    main()
