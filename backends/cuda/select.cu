// Token selection on the device: the k largest logits of each row, best first and the lower
// id first on ties, so that a decode step sends back k candidates instead of the whole row.
//
// Block (chunk, row) takes SELECT_CHUNK logits of its row: each warp keeps the best k of its
// share by k rounds of a warp-wide argmax (no barriers), and one warp merges the 16 sorted
// lists. The last block of the row to finish merges the chunks' lists the same way and resets
// the row's ticket for the next launch.
#include "launch.cuh"

#define SELECT_CHUNK 4096
#define SELECT_THREADS 512
#define SELECT_MAX 64  // largest k; chunks * k must not pass SELECT_CHUNK (backend.py checks)
#define SELECT_LISTS_PER_LANE 4  // a merge takes at most 128 lists: chunks (backend.py checks)
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

// One warp: the best k of n_lists lists (list l: k pairs at lv, li + l * k in shared memory,
// best first) into (out_v, out_i), a pair a round. Each lane offers the best unread head of its
// lists (l = lane + 32 j) and the lane whose head the warp takes moves on in that list.
__device__ void merge_lists(const float* lv, const int* li, int n_lists, int k, float* out_v,
                            int* out_i) {
    const int lane = threadIdx.x & 31;
    int read[SELECT_LISTS_PER_LANE] = {};  // pairs taken from each of this lane's lists
    for (int r = 0; r < k; ++r) {
        float v = NEG_INF;  // (-inf, 0x7fffffff): a list's padding, and no list's head
        int i = 0x7fffffff, from = -1;
#pragma unroll
        for (int j = 0; j < SELECT_LISTS_PER_LANE; ++j) {
            const int l = lane + 32 * j;
            if (l < n_lists && read[j] < k) {
                const int at = l * k + read[j];
                if (ranks_before(lv[at], li[at], v, i)) {
                    v = lv[at];
                    i = li[at];
                    from = j;
                }
            }
        }
        float best_v = v;
        int best_i = i;
        warp_best(best_v, best_i);
#pragma unroll
        for (int j = 0; j < SELECT_LISTS_PER_LANE; ++j)  // ids are unique: one lane matches
            if (j == from && v == best_v && i == best_i) ++read[j];
        if (lane == 0) {
            out_v[r] = best_v;
            out_i[r] = best_i;
        }
    }
}

// Keep the best k of n <= SELECT_CHUNK (value, id) pairs given by get(e) into (out_v, out_i),
// best first: each warp its share's best k, by k rounds of a warp-wide argmax over the pairs
// that rank after the one the round before took (kept in registers; no barriers), into wv, wi
// [16 * k]; then warp 0 merges them. Measured on an H200 (BENCHMARKS.md): k = 40 costs about
// 58 us a step more than k = 1 this way, 70 us by block-wide rounds (two barriers a round), and
// 170 us by a bitonic sort of each chunk (78 barriers) and of the merge.
template <class Get>
__device__ void keep_best(Get get, int n, int k, float* wv, int* wi, float* out_v, int* out_i) {
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
    const int warp = threadIdx.x >> 5;
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
        warp_best(best_v, best_i);
        taken_v = best_v;
        taken_i = best_i;
        if ((threadIdx.x & 31) == 0) {
            wv[warp * k + r] = best_v;
            wi[warp * k + r] = best_i;
        }
    }
    __syncthreads();
    if (warp == 0) merge_lists(wv, wi, SELECT_THREADS / 32, k, out_v, out_i);
}

// logits [n, V] (rows `stride` floats apart) -> out_v [n, k], out_i [n, k]; part_v, part_i
// [n, chunks, k] scratch; tickets [n] zero between launches.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    top_k(const float* __restrict__ logits, int V, long long stride, int k, float* part_v,
          int* part_i, int* tickets, float* __restrict__ out_v, int* __restrict__ out_i) {
    pdl_start();
    __shared__ float sv[SELECT_CHUNK];  // the warps' lists, then the chunks'
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
    __syncthreads();  // (and warp 0's merge has read sv, si)
    if (threadIdx.x == 0) last = atomicAdd(&tickets[row], 1) == chunks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long long base = (long long)row * chunks * k;
    for (int e = threadIdx.x; e < chunks * k; e += SELECT_THREADS) {
        sv[e] = __ldcg(&part_v[base + e]);
        si[e] = __ldcg(&part_i[base + e]);
    }
    __syncthreads();
    if (threadIdx.x < 32)
        merge_lists(sv, si, chunks, k, out_v + (long long)row * k, out_i + (long long)row * k);
    if (threadIdx.x == 0) tickets[row] = 0;
}
