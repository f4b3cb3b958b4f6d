"""Numba quantizers: float32 rows to raw GGML blocks, byte for byte as llama.cpp writes them.

Each kernel follows llama.cpp's `quantize_row_*_ref` (ggml-quants.c), the path llama-quantize
takes without an importance matrix, in the same float32 operation order (ggml-quants.c is built
for baseline x86-64, so nothing there is fused or reassociated). Every scalar is kept float32 on
purpose: one float64 intermediate would change a rounding somewhere in a large tensor.
Rows are independent: the kernels release the GIL (nogil) and callers run slabs of rows on
several threads at once (quant.pipeline), which keeps every thread busy across tensor borders
instead of meeting at a barrier after each parallel call.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from fastrun.formats.errors import GGUFError
from fastrun.quant.fast import f16_round
from fastrun.quant.float_types import float_rows
from fastrun.quant.formats import block_format

_JIT = dict(nogil=True, cache=True, fastmath=False)
_f32 = np.float32
GROUP_MAX_EPS = np.float32(1e-15)


@nb.njit(inline="always", **_JIT)
def f16_bits(x):
    """IEEE half bits of x rounded to nearest, ties to even (as GGML_FP32_TO_FP16)."""
    if x != x:
        return 0x7E00
    r = f16_round(x)
    sign = 0x8000 if (r < 0 or (r == 0 and math.copysign(1.0, r) < 0)) else 0
    a = abs(r)
    if a == 0:
        return sign
    if a == np.inf:
        return sign | 0x7C00
    _, e = math.frexp(a)  # a = m * 2**e with 0.5 <= m < 1, so the half exponent is e + 14
    biased = e + 14
    if biased <= 0:  # subnormal: a whole number of 2**-24 steps
        return sign | int(a * 16777216.0)
    mantissa = int((a / 2.0 ** (e - 1) - 1.0) * 1024.0)
    return sign | (biased << 10) | mantissa


@nb.njit(inline="always", **_JIT)
def _put_f16(out, o, x):
    h = f16_bits(x)
    out[o] = h & 255
    out[o + 1] = h >> 8


@nb.njit(inline="always", **_JIT)
def nearest_int(v):
    """llama.cpp's nearest_int: round half to even (the 1.5 * 2**23 trick)."""
    return int(np.rint(v))


@nb.njit(inline="always", **_JIT)
def _int8_trunc(v):
    """C's (int8_t) conversion of a float: truncation toward zero, wrapped to 8 bits."""
    return ((int(v) + 128) & 255) - 128


# -- 32-blocks ----------------------------------------------------------------------------------


@nb.njit(inline="always", **_JIT)
def _q45_block(x, i0, out, o, affine, five_bit):
    """Q4_0/Q5_0 (symmetric: d = signed absmax / -8 or -16) and Q4_1/Q5_1 (affine: d = (max -
    min) / 15 or 31, m = min). Levels are 4 bits in qs, the fifth bit (Q5) in a 32-bit qh."""
    lo = _f32(0)
    if affine:
        lo = _f32(3.4028234663852886e38)  # FLT_MAX
        hi = -lo
        for j in range(32):
            v = x[i0 + j]
            if v < lo:
                lo = v
            if v > hi:
                hi = v
        d = (hi - lo) / _f32(31 if five_bit else 15)
        offset = _f32(0.5)
    else:
        amax = _f32(0)
        mx = _f32(0)
        for j in range(32):
            v = x[i0 + j]
            if amax < abs(v):
                amax = abs(v)
                mx = v
        half_levels = 16 if five_bit else 8
        d = mx / _f32(-half_levels)
        offset = _f32(half_levels) + _f32(0.5)
    idv = _f32(1) / d if d != 0 else _f32(0)
    _put_f16(out, o, d)
    if affine:
        _put_f16(out, o + 2, lo)
    top = 31 if five_bit else 15
    clamp = not (affine and five_bit)  # Q5_1 converts straight to uint8; the others clamp
    qh_at = o + (4 if affine else 2)
    qs = qh_at + (4 if five_bit else 0)
    qh = 0
    for j in range(16):
        # (x - 0) is x exactly, so the symmetric types compute C's x * id + offset
        a = _int8_trunc((x[i0 + j] - lo) * idv + offset)
        b = _int8_trunc((x[i0 + 16 + j] - lo) * idv + offset)
        if clamp:
            a = min(top, a)
            b = min(top, b)
        a &= 255
        b &= 255
        out[qs + j] = (a & 15) | ((b & 15) << 4)
        qh |= ((a >> 4) & 1) << j
        qh |= ((b >> 4) & 1) << (j + 16)
    if five_bit:
        for k in range(4):
            out[qh_at + k] = (qh >> (8 * k)) & 255


