// 8-bit activations as the quantized matrix kernels read them (formats.cuh), written by
// matmul.cu's quantize_rows and, for the output projection, by the attention merge (ops.cu).
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Group of column col in row `row` of an [n, K] activation: row-major (gid = row * K/32 +
// col/32), or tiled, the tensor-core kernel's layout: tiles of 16 rows (tokens), each group
// by group with its 16 rows together (gid = (row/16 * K/32 + col/32) * 16 + row % 16; n
// rounded up to whole tiles), so a block's fragments lie at fixed distances from each other.
__device__ __forceinline__ long long act_group(long long row, int col, int K, int tiled) {
    return tiled ? (((row >> 4) * (K >> 5) + (col >> 5)) << 4) + (row & 15)
                 : row * (K >> 5) + (col >> 5);
}

// Byte of value i (< 32) within its group: in order, or tiled with the group's eight 4-byte
// words as 0 4 1 5 2 6 3 7, so that a lane's two B-fragment words (t and 4 + t) are one
// 8-byte load.
__device__ __forceinline__ int act_byte(int i, int tiled) {
    return tiled ? (((i >> 2) & 3) * 2 + (i >> 4)) * 4 + (i & 3) : i;
}

// Q8_0/Q8_1 quantization of 32 values, one per lane of a warp, into group gid (x86 SIMD
// rounding: inverse scale 127 / amax, half to even); lane 0 writes d and d * sum(q), each
// rounded to fp16 as the block formats store them.
__device__ __forceinline__ void quantize_q8_32(float v, long long gid, int tiled,
                                               signed char* xq, float* xd, float* xs) {
    const float amax = warp_max(fabsf(v));
    const float inv = amax != 0.f ? 127.f / amax : 0.f;
    const int q = __float2int_rn(v * inv);
    xq[gid * 32 + act_byte(threadIdx.x & 31, tiled)] = (signed char)q;
    const int sum = warp_sum_int(q);
    if ((threadIdx.x & 31) == 0) {
        const float d = amax / 127.f;
        xd[gid] = __half2float(__float2half_rn(d));
        xs[gid] = __half2float(__float2half_rn(d * (float)sum));
    }
}
