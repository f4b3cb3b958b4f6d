// Quantized matrix products: y [n, N] = x [n, K] @ W.T, W [N, K] in repacked planes.
//
// The activation is first quantized to 8 bits as llama.cpp's CPU path pairs it with the
// weight format (quantize_rows), then multiplied in integers: dp4a for a few tokens
// (matvec_q, decode), int8 tensor-core mma for many (matmul_mma, prefill and batches).
#include "formats.cuh"
#include "launch.cuh"
#include "quantize.cuh"

// ---- activation quantization ----------------------------------------------------------------

// silu(g) with exp rounded from double: the correctly rounded expf of the CPU's libm in all
// but the rarest cases, so both backends feed the same values to the 8-bit quantizer.
__device__ __forceinline__ float silu(float g) { return g / (1.f + (float)exp(-(double)g)); }


// xq int8 [n, K], xd float [n, K/32] (the scale; for Q8_K the super-block's, repeated), xs
// float [n, K/32] (Q8_1's s, or xd * sum(xq) for Q8_K), per group gid = token * G + g, or
// with group_major (the tensor-core kernel's layout) gid = g * n + token.
// Block (chunk, row) quantizes 256 values of row x[row] (rows x_stride floats apart), after
// an optional transform: RMSNorm with weight `norm` (x / rms(x) * norm; each block sums the
// row's squares itself), or SiLU-multiply with `up` (silu(x) * up).
// mode 0: Q8_0/Q8_1 per 32 (quantize.cuh);
// mode 1: Q8_K per 256 (d = 1 / iscale, iscale = -127 / signed absmax), as llama.cpp's
// quantize_row_q8_K_ref, which its x86 and ARM paths call.
extern "C" __global__ void __launch_bounds__(256)
    quantize_rows(const float* __restrict__ x, int x_stride, const float* __restrict__ norm,
                  double eps, const float* __restrict__ up, int up_stride, int K, int mode,
                  int group_major, signed char* __restrict__ xq, float* __restrict__ xd,
                  float* __restrict__ xs) {
    pdl_start();
    __shared__ double s_sum[8];
    __shared__ float s_red[8];
    __shared__ int s_idx[8];
    __shared__ float s_iscale;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long row = blockIdx.y;
    const int e = blockIdx.x * 256 + tid;
    const float* xr = x + row * x_stride;
    float v = e < K ? xr[e] : 0.f;
    if (norm) {  // the sum of squares in double, scale rounded once: as the CPU backend
        double ss = 0.0;
        for (int i = tid; i < K; i += 256) ss += (double)xr[i] * (double)xr[i];
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) s_sum[warp] = ss;
        __syncthreads();
        double total = 0.0;
        for (int w = 0; w < 8; ++w) total += s_sum[w];
        if (e < K) v = (v * (float)(1.0 / sqrt(total / K + eps))) * norm[e];
    }
    if (up && e < K) v = silu(v) * up[row * up_stride + e];
    const long long gid = act_group(row, e, gridDim.y, K, group_major);
    if (mode == 0) {
        if (blockIdx.x * 256 + warp * 32 >= K) return;  // whole warps past the row's end
        quantize_q8_32(v, gid, xq, xd, xs);
        return;
    }
    // largest magnitude, first index on ties
    float a = fabsf(v);
    int idx = tid;
    for (int o = 16; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(0xffffffffu, a, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        if (a2 > a || (a2 == a && i2 < idx)) {
            a = a2;
            idx = i2;
        }
    }
    if (lane == 0) {
        s_red[warp] = a;
        s_idx[warp] = idx;
    }
    __syncthreads();
    if (tid == 0) {
        float best = s_red[0];
        int bi = s_idx[0];
        for (int w = 1; w < 8; ++w)
            if (s_red[w] > best) {
                best = s_red[w];
                bi = s_idx[w];
            }
        s_idx[0] = bi;
    }
    __syncthreads();
    if (tid == s_idx[0]) s_iscale = v != 0.f ? __fdiv_rn(-127.f, v) : 0.f;  // one rounding
    __syncthreads();
    const float iscale = s_iscale;
    const int q = min(127, __float2int_rn(__fmul_rn(v, iscale)));
    xq[gid * 32 + (e & 31)] = (signed char)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) {
        const float d = iscale != 0.f ? __fdiv_rn(1.f, iscale) : 0.f;
        xd[gid] = d;
        xs[gid] = d * (float)sum;
    }
}

// ---- few tokens: one warp per weight row, dp4a -------------------------------------------