@nb.njit(inline="always", **_JIT)
def _q8_0_block(x, i0, out, o):
    amax = _f32(0)
    for j in range(32):
        amax = max(amax, abs(x[i0 + j]))
    d = amax / _f32(127)
    idv = _f32(1) / d if d != 0 else _f32(0)
    _put_f16(out, o, d)
    for j in range(32):
        v = x[i0 + j] * idv
        q = math.floor(abs(v) + 0.5)  # roundf: half away from zero (exact in float64)
        out[o + 2 + j] = int(q if v >= 0 else -q) & 255


@nb.njit(**_JIT)
def _quantize_32(x, out, kind):
    """Rows of x [n_rows, n] into out [n_rows, row_bytes]; kind selects the format."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        orow = out[r]
        for b in range(n // 32):
            if kind == 0:
                _q45_block(xr, 32 * b, orow, 18 * b, False, False)
            elif kind == 1:
                _q45_block(xr, 32 * b, orow, 20 * b, True, False)
            elif kind == 2:
                _q45_block(xr, 32 * b, orow, 22 * b, False, True)
            elif kind == 3:
                _q45_block(xr, 32 * b, orow, 24 * b, True, True)
            else:
                _q8_0_block(xr, 32 * b, orow, 34 * b)


_KIND_32 = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4}


# -- K-quants -----------------------------------------------------------------------------------


@nb.njit(inline="always", **_JIT)
def _levels(x, x0, n, iscale, mn, nmax, Lf):
    """Lf[:n] = clamp(nearest_int(iscale * (x - mn)), 0, nmax), kept as float32: the values are
    small integers, so this is C's int arithmetic exactly, in a loop without sums that LLVM
    vectorizes (rint is the 1.5 * 2**23 trick's round half to even)."""
    top = _f32(nmax)
    for i in range(n):
        Lf[i] = min(top, max(_f32(0), np.rint(iscale * (x[x0 + i] - mn))))


@nb.njit(inline="always", **_JIT)
def _min_max_sums(x, x0, n, w, w0):
    """make_qkx2_quants' first pass: min (at most 0), max, sum of weights, weighted sum."""
    mn = x[x0]
    mx = x[x0]
    sum_w = w[w0]
    sum_x = sum_w * x[x0]
    for i in range(1, n):
        xi = x[x0 + i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        sum_w += w[w0 + i]
        sum_x += w[w0 + i] * xi
    if mn > 0:
        mn = _f32(0)
    return mn, mx, sum_w, sum_x


@nb.njit(inline="always", **_JIT)
def _first_error(x, x0, n, w, w0, L, l0, Lf, f0, iscale, mn, nmax, scale):
    """The levels at the first scale into L[l0:] and their weighted squared error."""
    _levels(x, x0, n, iscale, mn, nmax, Lf[f0:])
    error = _f32(0)
    for i in range(n):
        L[l0 + i] = int(Lf[f0 + i])
        diff = scale * Lf[f0 + i] + mn - x[x0 + i]
        error += w[w0 + i] * (diff * diff)
    return error


@nb.njit(inline="always", **_JIT)
def _candidate(sum_w, sum_x, sum_l, sum_l2, sum_xl):
    """(whether C considers it: D > 0, scale, min) of one candidate's least-squares fit."""
    det = sum_w * sum_l2 - sum_l * sum_l
    if det > 0:
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        if this_min > 0:
            this_min = _f32(0)
            this_scale = sum_xl / sum_l2
        return True, this_scale, this_min
    return False, _f32(0), _f32(0)


@nb.njit(inline="always", **_JIT)
def make_qkx2_pair(x, x0, n, nmax, w, L, l0, Lf, rmin, rdelta, nstep):
    """llama.cpp's make_qkx2_quants (use_mad false) for two sub-blocks side by side:
    x[x0:x0+n] (weights w[:n], levels into L[l0:]) and the next n values (w[n:2n], L[l0+n:]);
    Lf is scratch for 2n. Returns (scale, -min) of each.

    One sub-block's sums are chains of dependent additions, the search's time; each sub-block
    keeps C's order (one accumulator, value by value: its rounding picks the candidate), but the
    two chains interleave in every loop, so the core overlaps them. A flat sub-block (C returns
    before the search) runs along with a span of 1, its levels all 0 and D = 0, so its state
    never changes; its result is C's at the end."""
    xb = x0 + n
    mn_a, mx_a, sum_w_a, sum_x_a = _min_max_sums(x, x0, n, w, 0)
    mn_b, mx_b, sum_w_b, sum_x_b = _min_max_sums(x, xb, n, w, n)
    flat_a = mx_a == mn_a
    flat_b = mx_b == mn_b
    span_a = _f32(1) if flat_a else mx_a - mn_a
    span_b = _f32(1) if flat_b else mx_b - mn_b
    iscale_a = _f32(nmax) / span_a
    iscale_b = _f32(nmax) / span_b
    scale_a = _f32(1) / iscale_a
    scale_b = _f32(1) / iscale_b
    best_a = _first_error(x, x0, n, w, 0, L, l0, Lf, 0, iscale_a, mn_a, nmax, scale_a)
    best_b = _first_error(x, xb, n, w, n, L, l0 + n, Lf, n, iscale_b, mn_b, nmax, scale_b)
    for step in range(nstep + 1):
        top = rmin + rdelta * _f32(step) + _f32(nmax)
        _levels(x, x0, n, top / (_f32(1) if flat_a else mx_a - mn_a), mn_a, nmax, Lf[:n])
        _levels(x, xb, n, top / (_f32(1) if flat_b else mx_b - mn_b), mn_b, nmax, Lf[n:])
        sum_l_a = sum_l2_a = sum_xl_a = _f32(0)
        sum_l_b = sum_l2_b = sum_xl_b = _f32(0)
        for i in range(n):
            la = Lf[i]
            lb = Lf[n + i]
            sum_l_a += w[i] * la
            sum_l_b += w[n + i] * lb
            sum_l2_a += w[i] * la * la
            sum_l2_b += w[n + i] * lb * lb
            sum_xl_a += w[i] * la * x[x0 + i]
            sum_xl_b += w[n + i] * lb * x[xb + i]
        ok_a, this_scale_a, this_min_a = _candidate(sum_w_a, sum_x_a, sum_l_a, sum_l2_a, sum_xl_a)
        ok_b, this_scale_b, this_min_b = _candidate(sum_w_b, sum_x_b, sum_l_b, sum_l2_b, sum_xl_b)
        if not (ok_a or ok_b):
            continue
        error_a = _f32(0)
        error_b = _f32(0)
        for i in range(n):
            diff_a = this_scale_a * Lf[i] + this_min_a - x[x0 + i]
            diff_b = this_scale_b * Lf[n + i] + this_min_b - x[xb + i]
            error_a += w[i] * (diff_a * diff_a)
            error_b += w[n + i] * (diff_b * diff_b)
        if ok_a and error_a < best_a:
            for i in range(n):
                L[l0 + i] = int(Lf[i])
            best_a, scale_a, mn_a = error_a, this_scale_a, this_min_a
        if ok_b and error_b < best_b:
            for i in range(n):
                L[l0 + n + i] = int(Lf[n + i])
            best_b, scale_b, mn_b = error_b, this_scale_b, this_min_b
    if flat_a:
        scale_a = _f32(0)
        for i in range(n):
            L[l0 + i] = 0
    if flat_b:
        scale_b = _f32(0)
        for i in range(n):
            L[l0 + n + i] = 0
    return scale_a, -mn_a, scale_b, -mn_b


@nb.njit(inline="always", **_JIT)
def _k_scale_min(s, j):
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


@nb.njit(inline="always", **_JIT)
def _qk45_block(x, x0, out, o, nmax, rmin, nstep, L, Laux, w, scales, mins, sc):
    """One Q4_K (nmax 15) or Q5_K (31) super-block: 8 sub-blocks of 32 with 6-bit scale/min."""
    for pair in range(4):
        for j in range(2 * pair, 2 * pair + 2):
            sum_x2 = _f32(0)
            for l in range(32):
                v = x[x0 + 32 * j + l]
                sum_x2 += v * v
            av_x = np.float32(math.sqrt(sum_x2 / _f32(32)))
            for l in range(32):
                w[32 * (j & 1) + l] = av_x + abs(x[x0 + 32 * j + l])
        j = 2 * pair
        scales[j], mins[j], scales[j + 1], mins[j + 1] = make_qkx2_pair(
            x, x0 + 32 * j, 32, nmax, w, L, 32 * j, Laux, rmin, _f32(0.1), nstep
        )
    max_scale = _f32(0)
    max_min = _f32(0)
    for j in range(8):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = _f32(63) / max_scale if max_scale > 0 else _f32(0)
    inv_min = _f32(63) / max_min if max_min > 0 else _f32(0)
    for k in range(12):
        sc[k] = 0
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 255)
        lm = min(63, nearest_int(inv_min * mins[j]) & 255)
        if j < 4:
            sc[j] = ls
            sc[j + 4] = lm
        else:
            sc[j + 4] = (ls & 15) | ((lm & 15) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d_all = max_scale / _f32(63)
    dmin_all = max_min / _f32(63)
    _put_f16(out, o, d_all)
    _put_f16(out, o + 2, dmin_all)
    for k in range(12):
        out[o + 4 + k] = sc[k]
    d16 = f16_round(d_all)
    dmin16 = f16_round(dmin_all)
    for j in range(8):
        s6, m6 = _k_scale_min(sc, j)
        d = d16 * _f32(s6)
        if d == 0:
            continue
        dm = dmin16 * _f32(m6)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int((x[x0 + 32 * j + i] + dm) / d)))
    if nmax == 15:
        for c in range(4):  # 64 values per 32 bytes: low nibbles first, then high
            for l in range(32):
                out[o + 16 + 32 * c + l] = L[64 * c + l] | (L[64 * c + 32 + l] << 4)
    else:
        qh = o + 16
        qs = o + 48
        for l in range(32):
            out[qh + l] = 0
        for c in range(4):
            for l in range(32):
                a = L[64 * c + l]
                b = L[64 * c + 32 + l]
                out[qh + l] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1))
                out[qs + 32 * c + l] = (a & 15) | ((b & 15) << 4)


