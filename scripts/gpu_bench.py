#!/usr/bin/env python3
"""fastrun's CUDA backend on llama-shaped models with random quantized weights, against the
device's copy bandwidth and a PyTorch fp16 peer measured in the same run.

    python scripts/gpu_bench.py                      # every shape, Q4_0 and Q4_K
    python scripts/gpu_bench.py --shapes llama2-7b --types Q4_0 --json out.json

Per model: prefill (pp512) and decode (tg128 after --depth cached tokens, 512 unless told,
several depths allowed; llama-bench's own tg128 starts from an empty cache, --depth 0) at batch
1 and batch 16 (16 sequences decoded together), tok/s, and the weight bytes streamed per decode
step as a share of the measured device-to-device copy bandwidth. --engine adds the same through
the engine's batcher: one sequence alone, and requests joining and leaving 16 at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# (arch, n_embd, n_ff, n_layer, n_head, n_head_kv, n_vocab)
SHAPES = {
    "smollm2-135m": ("llama", 576, 1536, 30, 9, 3, 49152),
    "qwen2.5-1.5b": ("llama", 1536, 8960, 28, 12, 2, 151936),
    "llama2-7b": ("llama", 4096, 11008, 32, 32, 32, 32000),
}
# K-quants need rows of whole 256-blocks: SmolLM2's width (576) takes Q4_0 only.
FITS = {"Q4_K": lambda shape: SHAPES[shape][1] % 256 == 0}


def copy_bandwidth(n_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    import cupy as cp

    a = cp.ones(n_bytes // 4, cp.float32)
    b = cp.empty_like(a)
    times = []
    for _ in range(12):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        b[...] = a
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * n_bytes / float(np.median(times[2:]))


def timed(fn, repeat: int = 3) -> float:
    """Median wall time of fn() (each call ends with a device sync)."""
    import cupy as cp

    times = []
    for _ in range(repeat):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_fastrun(path: Path, n_prompt: int, n_gen: int, batch: int, depth: int) -> dict:
    from fastrun.backends import get_backend
    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner.bench import greedy_decode
    from fastrun.runner.models import model_class

    f = GGUFFile(str(path))
    model = model_class(f.architecture)(f, get_backend("cuda"))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 256, n_prompt)]
    context = [int(t) for t in rng.integers(0, 256, depth)]  # cached before decoding
    weight_bytes = (
        sum(
            w.nbytes
            for layer in model.layers
            for w in (
                layer.wq,
                layer.wk,
                layer.wv,
                layer.wo,
                layer.w_gate,
                layer.w_up,
                layer.w_down,
            )
        )
        + model.output.nbytes
    )

    def prefill():
        cache = model.new_cache(n_prompt + 1)
        model.forward(prompt, cache)

    prefill()  # compile and warm
    pp = n_prompt / timed(prefill)

    def decode(cache, steps):  # greedy, picked on the device, as generation runs them
        greedy_decode(model, cache.cells, [cache], [1], steps)

    room = depth + n_gen + model.backend.chain_steps + 8  # cells for the warm-up too
    cache = model.new_cache(room)
    if context:
        model.forward(context, cache)
    decode(cache, model.backend.chain_steps + 1)  # capture the graphs
    length = cache.length
    cache.trim(length)
    tg = n_gen / timed(lambda: (cache.trim(length), decode(cache, n_gen)))
    out = {"pp": pp, "tg": tg, "weight_bytes": weight_bytes}
    if batch > 1:
        cells = model.new_cells(batch, room)
        for seq in cells.sequences:
            if context:
                model.forward(context, seq)
        length = cells.sequences[0].length
        tokens = [1] * batch

        def decode_batch(steps):
            nonlocal tokens
            tokens = greedy_decode(model, cells, cells.sequences, tokens, steps)

        decode_batch(model.backend.chain_steps + 1)

        def run():
            for seq in cells.sequences:
                seq.trim(length)
            decode_batch(n_gen)

        out["tg_batch"] = batch * n_gen / timed(run)
        cells.free()
    return out


def bench_engine(path: Path, n_gen: int, parallel: int, depth: int, rounds: int = 4) -> dict:
    """Through the engine's batcher: one sequence alone, then rounds * parallel requests with
    lengths from n_gen / 2 to 3 n_gen / 2 that join as others leave (at most `parallel` at
    once). Every prompt is one shared context of `depth` tokens (cached once, copied into each
    new sequence) plus a token of its own. Returns decode tok/s alone and in aggregate."""
    from fastrun.runner.api import Model

    rng = np.random.default_rng(1)
    context = [int(t) for t in rng.integers(0, 256, depth)]
    m = Model(path, backend="cuda", n_ctx=depth + 2 * n_gen + 8, parallel=parallel)
    greedy = dict(temperature=0, ignore_eos=True)
    m.complete(context + [1], max_tokens=8, **greedy)  # warm-up; the context stays cached
    m.complete(context + [1], max_tokens=8, temperature=0)  # and the top-1 pick's graphs
    plain = m.complete(context + [2], max_tokens=n_gen + 1, temperature=0)  # top-1 only
    before = m.stats()
    alone = m.complete(context + [2], max_tokens=n_gen + 1, **greedy)
    after = m.stats()
    steps = after["steps"] - before["steps"]
    host_ms = (after["step_seconds"] - before["step_seconds"]) / steps * 1e3
    pass_ms = (after["pass_seconds"] - before["pass_seconds"]) / steps * 1e3
    for size in (1, 2, 4, 8, 16, 32, 64):  # capture every step size's graph before timing
        if size <= parallel:
            m.generate_batch([context + [3 + i] for i in range(size)], max_tokens=3, **greedy)
    lengths = rng.integers(n_gen // 2, 3 * n_gen // 2 + 1, rounds * parallel)
    samples, done = [], threading.Event()

    def watch():  # (time, tokens generated, requests waiting) every 5 ms
        while not done.is_set():
            stats = m.stats()
            samples.append((time.perf_counter(), stats["generated"], stats["queued"]))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.perf_counter()
    streams = [
        m.generate(context + [int(t)], max_tokens=int(n), **greedy)
        for t, n in zip(rng.integers(0, 256, len(lengths)), lengths, strict=True)
    ]
    for stream in streams:
        for _ in stream:
            pass
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    m.close()
    # while requests wait, `parallel` sequences run: the steady state, before the tail where
    # the last ones finish alone
    busy = [s for s in samples if s[2] > 0]
    steady = (busy[-1][1] - busy[0][1]) / (busy[-1][0] - busy[0][0]) if len(busy) > 2 else 0.0
    return {
        "engine_step_ms": host_ms,
        "engine_pass_ms": pass_ms,
        "engine_tg": alone.decode_tps,
        "engine_tg_top1": plain.decode_tps,
        "engine_batch": int(lengths.sum()) / wall,
        "engine_steady": steady,
        "engine_prefilled": int(sum(s.completion.prefilled_tokens for s in streams)),
    }


def bench_torch(shape: str, n_prompt: int, n_gen: int, depth: int) -> dict:
    """The same shape in fp16 PyTorch: one decode step as plain tensor ops (SDPA attention),
    replayed through a CUDA graph; prefill as one batched pass."""
    import torch
    import torch.nn.functional as F

    arch, d, ff, n_layer, h, hk, vocab = SHAPES[shape]
    hd = d // h
    dev, dt = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g) * 0.02

    layers = [
        dict(
            qkv=rand((h + 2 * hk) * hd, d), o=rand(d, h * hd), up=rand(2 * ff, d), down=rand(d, ff)
        )
        for _ in range(n_layer)
    ]
    out_w = rand(vocab, d)
    n_ctx = max(n_prompt, depth) + n_gen + 8
    kc = [torch.zeros(1, hk, n_ctx, hd, device=dev, dtype=dt) for _ in range(n_layer)]
    vc = [torch.zeros(1, hk, n_ctx, hd, device=dev, dtype=dt) for _ in range(n_layer)]

    def forward(x, start, n):
        for i, L in enumerate(layers):
            y = F.rms_norm(x, (d,))
            q, k, v = (y @ L["qkv"].T).split([h * hd, hk * hd, hk * hd], dim=-1)
            q = q.view(1, n, h, hd).transpose(1, 2)
            kc[i][:, :, start : start + n] = k.view(1, n, hk, hd).transpose(1, 2)
            vc[i][:, :, start : start + n] = v.view(1, n, hk, hd).transpose(1, 2)
            keys, values = kc[i][:, :, : start + n], vc[i][:, :, : start + n]
            a = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1, enable_gqa=hk != h)
            x = x + a.transpose(1, 2).reshape(n, h * hd) @ L["o"].T
            gate, up = (F.rms_norm(x, (d,)) @ L["up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ L["down"].T
        return F.rms_norm(x[-1:], (d,)) @ out_w.T

    x = rand(n_prompt, d)
    with torch.no_grad():
        forward(x, 0, n_prompt)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            forward(x, 0, n_prompt)
        torch.cuda.synchronize()
        pp = 3 * n_prompt / (time.perf_counter() - t0)
        # decode at a fixed cache length (depth), through a graph
        x1 = rand(1, d)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            forward(x1, depth, 1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(x1, depth, 1)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_gen):
            graph.replay()
        torch.cuda.synchronize()
        tg = n_gen / (time.perf_counter() - t0)
    weight_bytes = sum(sum(t.numel() * 2 for t in L.values()) for L in layers) + out_w.numel() * 2
    return {"pp": pp, "tg": tg, "weight_bytes": weight_bytes}


def bench_file(path: Path, shape: str, qtype: str, args, **extra) -> list[dict]:
    """fastrun on one GGUF file at every depth, then llama.cpp's CUDA build on it (--llama-bin)."""
    rows = []
    for depth in args.depth:
        r = bench_fastrun(path, args.n_prompt, args.n_gen, args.batch, depth)
        if args.engine:
            r.update(bench_engine(path, args.n_gen, args.batch, depth))
        r.update(shape=shape, type=qtype, peer="fastrun", depth=depth, **extra)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.llama_bin:
        for r in bench_llamacpp(args.llama_bin, path, args):
            r.update(shape=shape, type=qtype, peer="llama.cpp FA")
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def bench_llamacpp(bin_dir: Path, path: Path, args) -> list[dict]:
    """llama-bench (-fa 1, all layers on the GPU) pp and tg at each depth, and
    llama-batched-bench's aggregate decode of --batch sequences with prompts of `depth`."""
    import subprocess

    depths = ",".join(str(d) for d in args.depth)
    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-ngl", "99", "-fa", "1", "-r", "3",
           "-p", str(args.n_prompt), "-n", str(args.n_gen), "-d", depths, "-o", "json"]  # fmt: skip
    found = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    rows = {d: {"depth": d} for d in args.depth}
    for row in found:
        key = "pp" if row["n_prompt"] else "tg"
        rows[row.get("n_depth", 0)][key] = row["avg_ts"]
    for depth, r in rows.items():
        npp = max(depth, 1)
        cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(path), "-ngl", "99", "-fa", "on",
               "-c", str(args.batch * (npp + args.n_gen) + 64), "-npp", str(npp),
               "-ntg", str(args.n_gen), "-npl", f"1,{args.batch}"]  # fmt: skip
        text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and cells[0].isdigit() and int(cells[2]) == args.batch:
                r["tg_batch"] = float(cells[7])  # S_TG
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K"])
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument(
        "-d", "--depth", type=int, nargs="+", default=[512], help="tokens cached before decode"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--engine", action="store_true", help="also through the engine's batcher")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--llama-bin",
        type=Path,
        help="llama.cpp's CUDA build/bin: llama-bench and llama-batched-bench",
    )
    ap.add_argument("--models", type=Path, nargs="*", default=[], help="real GGUF files too")
    args = ap.parse_args()
    import cupy as cp
    from helpers import write_tiny_model

    copy = copy_bandwidth()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"copy bandwidth (read + write): {copy / 1e12:.2f} TB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            rows += bench_file(model, model.stem, "file", args)
        for shape in args.shapes:
            arch, d, ff, n_layer, h, hk, vocab = SHAPES[shape]
            for qtype in args.types:
                if qtype in FITS and not FITS[qtype](shape):
                    continue
                path = Path(tmp) / f"{shape}-{qtype}.gguf"
                t0 = time.perf_counter()
                write_tiny_model(
                    path, arch, qtype, d, ff, n_layer, h, hk, vocab, 4096, tied=False, fast=True
                )
                made = time.perf_counter() - t0
                rows += bench_file(path, shape, qtype, args, write_s=made)
                path.unlink()
            for depth in [] if args.no_torch or shape not in SHAPES else args.depth:
                r = bench_torch(shape, args.n_prompt, args.n_gen, depth)
                r.update(shape=shape, type="F16", peer="torch", depth=depth)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print()
    pp, tg = f"pp{args.n_prompt} tok/s", f"tg{args.n_gen} tok/s"
    bt = f"batch {args.batch} tok/s"
    print(f"| shape | weights | peer | depth | {pp} | {tg} | % of copy bw | {bt} | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        share = r.get("weight_bytes", 0) * r["tg"] / copy * 100
        batch = "- | -"
        if "tg_batch" in r:
            batch = f"{r['tg_batch']:.0f} | {r['tg_batch'] / r['tg']:.2f}x"
        print(
            f"| {r['shape']} | {r['type']} | {r['peer']} | {r['depth']} | {r['pp']:.0f} | "
            f"{r['tg']:.0f} | "
            f"{share:.0f} % | {batch} |"
        )
    for r in rows:
        if "engine_tg" in r:
            print(
                f"engine, {r['shape']} {r['type']}, depth {r['depth']}: one sequence "
                f"{r['engine_tg']:.0f} tok/s, {args.batch} joining and leaving "
                f"{r['engine_batch']:.0f} tok/s = {r['engine_batch'] / r['engine_tg']:.2f}x, "
                f"while all {args.batch} run {r['engine_steady']:.0f} tok/s = "
                f"{r['engine_steady'] / r['engine_tg']:.2f}x ({r['engine_prefilled']} prompt "
                f"tokens run); one sequence's step {r['engine_step_ms']:.3f} ms, of which the "
                f"pass {r['engine_pass_ms']:.3f} ms; without --ignore-eos (a top-1 pick, "
                f"{r['engine_tg_top1']:.0f} tok/s)"
            )
    if args.json:
        args.json.write_text(json.dumps({"copy_bw": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