#define MV_WARPS 8
#ifndef MV_ROWS
#define MV_ROWS 2  // rows per warp: they share the activation loads
#endif
#ifndef MV_UNROLL
#define MV_UNROLL 2  // groups in flight per lane and row: loads are issued before any math
#endif
#ifndef MV_UNROLL1
#define MV_UNROLL1 MV_UNROLL  // the same for one token (decode), which has registers to spare
#endif

template <class F, int NT>
__global__ void __launch_bounds__(MV_WARPS * 32)
    matvec_q(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
             const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
             int accumulate) {
    pdl_trigger();
    constexpr int U = NT == 1 ? MV_UNROLL1 : MV_UNROLL;
    const Planes P = PLANES;
    const int G = K >> 5;
    const int row0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * MV_ROWS;
    const int lane = threadIdx.x & 31;
    const int tok0 = blockIdx.y * NT;
    if (row0 >= N) return;
    float acc[MV_ROWS][NT];
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[r][j] = 0.f;

    for (int g0 = lane; g0 < G; g0 += 32 * U) {
        uint4 wa[MV_ROWS][U], wb[MV_ROWS][U];
        u32 e0[MV_ROWS][U], e1[MV_ROWS][U];
        GroupScale s[MV_ROWS][U];
#pragma unroll
        for (int r = 0; r < MV_ROWS; ++r) {
            const int row = min(row0 + r, N - 1);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int g = g0 + 32 * u;
                if (g < G) {
                    const long long rg = (long long)row * G + g;
                    const uint4* wq =
                        reinterpret_cast<const uint4*>(P.p[0]) + rg * (F::qbytes / 16);
                    wa[r][u] = wq[0];
                    wb[r][u] = F::qbytes == 32 ? wq[1] : make_uint4(0, 0, 0, 0);
                    e0[r][u] = e1[r][u] = 0;
                    F::extra(P, rg, e0[r][u], e1[r][u]);
                    s[r][u] = F::scale(P, rg, (long long)row * (G >> 3) + (g >> 3));
                }
            }
        }
        if (g0 == lane) pdl_wait();  // the first weights are on their way: now the activation
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = g0 + 32 * u;
            if (g >= G) break;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int tok = tok0 + j;
                if (tok >= n_tok) break;
                const long long xg = (long long)tok * G + g;
                const int4* xv = reinterpret_cast<const int4*>(xq + xg * 32);
                const int4 x0 = xv[0], x1 = xv[1];
                const float d = xd[xg], sum = F::has_min ? xs[xg] : 0.f;
#pragma unroll
                for (int r = 0; r < MV_ROWS; ++r) {
                    const uint4 a = wa[r][u], b = wb[r][u];
                    int lo, hi, dl, dh;
                    F::decode(a.x, b.x, e0[r][u], e1[r][u], 0, lo, hi);
                    dl = __dp4a(lo, x0.x, 0);
                    dh = __dp4a(hi, x1.x, 0);
                    F::decode(a.y, b.y, e0[r][u], e1[r][u], 1, lo, hi);
                    dl = __dp4a(lo, x0.y, dl);
                    dh = __dp4a(hi, x1.y, dh);
                    F::decode(a.z, b.z, e0[r][u], e1[r][u], 2, lo, hi);
                    dl = __dp4a(lo, x0.z, dl);
                    dh = __dp4a(hi, x1.z, dh);
                    F::decode(a.w, b.w, e0[r][u], e1[r][u], 3, lo, hi);
                    dl = __dp4a(lo, x0.w, dl);
                    dh = __dp4a(hi, x1.w, dh);
                    const GroupScale& sc = s[r][u];
                    const float part = F::split ? sc.s_lo * (float)dl + sc.s_hi * (float)dh
                                                : sc.s_lo * (float)(dl + dh);
                    acc[r][j] += d * part;
                    if (F::has_min) acc[r][j] += sc.m * sum;
                }
            }
        }
    }
    pdl_wait();  // lanes past the last group have not waited yet
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float v = warp_sum(acc[r][j]);
            const int tok = tok0 + j, row = row0 + r;
            if (lane == 0 && tok < n_tok && row < N) {
                float* out = y + (long long)tok * N + row;
                *out = accumulate ? *out + v : v;
            }
        }
}

// ---- many tokens: int8 tensor cores (mma.sync m16n8k32 / m16n8k16) ----------------------
// A block computes MT * 16 weight rows x NT8 * 8 tokens. Its MMA_WARPS warps split K in chunks
// (warp w: chunks w, w + MMA_WARPS, ...) of MMA_CHUNK bytes of each row's plane 0. A warp
// copies a chunk's rows with 16-byte coalesced loads into its own shared-memory tile and
// reads the mma fragments from there (a lane's own fragment words, read from global memory,
// would touch eight rows per load); the other planes (scales, high bits) likewise. Activations
// come group-major here (xq [G][n][32], xd and xs [G][n]), so the eight tokens of a fragment
// are adjacent. The warps' partial sums meet in shared memory at the end.