@nb.njit(inline="always", **_JIT)
def _signed_levels(x, x0, n, iscale, nmax, Lf):
    """Lf[:n] = clamp(nearest_int(iscale * x), -nmax, nmax - 1) as float32 (see _levels)."""
    lo = _f32(-nmax)
    hi = _f32(nmax - 1)
    for i in range(n):
        Lf[i] = min(hi, max(lo, np.rint(iscale * x[x0 + i])))


@nb.njit(inline="always", **_JIT)
def _signed_max(x, x0, n):
    """(largest magnitude, the first value having it), as C's loop finds them."""
    amax = _f32(0)
    mx = _f32(0)
    for i in range(n):
        ax = abs(x[x0 + i])
        if ax > amax:
            amax = ax
            mx = x[x0 + i]
    return amax, mx


@nb.njit(inline="always", **_JIT)
def make_qx_pair(x, x0, n, nmax, L, l0, Lf, wv, wx):
    """llama.cpp's make_qx_quants with rmse_type 1 (weights x**2), no importance matrix, for
    two sub-blocks side by side: x[x0:x0+n] (levels into L[l0:]) and the next n values
    (L[l0+n:]); Lf, wv, wx are scratch for 2n (the weights w = x*x and the products w*x, which
    C recomputes in every step). Returns the two scales.

    Each sub-block's sums keep C's order (sumlx += (w*x)*l, suml2 += (w*l)*l); the two
    sub-blocks' chains of additions interleave (see make_qkx2_pair). An all-zero sub-block
    (C returns at once) runs along with a max of 1: its levels are 0 and suml2 stays 0, so
    nothing of it changes before its result is set at the end."""
    xb = x0 + n
    amax_a, mx_a = _signed_max(x, x0, n)
    amax_b, mx_b = _signed_max(x, xb, n)
    zero_a = amax_a < GROUP_MAX_EPS
    zero_b = amax_b < GROUP_MAX_EPS
    if zero_a:
        mx_a = _f32(1)
    if zero_b:
        mx_b = _f32(1)
    for i in range(2 * n):
        xi = x[x0 + i]
        wv[i] = xi * xi
        wx[i] = wv[i] * xi
    _signed_levels(x, x0, n, _f32(-nmax) / mx_a, nmax, Lf[:n])
    _signed_levels(x, xb, n, _f32(-nmax) / mx_b, nmax, Lf[n:])
    sumlx_a = suml2_a = sumlx_b = suml2_b = _f32(0)
    for i in range(n):
        L[l0 + i] = int(Lf[i]) + nmax
        L[l0 + n + i] = int(Lf[n + i]) + nmax
        sumlx_a += wx[i] * Lf[i]
        sumlx_b += wx[n + i] * Lf[n + i]
        suml2_a += wv[i] * Lf[i] * Lf[i]
        suml2_b += wv[n + i] * Lf[n + i] * Lf[n + i]
    scale_a = sumlx_a / suml2_a if suml2_a != 0 else _f32(0)
    scale_b = sumlx_b / suml2_b if suml2_b != 0 else _f32(0)
    best_a = scale_a * sumlx_a
    best_b = scale_b * sumlx_b
    for step in range(-9, 10):
        if step == 0:
            continue
        top = -(_f32(nmax) + _f32(0.1) * _f32(step))
        _signed_levels(x, x0, n, top / mx_a, nmax, Lf[:n])
        _signed_levels(x, xb, n, top / mx_b, nmax, Lf[n:])
        sumlx_a = suml2_a = sumlx_b = suml2_b = _f32(0)
        for i in range(n):
            sumlx_a += wx[i] * Lf[i]
            sumlx_b += wx[n + i] * Lf[n + i]
            suml2_a += wv[i] * Lf[i] * Lf[i]
            suml2_b += wv[n + i] * Lf[n + i] * Lf[n + i]
        if suml2_a > 0 and sumlx_a * sumlx_a > best_a * suml2_a:
            for i in range(n):
                L[l0 + i] = int(Lf[i]) + nmax
            scale_a = sumlx_a / suml2_a
            best_a = scale_a * sumlx_a
        if suml2_b > 0 and sumlx_b * sumlx_b > best_b * suml2_b:
            for i in range(n):
                L[l0 + n + i] = int(Lf[n + i]) + nmax
            scale_b = sumlx_b / suml2_b
            best_b = scale_b * sumlx_b
    if zero_a:
        scale_a = _f32(0)
        for i in range(n):
            L[l0 + i] = 0
    if zero_b:
        scale_b = _f32(0)
        for i in range(n):
            L[l0 + n + i] = 0
    return scale_a, scale_b


