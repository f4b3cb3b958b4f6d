// Quantized matrix products: y [n, N] = x [n, K] @ W.T, W [N, K] in repacked planes.
//
// The activation is first quantized to 8 bits as llama.cpp's CPU path pairs it with the
// weight format (quantize_rows), then multiplied in integers: dp4a for a few tokens
// (matvec_q, decode), int8 tensor-core mma for many (matmul_mma, prefill and batches).
#include "formats.cuh"
#include "launch.cuh"

// ---- activation quantization ----------------------------------------------------------------

// silu(g) with exp rounded from double: the correctly rounded expf of the CPU's libm in all
// but the rarest cases, so both backends feed the same values to the 8-bit quantizer.
__device__ __forceinline__ float silu(float g) { return g / (1.f + (float)exp(-(double)g)); }

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

// xq int8 [n, K], xd float [n, K/32] (the scale; for Q8_K the super-block's, repeated), xs
// float [n, K/32] (Q8_1's s, or xd * sum(xq) for Q8_K), per group gid = token * G + g.
// Block (chunk, row) quantizes 256 values of row x[row] (rows x_stride floats apart), after
// an optional transform: RMSNorm with weight `norm` (x / rms(x) * norm; each block sums the
// row's squares itself), or SiLU-multiply with `up` (silu(x) * up).
// mode 0: Q8_0/Q8_1 per 32 (x86 SIMD rounding: inverse scale 127 / amax, half to even);
// mode 1: Q8_K per 256 (d = 1 / iscale, iscale = -127 / signed absmax), as llama.cpp's
// quantize_row_q8_K_ref, which its x86 and ARM paths call.
extern "C" __global__ void __launch_bounds__(256)
    quantize_rows(const float* __restrict__ x, int x_stride, const float* __restrict__ norm,
                  double eps, const float* __restrict__ up, int up_stride, int K, int mode,
                  signed char* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs) {
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
    const long long at = row * K + e;  // element index; its group is at / 32
    if (mode == 0) {
        if (blockIdx.x * 256 + warp * 32 >= K) return;  // whole warps past the row's end
        const float amax = warp_max(fabsf(v));
        const float inv = amax != 0.f ? 127.f / amax : 0.f;
        const int q = __float2int_rn(v * inv);
        xq[at] = (signed char)q;
        const int sum = warp_sum_int(q);
        if (lane == 0) {
            const float d = amax / 127.f;
            xd[at >> 5] = __half2float(__float2half_rn(d));
            xs[at >> 5] = __half2float(__float2half_rn(d * (float)sum));
        }
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
    xq[at] = (signed char)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) {
        const float d = iscale != 0.f ? __fdiv_rn(1.f, iscale) : 0.f;
        xd[at >> 5] = d;
        xs[at >> 5] = d * (float)sum;
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
// A block computes 16 weight rows x (8 * NT8) tokens; its 4 warps split K and add up at the end.

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

template <class F, int NT8>
__global__ void __launch_bounds__(128)
    matmul_mma(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
               const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
               int accumulate) {
    pdl_start();
    const Planes P = PLANES;
    __shared__ float partial[3][NT8 * 4][32];
    const int G = K >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = lane >> 2, t = lane & 3;  // mma fragment coordinates
    const int row0 = blockIdx.x * 16 + gq, row1 = row0 + 8;
    const long long r0 = min(row0, N - 1), r1 = min(row1, N - 1);
    const int tok_base = blockIdx.y * NT8 * 8;
    float acc[NT8][4];
#pragma unroll
    for (int i = 0; i < NT8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    for (int g = warp; g < G; g += 4) {
        const long long rg0 = r0 * G + g, rg1 = r1 * G + g;
        int lo0, hi0, lo1, hi1;
        load_quad<F>(P, rg0, t, lo0, hi0);
        load_quad<F>(P, rg1, t, lo1, hi1);
        const GroupScale s0 = F::scale(P, rg0, r0 * (G >> 3) + (g >> 3));
        const GroupScale s1 = F::scale(P, rg1, r1 * (G >> 3) + (g >> 3));
#pragma unroll
        for (int i = 0; i < NT8; ++i) {
            const int tb = min(tok_base + i * 8 + gq, n_tok - 1);  // B column = token
            const int* xw = reinterpret_cast<const int*>(xq + ((long long)tb * G + g) * 32);
            const int b0 = xw[t], b1 = xw[4 + t];
            int c_lo[4] = {0, 0, 0, 0}, c_hi[4] = {0, 0, 0, 0};
            if (F::split) {
                mma_k16(c_lo, lo0, lo1, b0);
                mma_k16(c_hi, hi0, hi1, b1);
            } else {
                mma_k32(c_lo, lo0, lo1, hi0, hi1, b0, b1);
            }
            // accumulator element e: row (e < 2 ? row0 : row1), token 2t + (e & 1)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tc = min(tok_base + i * 8 + 2 * t + (e & 1), n_tok - 1);
                const long long xg = (long long)tc * G + g;
                const GroupScale& s = e < 2 ? s0 : s1;
                const float part = F::split ? s.s_lo * (float)c_lo[e] + s.s_hi * (float)c_hi[e]
                                            : s.s_lo * (float)c_lo[e];
                acc[i][e] += xd[xg] * part;
                if (F::has_min) acc[i][e] += s.m * xs[xg];
            }
        }
    }
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < NT8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[warp - 1][i * 4 + e][lane] = acc[i][e];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < NT8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = acc[i][e] + partial[0][i * 4 + e][lane] +
                                partial[1][i * 4 + e][lane] + partial[2][i * 4 + e][lane];
                const int row = e < 2 ? row0 : row1;
                const int tok = tok_base + i * 8 + 2 * t + (e & 1);
                if (row < N && tok < n_tok) {
                    float* out = y + (long long)tok * N + row;
                    *out = accumulate ? *out + v : v;
                }
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
