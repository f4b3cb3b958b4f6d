// Token selection on the device: the k largest logits of each row, best first and the lower
// id first on ties, so that a decode step sends back k candidates instead of the whole row.
//
// Block (chunk, row) takes SELECT_CHUNK logits of its row and keeps its best k (a block-wide
// argmax for k = 1, else a bitonic sort in shared memory); the last block of the row to finish
// merges the chunks' candidates the same way and resets the row's ticket for the next launch.
#include "launch.cuh"

#define SELECT_CHUNK 4096
#define SELECT_THREADS 512
#define SELECT_MAX 64  // largest k; chunks * k must not pass SELECT_CHUNK (backend.py checks)
#define NEG_INF __int_as_float(0xff800000)

// (va, ia) ranks before (vb, ib): larger value, then lower id. NaN ranks last (loaded as -inf).
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

// Sort sv/si [SELECT_CHUNK] best first (bitonic: every pair compared at each of 78 stages).
__device__ void sort_block(float* sv, int* si) {
    for (int size = 2; size <= SELECT_CHUNK; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < SELECT_CHUNK / 2; t += SELECT_THREADS) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                const bool best_first = (i & size) == 0;  // this run's direction
                if (ranks_before(sv[j], si[j], sv[i], si[i]) == best_first) {
                    const float v = sv[i];
                    const int id = si[i];
                    sv[i] = sv[j];
                    si[i] = si[j];
                    sv[j] = v;
                    si[j] = id;
                }
            }
            __syncthreads();
        }
}

// The best of (v, i) over the block, in (sv[0], si[0]).
__device__ void argmax_block(float v, int i, float* sv, int* si) {
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        if (ranks_before(v2, i2, v, i)) {
            v = v2;
            i = i2;
        }
    }
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SELECT_THREADS / 32; ++w)
            if (ranks_before(sv[w], si[w], v, i)) {
                v = sv[w];
                i = si[w];
            }
        sv[0] = v;
        si[0] = i;
    }
    __syncthreads();
}

// Keep the best k of n (value, id) pairs given by get(e) into (out_v, out_i).
template <class Get>
__device__ void keep_best(Get get, int n, int k, float* sv, int* si, float* out_v, int* out_i) {
    if (k == 1) {
        float v = NEG_INF;
        int id = 0x7fffffff;
        for (int e = threadIdx.x; e < n; e += SELECT_THREADS) {
            float ve;
            int ie;
            get(e, ve, ie);
            if (ranks_before(ve, ie, v, id)) {
                v = ve;
                id = ie;
            }
        }
        argmax_block(v, id, sv, si);
    } else {
        for (int e = threadIdx.x; e < SELECT_CHUNK; e += SELECT_THREADS) {
            float ve = NEG_INF;
            int ie = 0x7fffffff;
            if (e < n) get(e, ve, ie);
            sv[e] = ve;
            si[e] = ie;
        }
        __syncthreads();
        sort_block(sv, si);
    }
    for (int e = threadIdx.x; e < k; e += SELECT_THREADS) {
        out_v[e] = sv[e];
        out_i[e] = si[e];
    }
}

// logits [n, V] (rows `stride` floats apart) -> out_v [n, k], out_i [n, k]; part_v, part_i
// [n, chunks, k] scratch; tickets [n] zero between launches.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    top_k(const float* __restrict__ logits, int V, long long stride, int k, float* part_v,
          int* part_i, int* tickets, float* __restrict__ out_v, int* __restrict__ out_i) {
    pdl_start();
    __shared__ float sv[SELECT_CHUNK];
    __shared__ int si[SELECT_CHUNK];
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
