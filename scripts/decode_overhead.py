#!/usr/bin/env python3
"""Per-token time of a decode step spent outside the compiled kernels (Python, dispatch,
allocation), and the split by kernel.

    python scripts/decode_overhead.py smollm2-135m-instruct
"""

from __future__ import annotations

import collections
import sys
import time

import numpy as np


def main() -> None:
    import fastrun
    from fastrun.backends.cpu import activations, fused, matmul, ops, stack
    from fastrun.quant import fast

    model = fastrun.load(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct", n_ctx=256)
    tf = model.transformer
    cache = tf.new_cache(256)
    tf.forward(list(range(1, 9)), cache)  # compile everything before the wrappers go in
    tf.forward([1], cache)
    spent: dict[str, float] = collections.defaultdict(float)
    for module in (activations, fused, matmul, ops, stack, fast):
        for name in dir(module):
            fn = getattr(module, name)
            if hasattr(fn, "py_func"):  # a Numba dispatcher: time every call

                def timed(*args, _fn=fn, _name=f"{module.__name__.rsplit('.', 1)[-1]}.{name}"):
                    t0 = time.perf_counter()
                    result = _fn(*args)
                    spent[_name] += time.perf_counter() - t0
                    return result

                setattr(module, name, timed)
    steps, token = 64, 1
    tf.forward([token], cache)
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(tf.forward([token], cache)[-1]))
    total = (time.perf_counter() - t0) / steps * 1e3
    inside = sum(spent.values()) / steps * 1e3
    print(f"decode step {total:.2f} ms: kernels {inside:.2f} ms, outside {total - inside:.2f} ms")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {s / steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
