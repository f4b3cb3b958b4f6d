// Token selection on the device: the k largest logits of each row, best first and the lower
// id first on ties, so that a decode step sends back k candidates instead of the whole row.
//
// Block (chunk, row) takes SELECT_CHUNK logits of its row and keeps its best k (k rounds of a
// block-wide argmax); the last block of the row to finish merges the chunks' candidates the
// same way and resets the row's ticket for the next launch.
#include "launch.cuh"

#define SELECT_CHUNK 4096
#define SELECT_THREADS 512
#define SELECT_MAX 64  // largest k; chunks * k must not pass SELECT_CHUNK (backend.py checks)
#define NEG_INF __int_as_float(0xff800000)

// (va, ia) ranks before (vb, ib): larger value, then lower id. NaN ranks last (loaded as -inf).
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

// The best of (v, i) over the lanes of a warp, in every lane.
__device__ __forceinline__ void warp_best(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        if (ranks_before(v2, i2, v, i)) {
            v = v2;
            i = i2;
        }
    }
}

// The best of (v, i) over the block, in (sv[0], si[0]) for every thread to read; sv, si hold
// a pair per warp.
__device__ void argmax_block(float v, int i, float* sv, int* si) {
    warp_best(v, i);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        const bool held = lane < SELECT_THREADS / 32;
        v = held ? sv[lane] : NEG_INF;
        i = held ? si[lane] : 0x7fffffff;
        warp_best(v, i);
        if (lane == 0) {
            sv[0] = v;
            si[0] = i;
        }
    }
    __syncthreads();
}

// Keep the best k of n <= SELECT_CHUNK (value, id) pairs given by get(e) into (out_v, out_i),
// best first: k rounds of a block-wide argmax, each over the pairs that rank after the one
// the round before took. The pairs stay in registers; a bitonic sort of the whole chunk took
// 78 barriers and about 30 us, rounds take two barriers each.
template <class Get>
__device__ void keep_best(Get get, int n, int k, float* sv, int* si, float* out_v, int* out_i) {
    constexpr int PER_THREAD = SELECT_CHUNK / SELECT_THREADS;
    float v[PER_THREAD];
    int id[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int e = threadIdx.x + j * SELECT_THREADS;
        v[j] = NEG_INF;  // padding ranks last, as a missing candidate is reported
        id[j] = 0x7fffffff;
        if (e < n) get(e, v[j], id[j]);
    }
    float taken_v = __int_as_float(0x7f800000);  // (+inf, -1) ranks before every pair
    int taken_i = -1;
    for (int r = 0; r < k; ++r) {
        float best_v = NEG_INF;
        int best_i = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j)
            if (ranks_before(taken_v, taken_i, v[j], id[j]) &&
                ranks_before(v[j], id[j], best_v, best_i)) {
                best_v = v[j];
                best_i = id[j];
            }
        argmax_block(best_v, best_i, sv, si);
        taken_v = sv[0];
        taken_i = si[0];
        if (threadIdx.x == 0) {
            out_v[r] = taken_v;
            out_i[r] = taken_i;
        }
        __syncthreads();  // sv, si read by all before the next round writes them
    }
}

// logits [n, V] (rows `stride` floats apart) -> out_v [n, k], out_i [n, k]; part_v, part_i
// [n, chunks, k] scratch; tickets [n] zero between launches.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    top_k(const float* __restrict__ logits, int V, long long stride, int k, float* part_v,
          int* part_i, int* tickets, float* __restrict__ out_v, int* __restrict__ out_i) {
    pdl_start();
    __shared__ float sv[SELECT_THREADS / 32];
    __shared__ int si[SELECT_THREADS / 32];
    __shared__ int last;
    const int chunk = blockIdx.x, chunks = gridDim.x, row = blockIdx.y;
    const int c0 = chunk * SELECT_CHUNK, n = min(SELECT_CHUNK, V - c0);
    const float* x = logits + row * stride + c0;
    auto from_logits = [&](int e, float& v, int& id) {
        v = x[e];
        v = v == v ? v : NEG_INF;
        id = c0 + e;
    };
    const long long part = ((long long)row * chunks + chunk) * k;
    keep_best(from_logits, n, k, sv, si, part_v + part, part_i + part);

    __threadfence();  // this block's candidates are visible before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&tickets[row], 1) == chunks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long long base = (long long)row * chunks * k;
    auto from_parts = [&](int e, float& v, int& id) {
        v = __ldcg(&part_v[base + e]);
        id = __ldcg(&part_i[base + e]);
    };
    __syncthreads();  // sv, si are reused
    keep_best(from_parts, chunks * k, k, sv, si, out_v + (long long)row * k,
              out_i + (long long)row * k);
    if (threadIdx.x == 0) tickets[row] = 0;
}
