#!/usr/bin/env python3
"""Where a CUDA checking pass of n tokens (speculation, issue #19) spends its time, on the 7B
shape with random Q4_0 (or --type) weights, without a real model.

    python scripts/gpu_pass_profile.py products            # the products alone, per n
    python scripts/gpu_pass_profile.py passes              # whole passes: graph replay alone
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \\
        --log-file k.csv --nvtx --nvtx-include prof/ python scripts/gpu_pass_profile.py passes --ncu
    python scripts/gpu_pass_profile.py table k.csv         # per-kernel table of each pass

products: one layer's four products (fused QKV 12288x4096, O 4096x4096 added in place,
fused gate/up 22016x4096, down 4096x11008 added in place) for each of 32 layers, then the
32000x4096 output head: a graph of those launches alone (activations quantized once before),
replayed; ms per pass and GB/s of weights, for each dispatch variant (--variants; module
settings of backends/cuda/backend.py, read at each launch).
passes: spec_bench --verify-cost's model and passes (512 cached tokens, logits for every
token, top_k=1), each size's captured graph replayed alone (device ms) and the pass with the
host (ms); with --ncu one pass of each size inside an NVTX range "prof", the sizes separated by
a marker kernel, for the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

LAYER = ((12288, 4096, False), (4096, 4096, True), (22016, 4096, False), (4096, 11008, True))
HEAD = (32000, 4096, False)
VARIANTS = {
    "default": {},
    "chains": {"CHAINS": (2, 8)},  # matmul_chains 2..8
    "eighth": {"CHAINS": (0, 0), "MMA_ONE_FRAGMENT": 0},  # the eighth session's dispatch
    "no_chains": {"CHAINS": (0, 0)},  # matvec_tile 2..4, matmul_mma (one fragment) 5..8
    "mma_from_2": {"CHAINS": (0, 0), "SMALL_BATCH": 0, "MATVEC_BATCH": 1},  # not exact
    "tile_all": {"CHAINS": (0, 0), "SMALL_BATCH": 16},  # matvec_tile 2..16
    "exact_all": {"SMALL_BATCH": 0, "EXACT_BATCH": 16},  # matmul_exact 2..16
}
MARKER = "pass_marker"


def dispatch(settings: dict):
    """gpu_kernel_check.dispatch of a variant's settings."""
    from gpu_kernel_check import dispatch as dispatch_settings

    return dispatch_settings(**settings)


