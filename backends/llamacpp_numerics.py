"""The constants of llama.cpp's CPU arithmetic that fastrun's backends reproduce bit for bit
(ggml-cpu/vec.h, AVX-512 build): the CPU kernels (backends/cpu/ops.py, simd.py) and the NumPy
reference (backends/reference.py) take them from here.

ggml_v_expf computes exp(x) = 2^n (1 + b p(b)): n = round(x log2 e), by adding and taking
away EXPF_ROUNDER; b = x - n ln 2, with ln 2 in two parts; p of degree 5, EXPF_POLY from
the highest power down; past |n| = EXPF_LIMIT the result is 0 or infinity.
"""

import numpy as np

LANES = 16  # floats per AVX-512 vector: the lanes its products and softmax sum over

EXPF_ROUNDER = np.float32(float.fromhex("0x1.8p23"))
EXPF_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
EXPF_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
EXPF_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
EXPF_POLY = tuple(
    np.float32(float.fromhex(c))
    for c in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")
)
EXPF_LIMIT = np.float32(192)