@nb.njit(inline="always", **_JIT)
def _q6_k_block(x, x0, out, o, L, scales, Lf, wv, wx):
    max_scale = _f32(0)
    max_abs_scale = _f32(0)
    for ib in range(0, 16, 2):
        scales[ib], scales[ib + 1] = make_qx_pair(x, x0 + 16 * ib, 16, 32, L, 16 * ib, Lf, wv, wx)
    for ib in range(16):
        s = scales[ib]
        if abs(s) > max_abs_scale:
            max_abs_scale = abs(s)
            max_scale = s
    if max_abs_scale < GROUP_MAX_EPS:
        for k in range(210):
            out[o + k] = 0
        return
    iscale = _f32(-128) / max_scale
    d_all = _f32(1) / iscale
    _put_f16(out, o + 208, d_all)
    for ib in range(16):
        out[o + 192 + ib] = min(127, nearest_int(iscale * scales[ib])) & 255
    d16 = f16_round(d_all)
    for j in range(16):
        s8 = np.int8(out[o + 192 + j])
        d = d16 * _f32(s8)
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(x[x0 + 16 * j + i] / d))) + 32
    for half in range(2):  # two halves of 128 values: 64 bytes of ql and 32 of qh each
        ql = o + 64 * half
        qh = o + 128 + 32 * half
        b = 128 * half
        for l in range(32):
            q1 = L[b + l]
            q2 = L[b + l + 32]
            q3 = L[b + l + 64]
            q4 = L[b + l + 96]
            out[ql + l] = (q1 & 15) | ((q3 & 15) << 4)
            out[ql + l + 32] = (q2 & 15) | ((q4 & 15) << 4)
            out[qh + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@nb.njit(**_JIT)
def _quantize_k(x, out, kind):
    """Rows of x [n_rows, n] into K-quant blocks; kind 0 = Q4_K, 1 = Q5_K, 2 = Q6_K."""
    n_rows, n = x.shape
    L = np.zeros(256, np.int32)  # scratch, reused by every block
    Laux = np.zeros(64, np.float32)  # two sub-blocks' worth (make_qkx2_pair)
    w = np.zeros(64, np.float32)
    wx = np.zeros(32, np.float32)
    scales = np.zeros(16, np.float32)
    mins = np.zeros(8, np.float32)
    sc = np.zeros(12, np.int32)
    for r in range(n_rows):
        xr = x[r]
        orow = out[r]
        for b in range(n // 256):
            if kind == 0:
                _qk45_block(
                    xr, 256 * b, orow, 144 * b, 15, _f32(-1), 20, L, Laux, w, scales, mins, sc
                )
            elif kind == 1:
                _qk45_block(
                    xr, 256 * b, orow, 176 * b, 31, _f32(-0.5), 15, L, Laux, w, scales, mins, sc
                )
            else:
                _q6_k_block(xr, 256 * b, orow, 210 * b, L, scales, Laux, w, wx)


_KIND_K = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}


def quantize_rows(x: np.ndarray, qtype: str | int) -> np.ndarray:
    """Quantize float32 rows [n_rows, n] to raw bytes [n_rows, row_bytes] of the given type."""
    fmt = block_format(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    n_rows, n = x.shape
    row_bytes = fmt.row_bytes(n)
    if fmt.name in ("F32", "F16", "BF16"):
        return float_rows(x, fmt.name)
    out = np.empty((n_rows, row_bytes), np.uint8)
    if fmt.name in _KIND_32:
        _quantize_32(x, out, _KIND_32[fmt.name])
    elif fmt.name in _KIND_K:
        _quantize_k(x, out, _KIND_K[fmt.name])
    else:
        raise GGUFError(f"no quantizer for {fmt.name}")
    return out
