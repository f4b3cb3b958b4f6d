"""Where the time of one `fastrun quantize` goes: timestamps of the imports, of the start of
the conversion (after typer's parse, the GGUF parse, the plan and the header) and of its end,
with the CPU seconds spent per (source, target) type pair on the worker threads and in writing.

    python scripts/quantize_time_split.py quantize IN.gguf OUT.gguf --type Q4_K_M -t 2 --force

Compare its last line with the process's wall time (`/usr/bin/time`) for the exit's share.
"""

import importlib
import sys
import threading
import time
from collections import defaultdict

START = time.perf_counter()
marks: list[tuple[str, float]] = []
kernel_seconds: dict[tuple[str, str], float] = defaultdict(float)
write_seconds = [0.0]
lock = threading.Lock()


def mark(what: str) -> None:
    marks.append((what, time.perf_counter() - START))


def instrument(pipeline) -> None:
    """Wrap the pipeline's per-slab conversion, its writes and its conversion loop."""
    convert_slab, write, convert_all = (
        pipeline._slab_bytes,
        pipeline.GGUFWriter.write_tensor,
        pipeline._convert_all,
    )

    def timed_slab(job, slab):
        t = time.thread_time()
        out = convert_slab(job, slab)
        with lock:
            kernel_seconds[job.source.format.name, job.target.format.name] += time.thread_time() - t
        return out

    def timed_write(self, *args):
        t = time.perf_counter()
        write(self, *args)
        write_seconds[0] += time.perf_counter() - t

    def timed_all(*args):
        mark("conversion starts (after parse, plan, header)")
        convert_all(*args)
        mark("conversion done")

    pipeline._slab_bytes = timed_slab
    pipeline.GGUFWriter.write_tensor = timed_write
    pipeline._convert_all = timed_all


def main() -> int:
    importlib.import_module("numpy")
    mark("numpy imported")
    importlib.import_module("typer")
    mark("typer imported")
    cli = importlib.import_module("fastrun.runner.cli")
    cli._load_commands(["quantize"])
    mark("cli and quantize command imported")
    instrument(importlib.import_module("fastrun.quant.pipeline"))
    mark("pipeline imported")
    code = cli.main(sys.argv[1:])
    mark("main returned")
    for what, t in marks:
        print(f"{t:7.3f} s  {what}", file=sys.stderr)
    for pair, s in sorted(kernel_seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {pair[0]} -> {pair[1]}: {s:.3f} s CPU on the workers", file=sys.stderr)
    print(f"  writing (main thread): {write_seconds[0]:.3f} s", file=sys.stderr)
    print(f"  process CPU: {time.process_time():.3f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
