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
// col/32), or group-major, the tensor-core kernel's layout (gid = col/32 * n8 + row, with n
// rounded up to n8, whole fragments of 8 tokens).
__device__ __forceinline__ long long act_group(long long row, int col, int n, int K,
                                               int group_major) {
    return group_major ? (long long)(col >> 5) * ((n + 7) & ~7) + row
                       : row * (K >> 5) + (col >> 5);
}

// Byte of value i (< 32) within its group: in order, or group-major with the group's eight
// 4-byte words as 0 4 1 5 2 6 3 7, so that a lane's two B-fragment words (t and 4 + t) are
// one 8-byte load.
__device__ __forceinline__ int act_byte(int i, int group_major) {
    return group_major ? (((i >> 2) & 3) * 2 + (i >> 4)) * 4 + (i & 3) : i;
}

// Q8_0/Q8_1 quantization of 32 values, one per lane of a warp, into group gid (x86 SIMD
// rounding: inverse scale 127 / amax, half to even); lane 0 writes d and d * sum(q), each
// rounded to fp16 as the block formats store them.
__device__ __forceinline__ void quantize_q8_32(float v, long long gid, int group_major,
                                               signed char* xq, float* xd, float* xs) {
    const float amax = warp_max(fabsf(v));
    const float inv = amax != 0.f ? 127.f / amax : 0.f;
    const int q = __float2int_rn(v * inv);
    xq[gid * 32 + act_byte(threadIdx.x & 31, group_major)] = (signed char)q;
    const int sum = warp_sum_int(q);
    if ((threadIdx.x & 31) == 0) {
        const float d = amax / 127.f;
        xd[gid] = __half2float(__float2half_rn(d));
        xs[gid] = __half2float(__float2half_rn(d * (float)sum));
    }
}