#define MMA_WARPS 8
#define MMA_CHUNK 128  // bytes of a row's plane 0 per chunk: 8 groups of 4-bit weights

__device__ __forceinline__ void mma_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0,
                                        int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_k16(int (&c)[4], int a0, int a1, int b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// Bytes of plane k's part of a warp's chunk tile: ROWS rows of U groups (or of the one super-block
// that U groups lie in), rounded up to 16.
template <class F, int ROWS, int U>
__host__ __device__ constexpr int chunk_plane_bytes(int k) {
    const int b = F::plane_bytes(k);
    return ((b > 0 ? ROWS * U * b : ROWS * -b) + 15) / 16 * 16;
}

// Plane k (>= 1) of a chunk: loads into v (each element in a uint2) or stores v into dst.
template <class F, int ROWS, int U, int k>
__device__ __forceinline__ void chunk_plane(const Planes& P, int lane, long long row_base, int N,
                                            int G, int c0, uint2 (&v)[ROWS * U / 32 + 1],
                                            unsigned char* dst) {
    constexpr int b = F::plane_bytes(k), ab = b > 0 ? b : -b, per_row = b > 0 ? U : 1;
    if constexpr (b != 0) {
#pragma unroll
        for (int j = 0; j * 32 < ROWS * per_row; ++j) {
            const int e = j * 32 + lane, r = e / per_row, u = e % per_row;
            if (e >= ROWS * per_row) break;
            if (dst) {
                unsigned char* to = dst + e * ab;
                if (ab == 1) *to = (unsigned char)v[j].x;
                if (ab == 2) *reinterpret_cast<unsigned short*>(to) = (unsigned short)v[j].x;
                if (ab == 4) *reinterpret_cast<u32*>(to) = v[j].x;
                if (ab == 8) *reinterpret_cast<uint2*>(to) = v[j];
                continue;
            }
            const long long row = min(row_base + r, (long long)N - 1);
            if (b > 0 && c0 + u >= G) continue;
            const long long at = b > 0 ? row * G + c0 + u : row * (G >> 3) + (c0 >> 3);
            const unsigned char* from = reinterpret_cast<const unsigned char*>(P.p[k]) + at * ab;
            if (ab == 1) v[j].x = *from;
            if (ab == 2) v[j].x = *reinterpret_cast<const unsigned short*>(from);
            if (ab == 4) v[j].x = *reinterpret_cast<const u32*>(from);
            if (ab == 8) v[j] = *reinterpret_cast<const uint2*>(from);
        }
    }
}

template <class F, int MT, int NT8>
__global__ void __launch_bounds__(MMA_WARPS * 32)
    matmul_mma(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
               const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
               int accumulate) {
    pdl_trigger();
    const Planes P = PLANES;
    constexpr int ROWS = MT * 16, U = MMA_CHUNK / F::qbytes;  // rows and groups per chunk
    constexpr int STRIDE = MMA_CHUNK + 16;  // a tile row, padded: fragment reads hit 32 banks
    constexpr int VECS = ROWS * MMA_CHUNK / 16 / 32;  // 16-byte loads per lane per chunk
    constexpr int ACC = MT * NT8 * 4;  // accumulators per lane
    // a warp's tile: plane 0 (rows of STRIDE bytes), then planes 1..5 of the chunk
    constexpr int O1 = ROWS * STRIDE, O2 = O1 + chunk_plane_bytes<F, ROWS, U>(1),
                  O3 = O2 + chunk_plane_bytes<F, ROWS, U>(2),
                  O4 = O3 + chunk_plane_bytes<F, ROWS, U>(3),
                  O5 = O4 + chunk_plane_bytes<F, ROWS, U>(4),
                  WARP_BYTES = O5 + chunk_plane_bytes<F, ROWS, U>(5);
    constexpr int TILE_BYTES = MMA_WARPS * WARP_BYTES, SUM_BYTES = MMA_WARPS * ACC * 32 * 4;
    __shared__ __align__(16) unsigned char smem[TILE_BYTES > SUM_BYTES ? TILE_BYTES : SUM_BYTES];
    const int G = K >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = lane >> 2, t = lane & 3;  // mma fragment coordinates
    const int row_base = blockIdx.x * ROWS, tok_base = blockIdx.y * NT8 * 8;
    unsigned char* tile = smem + warp * WARP_BYTES;
    const Planes L = {{tile, tile + O1, tile + O2, tile + O3, tile + O4, tile + O5}};
    const unsigned char* plane0 = reinterpret_cast<const unsigned char*>(P.p[0]);
    float acc[MT][NT8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NT8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;

    bool waited = false;
    for (int c0 = warp * U; c0 < G; c0 += MMA_WARPS * U) {
        // the chunk's planes with coalesced loads: plane 0 as vector j * 32 + lane of
        // ROWS x MMA_CHUNK bytes, the others as elements; all in flight before any store
        uint4 vec[VECS];
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int idx = j * 32 + lane, r = idx / (MMA_CHUNK / 16), col = idx % (MMA_CHUNK / 16);
            const long long row = min(row_base + r, N - 1);
            vec[j] = c0 + col * 16 / F::qbytes < G
                         ? *reinterpret_cast<const uint4*>(plane0 + (row * G + c0) * F::qbytes + col * 16)
                         : make_uint4(0, 0, 0, 0);
        }
        uint2 pv[5][ROWS * U / 32 + 1];
        chunk_plane<F, ROWS, U, 1>(P, lane, row_base, N, G, c0, pv[0], nullptr);
        chunk_plane<F, ROWS, U, 2>(P, lane, row_base, N, G, c0, pv[1], nullptr);
        chunk_plane<F, ROWS, U, 3>(P, lane, row_base, N, G, c0, pv[2], nullptr);
        chunk_plane<F, ROWS, U, 4>(P, lane, row_base, N, G, c0, pv[3], nullptr);
        chunk_plane<F, ROWS, U, 5>(P, lane, row_base, N, G, c0, pv[4], nullptr);
        __syncwarp();  // the previous chunk's tile is read
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int idx = j * 32 + lane, r = idx / (MMA_CHUNK / 16), col = idx % (MMA_CHUNK / 16);
            *reinterpret_cast<uint4*>(tile + r * STRIDE + col * 16) = vec[j];
        }
        chunk_plane<F, ROWS, U, 1>(P, lane, row_base, N, G, c0, pv[0], tile + O1);
        chunk_plane<F, ROWS, U, 2>(P, lane, row_base, N, G, c0, pv[1], tile + O2);
        chunk_plane<F, ROWS, U, 3>(P, lane, row_base, N, G, c0, pv[2], tile + O3);
        chunk_plane<F, ROWS, U, 4>(P, lane, row_base, N, G, c0, pv[3], tile + O4);
        chunk_plane<F, ROWS, U, 5>(P, lane, row_base, N, G, c0, pv[4], tile + O5);
        __syncwarp();
        if (!waited) {  // the first weights are in: now the activations
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = c0 + u;
            if (g >= G) break;
            // fragment rows gq and gq + 8 of each 16-row tile, from the tile
            int lo[MT][2], hi[MT][2];
            GroupScale sc[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = mt * 16 + 8 * h + gq;
                    const u32* w = reinterpret_cast<const u32*>(tile + r * STRIDE + u * F::qbytes);
                    u32 e0 = 0, e1 = 0;
                    F::extra(L, r * U + u, e0, e1);
                    F::decode(w[t], F::qbytes == 32 ? w[4 + t] : 0u, e0, e1, t, lo[mt][h], hi[mt][h]);
                    sc[mt][h] = F::scale(L, r * U + u, r);
                }
#pragma unroll
            for (int i = 0; i < NT8; ++i) {
                const int tb = min(tok_base + i * 8 + gq, n_tok - 1);  // B column = token
                const int* xw = reinterpret_cast<const int*>(xq + ((long long)g * n_tok + tb) * 32);
                const int b0 = xw[t], b1 = xw[4 + t];
                // accumulator element e belongs to token 2t + (e & 1) of the 8
                const long long x0 = (long long)g * n_tok + min(tok_base + i * 8 + 2 * t, n_tok - 1);
                const long long x1 = (long long)g * n_tok + min(tok_base + i * 8 + 2 * t + 1, n_tok - 1);
                const float d[2] = {xd[x0], xd[x1]};
                const float sum[2] = {F::has_min ? xs[x0] : 0.f, F::has_min ? xs[x1] : 0.f};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    int c_lo[4] = {0, 0, 0, 0}, c_hi[4] = {0, 0, 0, 0};
                    if (F::split) {
                        mma_k16(c_lo, lo[mt][0], lo[mt][1], b0);
                        mma_k16(c_hi, hi[mt][0], hi[mt][1], b1);
                    } else {
                        mma_k32(c_lo, lo[mt][0], lo[mt][1], hi[mt][0], hi[mt][1], b0, b1);
                    }
                    // element e: row gq (e < 2) or gq + 8, token 2t + (e & 1)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const GroupScale& gs = sc[mt][e >> 1];
                        const float part = F::split
                                               ? gs.s_lo * (float)c_lo[e] + gs.s_hi * (float)c_hi[e]
                                               : gs.s_lo * (float)c_lo[e];
                        acc[mt][i][e] += d[e & 1] * part;
                        if (F::has_min) acc[mt][i][e] += gs.m * sum[e & 1];
                    }
                }
            }
        }
    }
    if (!waited) pdl_wait();  // warps past the last chunk
    __syncthreads();  // every tile is read: the space holds the partial sums now
    float(*partial)[ACC][32] = reinterpret_cast<float(*)[ACC][32]>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NT8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[warp][(mt * NT8 + i) * 4 + e][lane] = acc[mt][i][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < ACC * 32; idx += MMA_WARPS * 32) {
        const int a = idx >> 5, ln = idx & 31, e = a & 3, i = (a >> 2) % NT8, mt = (a >> 2) / NT8;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; ++w) v += partial[w][a][ln];
        const int row = row_base + mt * 16 + (e >> 1) * 8 + (ln >> 2);
        const int tok = tok_base + i * 8 + 2 * (ln & 3) + (e & 1);
        if (row < N && tok < n_tok) {
            float* out = y + (long long)tok * N + row;
            *out = accumulate ? *out + v : v;
        }
    }
}

