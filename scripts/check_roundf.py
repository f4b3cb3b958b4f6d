"""Check, for every float32 v with 0 <= v < 2**22, that trunc(v + HALF_BELOW) in float32 is C's
roundf(v) (half away from zero), the rounding quant/numpy_quantize.py relies on for Q8_0; negative
values are the mirror image (copysign). Takes about a minute on one core.

    python scripts/check_roundf.py
"""

from __future__ import annotations

import numpy as np

from fastrun.quant.numpy_quantize import HALF_BELOW

STEP = 1 << 24  # float32 bit patterns per chunk


def main() -> None:
    end = int(np.float32(2**22).view(np.uint32))
    for start in range(0, end, STEP):
        v = np.arange(start, min(end, start + STEP), dtype=np.uint32).view(np.float32)
        ours = np.trunc(v + HALF_BELOW)
        exact = np.floor(v.astype(np.float64) + 0.5)  # exact in float64: roundf for v >= 0
        bad = np.flatnonzero(ours != exact)
        if bad.size:
            raise SystemExit(f"differs at {v[bad[0]]!r}: {ours[bad[0]]} vs {exact[bad[0]]}")
    print(f"trunc(v + {HALF_BELOW!r}) == roundf(v) for all {end} floats in [0, 2**22)")


if __name__ == "__main__":
    main()