def random_weight(backend, qtype: str, n_out: int, n_in: int):
    import cupy as cp

    from fastrun.backends.cuda.weights import BLOCK_BYTES, SUPER_BYTES

    block, nbytes = (256, SUPER_BYTES[qtype]) if qtype in SUPER_BYTES else (32, BLOCK_BYTES[qtype])
    raw = cp.random.randint(0, 256, (n_out, n_in // block * nbytes), cp.uint8)
    if qtype in SUPER_BYTES:  # finite fp16 super-block scales (Q4_K/Q5_K: d, dmin first)
        raw[:, 1::nbytes] &= 0x3B
        raw[:, 3::nbytes] &= 0x3B
    else:
        raw[:, 1::nbytes] &= 0x3B  # finite fp16 block scales (their high bytes)
    return backend.load_weight(raw, qtype, n_out, n_in)


def part_products(args) -> None:
    from fastrun.backends.cuda.backend import CUDABackend

    backend = CUDABackend()
    shapes = LAYER if args.only is None else (LAYER[args.only],)
    layers = [[random_weight(backend, args.type, o, i) for o, i, _ in shapes]
              for _ in range(args.layers)]  # fmt: skip
    head = random_weight(backend, args.type, *HEAD[:2]) if args.only is None else None
    weights = [w for layer in layers for w in layer] + ([head] if head else [])
    total = sum(w.nbytes for w in weights)
    what = "layers + head" if head else f"copies of {shapes[0][0]}x{shapes[0][1]}"
    print(f"products: {args.layers} {what}, {total / 1e9:.2f} GB of {args.type} weights")
    sizes = [int(v) for v in args.sizes.split(",")]
    rows = []
    base = None
    for variant in args.variants.split(","):
        settings = VARIANTS[variant]
        line = []
        for n in sizes:
            with dispatch(settings):
                ms = products_ms(backend, layers, head, n, args.replays, shapes)
            if base is None:
                base = ms  # the first variant's first size: the reference
            gbs = total / (ms / 1e3) / 1e9
            rows.append({"variant": variant, "n": n, "ms": round(ms, 4), "GBs": round(gbs)})
            line.append(f"{n}:{ms:.3f}ms/{gbs:.0f}/x{ms / base:.2f}")
        print(f"  {variant:14s} " + " ".join(line), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def products_ms(backend, layers, head, n: int, replays: int, shapes=LAYER) -> float:
    """Device ms of one pass's products of n tokens, as a replayed graph."""
    import cupy as cp

    rng = np.random.default_rng(n)
    per_256 = layers[0][0].per_256
    acts, xs = {}, {}
    for k in (4096, 11008):
        x = cp.asarray(rng.standard_normal((n, k)), cp.float32)
        xs[k] = x
        acts[k] = backend._quantize(x, per_256)
    ys = {o: cp.zeros((n, o), cp.float32) for o in (12288, 4096, 22016, 32000)}

    def step():
        for layer in layers:
            for w, (o, i, add) in zip(layer, shapes, strict=True):
                backend._product(xs[i], acts[i], w, ys[o], add)
        if head is not None:
            backend._product(xs[4096], acts[4096], head, ys[32000], False)

    step()  # compiles, checks the launches
    stream = cp.cuda.Stream(non_blocking=True)
    with stream, backend.k.launch.recording():
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for _ in range(3):
        graph.launch(stream)
    times = []
    for _ in range(replays):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def part_passes(args) -> None:
    import cupy as cp
    from helpers import write_tiny_model
    from spec_bench import SHAPES

    from fastrun.backends import get_backend
    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner.batch import Batch
    from fastrun.runner.models import model_class

    marker_kernel = cp.RawKernel(f'extern "C" __global__ void {MARKER}(int* x) {{ x[0] = 0; }}',
                                 MARKER)  # fmt: skip
    scratch = cp.zeros(1, cp.int32)

    def marker(x, size=1):
        marker_kernel((1,), (1,), (x,))

    sizes = [int(v) for v in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        arch, d, ff, n_layer, h, hk, vocab = SHAPES["llama2-7b"]
        write_tiny_model(path, arch, args.type, d, ff, n_layer, h, hk, vocab, 4096, tied=False,
                         fast=True)  # fmt: skip
        f = GGUFFile(str(path))
        backend = get_backend("cuda")
        model = model_class(f.architecture)(f, backend)
        cells = model.new_cells(1, 1024)
        cache = cells.sequences[0]
        model.forward(np.random.default_rng(0).integers(0, 256, 512), cache)

        def once(n: int) -> float:
            cache.trim(512)
            batch = Batch()
            batch.add(cache, [1] * n, "all")
            t0 = time.perf_counter()
            model.run(batch, cells, top_k=1)
            return time.perf_counter() - t0

        for _ in range(3):
            for n in sizes:
                once(n)
        if args.ncu:
            cp.cuda.Device().synchronize()
            cp.cuda.nvtx.RangePush("prof")
            for n in sizes:
                marker(scratch, size=1)
                once(n)
            marker(scratch, size=1)
            cp.cuda.Device().synchronize()
            cp.cuda.nvtx.RangePop()
            print(f"ncu passes: {sizes}")
            return
        host = {n: [] for n in sizes}
        for _ in range(args.replays // 4):
            for n in sizes:
                host[n].append(once(n))
        graphs = {key[2][1]: g for key, g in backend._graphs.items() if key[0] == id(cells)}
        out = []
        base_dev = base_host = None
        for n in sizes:
            cache.trim(512)
            g = graphs[n]
            times = []
            for _ in range(args.replays):
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record(g.stream)
                g.graph.launch(g.stream)
                stop.record(g.stream)
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop))
            dev = float(np.median(times))
            hst = statistics.median(host[n]) * 1e3
            base_dev = base_dev or dev
            base_host = base_host or hst
            out.append({"tokens": n, "replay_ms": round(dev, 3), "host_ms": round(hst, 3),
                        "replay_vs_1": round(dev / base_dev, 3),
                        "host_vs_1": round(hst / base_host, 3)})  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
        f.close()


def part_table(args) -> None:
    """ncu's per-launch durations, split into passes at the marker kernels, summed by kernel
    name (templates folded to their first argument)."""
    rows = [r for r in csv.reader(line for line in args.csv.open() if line.startswith('"'))]
    header, rows = rows[0], rows[1:]
    name, value = header.index("Kernel Name"), header.index("Metric Value")
    passes, current = [], None
    for r in rows:
        k = r[name]
        if MARKER in k:
            if current is not None:
                passes.append(current)
            current = defaultdict(list)
            continue
        if current is None:
            continue
        short = k.split("(")[0]
        short = short.split(",")[0] + (">" if "<" in short else "")
        current[short].append(float(r[value].replace(",", "")) / 1e3)
    sizes = [int(v) for v in args.sizes.split(",")]
    names = sorted({k for p in passes for k in p}, key=lambda k: -sum(passes[-1].get(k, [0])))
    print("us per pass (launches): " + " | ".join(f"n={n}" for n in sizes[: len(passes)]))
    for k in names:
        cells = [f"{sum(p.get(k, [])):8.1f} ({len(p.get(k, [])):3d})" for p in passes]
        print(f"{k[:44]:44s} " + " ".join(cells))
    totals = [sum(sum(v) for v in p.values()) for p in passes]
    print(f"{'total':44s} " + " ".join(f"{t:8.1f}      " for t in totals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("part", choices=("products", "passes", "table"))
    ap.add_argument("csv", nargs="?", type=Path)
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--sizes", default="1,2,3,4,5,6,8,9")
    ap.add_argument("--variants", default="default,two_fragments,mma_from_2,exact_all")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--only", type=int, help="products: only this shape of a layer's (0..3)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    {"products": part_products, "passes": part_passes, "table": part_table}[args.part](args)


if __name__ == "__main__":
    main()