// ---- float weights (F16 with fp16-rounded activations, F32) --------------------------------

template <class T, int NT>
__global__ void __launch_bounds__(MV_WARPS * 32)
    matvec_f(const T* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int K,
             int N, int n_tok, int accumulate) {
    pdl_start();
    const int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int tok0 = blockIdx.y * NT;
    if (row >= N) return;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = 0.f;
    for (int k = lane; k < K; k += 32) {
        const float wv = (float)w[(long long)row * K + k];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (tok0 + j < n_tok) {
                float xv = x[(long long)(tok0 + j) * K + k];
                if (sizeof(T) == 2) xv = __half2float(__float2half_rn(xv));
                acc[j] += wv * xv;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0 && tok0 + j < n_tok) {
            float* out = y + (long long)(tok0 + j) * N + row;
            *out = accumulate ? *out + v : v;
        }
    }
}

// ---- weights to fp16 for large batches (cuBLAS) ------------------------------------------
// One thread per group of 32: out [N, K] half.

template <class F>
__global__ void dequant_f16(PLANE_ARGS, __half* __restrict__ out, int K, long long n_groups) {
    pdl_start();
    const Planes P = PLANES;
    const long long rg = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (rg >= n_groups) return;
    const int G = K >> 5;
    const long long row = rg / G;
    const int g = rg % G;
    int lo, hi;
    const GroupScale s = F::scale(P, rg, row * (G >> 3) + (g >> 3));
    __half2* dst = reinterpret_cast<__half2*>(out + rg * 32);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        load_quad<F>(P, rg, t, lo, hi);
#pragma unroll
        for (int b = 0; b < 4; b += 2) {
            const float l0 = (signed char)((lo >> (8 * b)) & 0xFF), l1 = (signed char)((lo >> (8 * b + 8)) & 0xFF);
            const float h0 = (signed char)((hi >> (8 * b)) & 0xFF), h1 = (signed char)((hi >> (8 * b + 8)) & 0xFF);
            dst[(4 * t + b) / 2] = __floats2half2_rn(s.s_lo * l0 + s.m, s.s_lo * l1 + s.m);
            dst[(16 + 4 * t + b) / 2] = __floats2half2_rn(s.s_hi * h0 + s.m, s.s_hi * h1 + s.m);
        }
    }
}

// ---- embedding rows --------------------------------------------------------------------------

template <class F>
__global__ void embed_q(PLANE_ARGS, const int* __restrict__ ids, float* __restrict__ out, int K) {
    pdl_start();
    const Planes P = PLANES;
    const long long row = ids[blockIdx.x];
    for (int k = threadIdx.x; k < K; k += blockDim.x)
        out[(long long)blockIdx.x * K + k] = weight_value<F>(P, row, K >> 5, k);
}

template <class T>
__global__ void embed_f(const T* __restrict__ w, const int* __restrict__ ids,
                        float* __restrict__ out, int K) {
    pdl_start();
    const long long row = ids[blockIdx.x];
    for (int k = threadIdx.x; k < K; k += blockDim.x)
        out[(long long)blockIdx.x * K + k] = (float)w[row * K + k];
}
