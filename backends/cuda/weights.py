"""GGUF weight blocks repacked once, on the device, into the planes the CUDA kernels read.

Every format becomes groups of 32 weights with the same nibble order (byte i of a group holds
weights i and i + 16), split into planes so each load is aligned and coalesced. The layouts
are described in formats.cuh; the plane order of each format here is the order its kernel
struct reads them (P.p[0], P.p[1], ...).
"""

from __future__ import annotations

import cupy as cp

from fastrun.formats.errors import FastrunError

# qtype -> kernel struct in formats.cuh (float formats have their own kernels)
KERNEL_FORMATS = {
    "Q4_0": "FmtQ4_0",
    "Q4_1": "FmtQ4_1",
    "Q5_0": "FmtQ5_0",
    "Q5_1": "FmtQ5_1",
    "Q8_0": "FmtQ8_0",
    "Q4_K": "FmtQ4_K",
    "Q5_K": "FmtQ5_K",
    "Q6_K": "FmtQ6_K",
}
FLOAT_FORMATS = {"F16": cp.float16, "F32": cp.float32}
# rows past a matrix's last that the tensor-core kernel may read (it copies blocks of 16 rows
# without a bound check; the results of those rows are never stored)
ROW_SLACK = 15
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _field(blocks, start: int, stop: int, dtype=cp.uint8):
    """Bytes [start, stop) of every block, as a contiguous array of dtype [n_out, -1]."""
    return cp.ascontiguousarray(blocks[..., start:stop]).view(dtype).reshape(blocks.shape[0], -1)


def _pack_group_nibbles(q):
    """q [..., 32] values 0..15 -> [..., 16] bytes: weight i low, weight i + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(cp.uint8)


def _bit_plane(bits):
    """bits [..., 32] of 0/1 -> uint32 [...]: bit i = weight i."""
    shifts = cp.arange(32, dtype=cp.uint32)
    return (bits.astype(cp.uint32) << shifts).sum(axis=-1, dtype=cp.uint32)


def _k_scales(scales):
    """Q4_K/Q5_K 12-byte fields [..., 12] -> 6-bit scales and mins [..., 8] (uint8)."""
    s = scales.astype(cp.int32)
    sc = cp.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = cp.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(cp.uint8), mn.astype(cp.uint8)


def _block32(blocks, qtype: str, n_out: int):
    """Q4_0 ... Q8_0: the block's own fields are the planes."""
    d = _field(blocks, 0, 2, cp.float16)
    if qtype == "Q4_0":
        return [_field(blocks, 2, 18), d]
    if qtype == "Q4_1":
        return [_field(blocks, 4, 20), d, _field(blocks, 2, 4, cp.float16)]
    if qtype == "Q5_0":
        return [_field(blocks, 6, 22), d, _field(blocks, 2, 6, cp.uint32)]
    if qtype == "Q5_1":
        return [
            _field(blocks, 8, 24),
            d,
            _field(blocks, 2, 4, cp.float16),
            _field(blocks, 4, 8, cp.uint32),
        ]
    return [_field(blocks, 2, 34), d]  # Q8_0


def _k_quant(blocks, qtype: str, n_out: int):
    """Q4_K/Q5_K/Q6_K super-blocks regrouped into groups of 32."""
    sb = blocks.shape[1]
    if qtype == "Q6_K":
        ql = blocks[..., 0:128].astype(cp.int32).reshape(n_out, sb, 2, 64)
        qh = blocks[..., 128:192].astype(cp.int32).reshape(n_out, sb, 2, 32)
        low = cp.concatenate(
            [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1
        )  # [n_out, sb, 2, 128]: weights in order
        high = cp.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
        low, high = low.reshape(n_out, sb * 8, 32), high.reshape(n_out, sb * 8, 32)
        shifts = 2 * cp.arange(16, dtype=cp.uint32)
        pairs = (high.astype(cp.uint32).reshape(n_out, sb * 8, 2, 16) << shifts).sum(
            axis=-1, dtype=cp.uint32
        )
        scales = _field(blocks, 192, 208, cp.int8)
        d = _field(blocks, 208, 210, cp.float16)
        return [_pack_group_nibbles(low).reshape(n_out, -1), scales, d, pairs.reshape(n_out, -1)]
    d, dmin = _field(blocks, 0, 2, cp.float16), _field(blocks, 2, 4, cp.float16)
    sc, mn = _k_scales(blocks[..., 4:16])
    qs_at = 16 if qtype == "Q4_K" else 48
    qs = blocks[..., qs_at : qs_at + 128].astype(cp.int32).reshape(n_out, sb, 4, 32)
    q = cp.stack([qs & 15, qs >> 4], axis=3).reshape(n_out, sb * 8, 32)  # sub-blocks in order
    planes = [
        _pack_group_nibbles(q).reshape(n_out, -1),
        sc.reshape(n_out, -1),
        mn.reshape(n_out, -1),
        d,
        dmin,
    ]
    if qtype == "Q5_K":
        qh = blocks[..., 16:48].astype(cp.int32)  # bit j of qh[i]: weight i of sub-block j
        bits = (qh[:, :, None, :] >> cp.arange(8)[None, None, :, None]) & 1
        planes.append(_bit_plane(bits).reshape(n_out, -1))
    return planes


def with_slack(plane):
    """plane [n_out, ...] copied into memory ROW_SLACK rows longer (left unset); a view of
    its first n_out rows."""
    room = cp.empty((plane.shape[0] + ROW_SLACK, *plane.shape[1:]), plane.dtype)
    room[: plane.shape[0]] = plane
    return room[: plane.shape[0]]


def repack(raw, qtype: str, n_out: int, n_in: int) -> list:
    """Raw GGUF rows (host or device uint8 [n_out, row_bytes]) -> device planes (with slack,
    for quantized formats)."""
    raw = cp.asarray(raw).reshape(n_out, -1)
    if qtype in FLOAT_FORMATS:
        return [raw.view(FLOAT_FORMATS[qtype]).reshape(n_out, n_in)]
    if qtype in BLOCK_BYTES:
        blocks = raw.reshape(n_out, n_in // 32, BLOCK_BYTES[qtype])
        return [with_slack(p) for p in _block32(blocks, qtype, n_out)]
    if qtype in SUPER_BYTES:
        blocks = raw.reshape(n_out, n_in // 256, SUPER_BYTES[qtype])
        return [with_slack(p) for p in _k_quant(blocks, qtype, n_out)]
    raise FastrunError(f"the CUDA backend has no matmul for {qtype} weights")
