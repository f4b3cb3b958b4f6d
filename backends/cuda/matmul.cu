// Quantized matrix products: y [n, N] = x [n, K] @ W.T, W [N, K] in repacked planes.
//
// The activation is first quantized to 8 bits as llama.cpp's CPU path pairs it with the
// weight format (quantize_rows), then multiplied in integers: dp4a for one token (matvec_q,
// decode) and for 2..16 (matvec_tile: each weight read once for all of them, the same sums
// per token), int8 tensor-core mma for more (matmul_mma; matmul_chains, its pipeline with
// matvec_q's bits per token for 2..8; matmul_few, an alternative for a few tokens the backend
// takes where told to; matmul_exact, tensor cores with matvec_q's bits per token for 2..16,
// likewise).
#include "formats.cuh"
#include "launch.cuh"
#include "quantize.cuh"

// ---- activation quantization ----------------------------------------------------------------

// silu(g) with exp rounded from double: the correctly rounded expf of the CPU's libm in all
// but the rarest cases, so both backends feed the same values to the 8-bit quantizer.
__device__ __forceinline__ float silu(float g) { return g / (1.f + (float)exp(-(double)g)); }

// Integer dot products start from SUM_BIAS, the bits of the float 1.5 * 2^23: a sum c
// (|c| < 2^22) then reads as the float 1.5 * 2^23 + c exactly, and one FADD turns it into c
// as a float instead of an int-to-float conversion (16 results a clock per SM, not 128).
#define SUM_BIAS 0x4B400000
__device__ __forceinline__ float biased_sum(int c) { return __int_as_float(c) - 12582912.f; }

// xq int8 [n, K], xd float [n, K/32] (the scale; for Q8_K the super-block's, repeated), xs
// float [n, K/32] (Q8_1's s, or xd * sum(xq) for Q8_K), per group gid = token * G + g, or
// tiled (the tensor-core kernel's layout, quantize.cuh: n rounded up to whole tiles of 16).
// Block (chunk, row) quantizes 256 values of row x[row] (rows x_stride floats apart), after
// an optional transform: RMSNorm with weight `norm` (x / rms(x) * norm; each block sums the
// row's squares itself), or SiLU-multiply with `up` (silu(x) * up).
// mode 0: Q8_0/Q8_1 per 32 (quantize.cuh);
// mode 1: Q8_K per 256 (d = 1 / iscale, iscale = -127 / signed absmax), as llama.cpp's
// quantize_row_q8_K_ref, which its x86 and ARM paths call.
// Value e (< K) of row xr after the optional transform: RMSNorm with `weight` (norm != 0: the
// block's 256 threads sum the row's squares into s_sum), then SiLU-multiply with up_row.
__device__ __forceinline__ float transformed(const float* xr, int e, int K, bool norm,
                                             float weight, double eps, const float* up_row,
                                             double* s_sum) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float v = e < K ? xr[e] : 0.f;
    if (norm) {  // float squares summed in double, mean and scale in float: as ggml
        double ss = 0.0;
        for (int i = tid; i < K; i += 256) ss += (double)(xr[i] * xr[i]);
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) s_sum[warp] = ss;
        __syncthreads();
        double total = 0.0;
        for (int w = 0; w < 8; ++w) total += s_sum[w];
        if (e < K) v = (v * (1.0f / sqrtf((float)(total / K) + (float)eps))) * weight;
    }
    if (up_row && e < K) v = silu(v) * up_row[e];
    return v;
}

extern "C" __global__ void __launch_bounds__(256)
    quantize_rows(const float* __restrict__ x, int x_stride, const float* __restrict__ norm,
                  double eps, const float* __restrict__ up, int up_stride, int K, int mode,
                  int tiled, signed char* __restrict__ xq, float* __restrict__ xd,
                  float* __restrict__ xs) {
    pdl_trigger();
    __shared__ double s_sum[8];
    __shared__ float s_red[8];
    __shared__ int s_idx[8];
    __shared__ float s_iscale;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long row = blockIdx.y;
    const int e = blockIdx.x * 256 + tid;
    const float weight = norm && e < K ? norm[e] : 0.f;  // a weight: read before the wait
    pdl_wait();
    const float v = transformed(x + row * x_stride, e, K, norm != nullptr, weight, eps,
                                up ? up + row * up_stride : nullptr, s_sum);
    const long long gid = act_group(row, e, K, tiled);
    if (mode == 0) {
        if (blockIdx.x * 256 + warp * 32 >= K) return;  // whole warps past the row's end
        quantize_q8_32(v, gid, tiled, xq, xd, xs);
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
    xq[gid * 32 + act_byte(e & 31, tiled)] = (signed char)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) {
        const float d = iscale != 0.f ? __fdiv_rn(1.f, iscale) : 0.f;
        xd[gid] = d;
        xs[gid] = d * (float)sum;
    }
}

// The same transforms into fp16 rows for cuBLAS (prefill): out [n, K] half.
extern "C" __global__ void __launch_bounds__(256)
    dense_rows(const float* __restrict__ x, int x_stride, const float* __restrict__ norm,
               double eps, const float* __restrict__ up, int up_stride, int K,
               __half* __restrict__ out) {
    pdl_trigger();
    __shared__ double s_sum[8];
    const long long row = blockIdx.y;
    const int e = blockIdx.x * 256 + threadIdx.x;
    const float weight = norm && e < K ? norm[e] : 0.f;
    pdl_wait();
    const float v = transformed(x + row * x_stride, e, K, norm != nullptr, weight, eps,
                                up ? up + row * up_stride : nullptr, s_sum);
    if (e < K) out[row * K + e] = __float2half_rn(v);
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

// A group's quads from its plane-0 words (a: words 0..3, b: 4..7 for Q8_0) and extra bits.
template <class F>
__device__ __forceinline__ void decode_group(uint4 a, uint4 b, u32 e0, u32 e1, int (&lo)[4],
                                             int (&hi)[4]) {
    F::decode(a.x, b.x, e0, e1, 0, lo[0], hi[0]);
    F::decode(a.y, b.y, e0, e1, 1, lo[1], hi[1]);
    F::decode(a.z, b.z, e0, e1, 2, lo[2], hi[2]);
    F::decode(a.w, b.w, e0, e1, 3, lo[3], hi[3]);
}

// The group's dot products with an activation group (x0: its values 0..15, x1: 16..31) as
// biased integer sums (SUM_BIAS + the dot product): dl over the low quads and, for split
// formats, dh over the high ones; else dl + dh is the whole group's (dh starts from 0).
template <class F>
__device__ __forceinline__ void group_sums(const int (&lo)[4], const int (&hi)[4], int4 x0,
                                           int4 x1, int& dl, int& dh) {
    dl = __dp4a(lo[0], x0.x, SUM_BIAS);
    dh = __dp4a(hi[0], x1.x, F::split ? SUM_BIAS : 0);
    dl = __dp4a(lo[1], x0.y, dl);
    dh = __dp4a(hi[1], x1.y, dh);
    dl = __dp4a(lo[2], x0.z, dl);
    dh = __dp4a(hi[2], x1.z, dh);
    dl = __dp4a(lo[3], x0.w, dl);
    dh = __dp4a(hi[3], x1.w, dh);
}

// acc plus a group's term of a token's sum, from its biased integer sums (group_sums', or an
// mma's from SUM_BIAS, the same integers): formats.cuh's
// d * (s_lo * dot_lo + s_hi * dot_hi) + m * xs, with d and xs the activation group's scale
// and sum term. Every rounding is spelled out (no contraction left to the compiler, which
// could pick another per kernel): kernels that add a token's terms in the same order then
// give it the same bits.
template <class F>
__device__ __forceinline__ float group_term(float acc, int dl, int dh, const GroupScale& sc,
                                            float d, float xsum) {
    const float p = F::split ? __fmaf_rn(sc.s_lo, biased_sum(dl),
                                         __fmul_rn(sc.s_hi, biased_sum(dh)))
                             : __fmul_rn(sc.s_lo, biased_sum(dl + dh));
    acc = __fmaf_rn(d, p, acc);
    return F::has_min ? __fmaf_rn(sc.m, xsum, acc) : acc;
}

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
                    int lo[4], hi[4];
                    decode_group<F>(wa[r][u], wb[r][u], e0[r][u], e1[r][u], lo, hi);
                    int dl, dh;
                    group_sums<F>(lo, hi, x0, x1, dl, dh);
                    acc[r][j] = group_term<F>(acc[r][j], dl, dh, s[r][u], d, sum);
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

// ---- a few tokens, each weight read once: R rows a warp, NT tokens a block ----------------
// The products of 2..16 tokens (speculative checking passes, small batches) and, where the
// backend picks it, of one. A lane holds R rows' groups g = lane, lane + 32, ... (U of them a
// row in flight, one 16-byte load each) and applies each to every token of the block, so the
// weights stream from memory once while each token's activation is loaded once per R rows.
// The decoded quads of the R rows are kept across the tokens, and the next round's weights
// are loaded while this round's are applied. Each token's sum runs in the
// order matvec_q's does (per lane over the groups in turn, then the xor butterfly across the
// lanes, which the reduce-scatter below reproduces), so the results are bit-identical to it.
// stage: the block first copies its tokens' activations into dynamic shared memory
// (nt * (K + 8 * K / 32) bytes; the backend passes stage = 0 where that is too much), the
// halves of groups reordered for contiguous loads.
// Blocks of any number of warps (blockDim.x = 32 * warps): a parameter of the launch.

#ifndef MT_STREAM
#define MT_STREAM 1  // weight loads past L1 (L1::no_allocate): L1 keeps the activations
#endif

__device__ __forceinline__ uint4 load_weights16(const uint4* p) {
#if MT_STREAM
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

// v[i] summed over the warp's lanes, V (a power of two) values a lane: each step keeps half
// the values and adds the partner lane's copy of them (the sums of warp_sum's butterfly, bit
// for bit), until a lane holds SCATTER_HELD(V) values; the rest of the steps are warp_sum's.
// Returns the index of the first value the lane then holds in v[0 .. held - 1] (consecutive);
// SCATTER_SPREAD(V) neighbouring lanes hold the same ones.
#define SCATTER_HELD(V) ((V) >= 32 ? (V) / 32 : 1)
#define SCATTER_SPREAD(V) ((V) >= 32 ? 1 : 32 / (V))
template <int V>
__device__ __forceinline__ int warp_sum_scatter(float (&v)[V], int lane) {
    int held = V, first = 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (held > 1) {
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < V / 2; ++i) {
                if (i < held / 2) {
                    const float keep = upper ? v[i + held / 2] : v[i];
                    const float send = upper ? v[i] : v[i + held / 2];
                    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                }
            }
            held /= 2;
            if (upper) first += held;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
    }
    return first;
}

template <class F, int R, int NT, int U>
__global__ void __launch_bounds__(256)
    matvec_tile(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
                const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
                int accumulate, int stage) {
    static_assert((R & (R - 1)) == 0 && (NT & (NT - 1)) == 0, "R and NT: powers of two");
    pdl_trigger();
    const Planes P = PLANES;
    extern __shared__ __align__(16) unsigned char smem[];
    const int G = K >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * R;
    const int tok0 = blockIdx.y * NT, nt = min(NT, n_tok - tok0);

    uint4 wa[R][U], wb[R][U];
    u32 e0[R][U], e1[R][U];
    GroupScale s[R][U];
    auto load = [&](int g0) {  // the R rows' groups g0, g0 + 32, ... (rows past N: the last)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = min(row0 + r, N - 1);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int g = g0 + 32 * u;
                if (g < G) {
                    const long long rg = (long long)row * G + g;
                    const uint4* wq = reinterpret_cast<const uint4*>(P.p[0]) + rg * (F::qbytes / 16);
                    wa[r][u] = load_weights16(wq);
                    wb[r][u] = F::qbytes == 32 ? load_weights16(wq + 1) : make_uint4(0, 0, 0, 0);
                    e0[r][u] = e1[r][u] = 0;
                    F::extra(P, rg, e0[r][u], e1[r][u]);
                    s[r][u] = F::scale(P, rg, (long long)row * (G >> 3) + (g >> 3));
                }
            }
        }
    };
    load(lane);  // the first weights are on their way before the wait on the activation
    pdl_wait();

    // the block's tokens' activations: [nt][G] 16-byte halves of groups as quantize_rows
    // wrote them (group g's at 2g and 2g + 1), or staged in shared memory with the first
    // halves of all groups before the second ones (at g and G + g), so that a warp's load of
    // 32 groups' halves is 512 contiguous bytes
    const int4* aq = reinterpret_cast<const int4*>(xq + (long long)tok0 * K);
    const float* ad = xd + (long long)tok0 * G;
    const float* as = xs + (long long)tok0 * G;
    int group_step = 2, half_step = 1;
    if (stage) {
        int4* sq = reinterpret_cast<int4*>(smem);
        float* sd = reinterpret_cast<float*>(smem + (long long)nt * K);
        float* ss = sd + nt * G;
        for (int i = threadIdx.x; i < nt * 2 * G; i += blockDim.x) {
            const int j = i / (2 * G), v = i - j * 2 * G;
            sq[j * 2 * G + (v & 1) * G + (v >> 1)] = aq[i];
        }
        for (int i = threadIdx.x; i < nt * G; i += blockDim.x) {
            sd[i] = ad[i];
            if (F::has_min) ss[i] = as[i];
        }
        __syncthreads();
        aq = sq;
        ad = sd;
        as = ss;
        group_step = 1;
        half_step = G;
    }

    float acc[R * NT];
#pragma unroll
    for (int i = 0; i < R * NT; ++i) acc[i] = 0.f;
    for (int g0 = lane; g0 < G; g0 += 32 * U) {
        // this round's groups decoded, then the next round's weights loaded into the same
        // registers: they are on their way while the tokens are multiplied
        int lo[R][U][4], hi[R][U][4];
        GroupScale sc[R][U];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int u = 0; u < U; ++u) {
                decode_group<F>(wa[r][u], wb[r][u], e0[r][u], e1[r][u], lo[r][u], hi[r][u]);
                sc[r][u] = s[r][u];
            }
        if (g0 + 32 * U < G) load(g0 + 32 * U);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = g0 + 32 * u;
            if (g >= G) break;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if (j >= nt) break;
                const int xg = j * G + g;
                const int4* xv = aq + 2 * j * G + g * group_step;
                const int4 x0 = xv[0], x1 = xv[half_step];
                const float d = ad[xg], sum = F::has_min ? as[xg] : 0.f;
#pragma unroll
                for (int r = 0; r < R; ++r) {  // as matvec_q, term for term
                    int dl, dh;
                    group_sums<F>(lo[r][u], hi[r][u], x0, x1, dl, dh);
                    acc[r * NT + j] = group_term<F>(acc[r * NT + j], dl, dh, sc[r][u], d, sum);
                }
            }
        }
    }
    const int first = warp_sum_scatter<R * NT>(acc, lane);
    if (lane % SCATTER_SPREAD(R * NT) != 0) return;
#pragma unroll
    for (int k = 0; k < SCATTER_HELD(R * NT); ++k) {
        const int row = row0 + (first + k) / NT, tok = tok0 + (first + k) % NT;
        if (row < N && tok < n_tok) {
            float* out = y + (long long)tok * N + row;
            *out = accumulate ? *out + acc[k] : acc[k];
        }
    }
}

// ---- many tokens: int8 tensor cores (mma.sync m16n8k32 / m16n8k16) ----------------------
// A block computes 16 weight rows x MMA_TOKENS tokens. Its W warps split K in chunks of
// MMA_CHUNK bytes of each row's plane 0 (8 groups; warp w: chunks w, w + W, ...). Each
// warp streams its chunks through its own ring of `stages` tiles in dynamic shared memory
// with cp.async, the whole ring issued before the wait on the previous kernel (launch.cuh),
// and reads the mma fragments from there (a lane's own fragment words, read from global
// memory, would touch eight rows per load); the activation comes from global memory (L1),
// tiled (xq [n16 / 16][G][16][32], xd and xs [n16 / 16][G][16], quantize.cuh), so a block's
// fragments lie at fixed distances from one base address. The warps' partial sums meet in
// shared memory at the end. Rows must hold whole chunks (K % 256 == 0), so that every copy
// is aligned; a block's rows past the matrix's last come from the planes' slack (weights.py).
//
// The chunk's code is one straight block (no branch on the tokens present, addresses from a
// few per-lane bases), which lets the compiler overlap the groups' mma latencies: this more
// than the memory layout decides the speed (7B products at 16 tokens 1.2 -> 1.5 TB/s).

#ifndef MMA_SM_WARPS
#define MMA_SM_WARPS 24  // warps an SM must hold: caps the registers (backend.py)
#endif
#define MMA_CHUNK 128  // bytes of a row's plane 0 per chunk: 8 groups of 4-bit weights
#define MMA_TOKENS 16  // two 8-token fragments
#define MMA_MAX_STAGES 4  // tiles in a warp's ring at most (cp_async_wait_dyn)

// d = a * b + c, every element of c the same value (the accumulator's start, SUM_BIAS): an
// operand of its own, so no copy of it per product.
__device__ __forceinline__ void mma_k32(int (&d)[4], int a0, int a1, int a2, int a3, int b0, int b1,
                                        int c) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c));
}

__device__ __forceinline__ void mma_k16(int (&d)[4], int a0, int a1, int b0, int c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(c));
}

// Asynchronous global -> shared copies of BYTES (4, 8 or 16, both addresses aligned to it).
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (BYTES == 16)  // weights stream past L1
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(BYTES));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}
// The same for a count known at run time (at most MMA_MAX_STAGES - 1).
__device__ __forceinline__ void cp_async_wait_dyn(int pending) {
    switch (pending) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        default: cp_async_wait<3>(); break;
    }
}

// Bytes of plane k's part of a warp's chunk tile: 16 rows of U groups, or for a per-super-block
// plane (2-byte values) 16 aligned words that hold the row's value.
template <class F, int U>
__host__ __device__ constexpr int chunk_plane_bytes(int k) {
    const int b = F::plane_bytes(k);
    return b > 0 ? 16 * U * b : b < 0 ? 16 * 4 : 0;
}

// Plane k (>= 1) of the chunk at group c0 for a warp's 16 rows into its tile: each row's U
// group values lie together and aligned (G % U == 0); a super-block value is copied as the
// aligned word around it, so row r's value is the tile's 2-byte element 2r + (its index & 1).
// Rows past the matrix's last are read from the planes' slack (weights.py).
template <class F, int U, int k>
__device__ __forceinline__ void copy_plane(const Planes& P, int lane, int row_base, int G, int c0,
                                           unsigned char* dst) {
    constexpr int b = F::plane_bytes(k);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(P.p[k]);
    if constexpr (b > 0) {
        constexpr int ROW_BYTES = U * b, PIECE = ROW_BYTES < 16 ? ROW_BYTES : 16;
        constexpr int PIECES = ROW_BYTES / PIECE;
        const unsigned char* rows = src + (long long)row_base * G * b;  // the block's first row
#pragma unroll
        for (int e = lane; e < 16 * PIECES; e += 32) {
            const int r = e / PIECES, p = e % PIECES;
            cp_async<PIECE>(dst + r * ROW_BYTES + p * PIECE, rows + (r * G + c0) * b + p * PIECE);
        }
    } else if constexpr (b < 0) {
        static_assert(b == -2, "super-block planes hold 2-byte values");
        if (lane < 16) {
            const int at = (row_base + lane) * (G >> 3) + (c0 >> 3);
            cp_async<4>(dst + 4 * lane, src + (long long)(at & ~1) * 2);
        }
    }
}

// A warp's chunk tile: plane 0 (16 rows x MMA_CHUNK bytes, each row's 16-byte vectors swizzled
// by row), then planes 1..5 of the chunk.
template <class F>
struct ChunkTile {
    static constexpr int U = MMA_CHUNK / F::qbytes;  // groups per chunk
    static constexpr int O1 = 16 * MMA_CHUNK, O2 = O1 + chunk_plane_bytes<F, U>(1),
                         O3 = O2 + chunk_plane_bytes<F, U>(2), O4 = O3 + chunk_plane_bytes<F, U>(3),
                         O5 = O4 + chunk_plane_bytes<F, U>(4),
                         BYTES = (O5 + chunk_plane_bytes<F, U>(5) + 15) / 16 * 16;

    // the chunk at group c0 of rows row_base .. row_base + 15, copied by the warp's lanes
    __device__ static void issue(const Planes& P, int lane, int row_base, int G, int c0,
                                 unsigned char* tile) {
        // plane 0: lane copies 16-byte vector lane % 8 of rows lane / 8 + 4j, which the tile
        // holds swizzled by the row's low bits, lane / 8 + 4 (j & 1)
        static_assert(MMA_CHUNK == 8 * 16, "a row of plane 0: eight vectors");
        const int r0 = lane >> 3, v = lane & 7;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(P.p[0]) +
                                   ((long long)(row_base + r0) * G + c0) * F::qbytes + v * 16;
        const long long src_step = 4ll * G * F::qbytes;  // four rows
        unsigned char* dst = tile + r0 * MMA_CHUNK;
        const int swizzled = (v ^ r0) * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            cp_async<16>(dst + j * 4 * MMA_CHUNK + (swizzled ^ (j & 1) * 64), src + j * src_step);
        copy_plane<F, U, 1>(P, lane, row_base, G, c0, tile + O1);
        copy_plane<F, U, 2>(P, lane, row_base, G, c0, tile + O2);
        copy_plane<F, U, 3>(P, lane, row_base, G, c0, tile + O3);
        copy_plane<F, U, 4>(P, lane, row_base, G, c0, tile + O4);
        copy_plane<F, U, 5>(P, lane, row_base, G, c0, tile + O5);
    }
};

// acc [chain][fragment][element] += the chunk at group c0 of a warp's tile times the NF
// 8-token fragments of the tiled activation from group x0 on (the block's tile of tokens,
// group c0). Element e of fragment f: row gq + 8 (e >> 1), token 8f + 2t + (e & 1). Tokens
// past n_tok (the tile's padding) are read as they are: their columns of the results are not
// stored. CH = 1: every group into acc[0]; CH = U: group u of the chunk into chain u, its term
// rounded as matvec_q's (group_term).
template <class F, int NF, int CH>
__device__ __forceinline__ void mma_chunk(const unsigned char* tile, int row_base, int G,
                                          int c0, const signed char* xq, const float* xd,
                                          const float* xs, long long x0,
                                          float (&acc)[CH][NF][4]) {
    using T = ChunkTile<F>;
    constexpr int U = T::U, V = F::qbytes / 16;  // groups per chunk, 16-byte vectors per group
    const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    const Planes L = {{tile, tile + T::O1, tile + T::O2, tile + T::O3, tile + T::O4, tile + T::O5}};
    int sb[2];  // rows gq and gq + 8: their super-block values' places in the tile
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rs = (row_base + 8 * h + gq) * (G >> 3) + (c0 >> 3);
        sb[h] = 2 * (8 * h + gq) + (rs & 1);
    }
    const unsigned char* wrow = tile + gq * MMA_CHUNK + 4 * t;  // both rows swizzled by gq
    const signed char* xb = xq + (x0 + gq) * 32 + 8 * t;  // B column gq: words t and 4 + t
    const float* xdt = xd + x0 + 2 * t;  // the scales of tokens 2t and 2t + 1
    const float* xst = xs + x0 + 2 * t;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int col = ((u * V) ^ gq) * 16, col_b = ((u * V + 1) ^ gq) * 16;
        int lo[2], hi[2];
        GroupScale sc[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned char* w = wrow + h * 8 * MMA_CHUNK;
            const u32 wa = *reinterpret_cast<const u32*>(w + col);
            const u32 wb = V == 2 ? *reinterpret_cast<const u32*>(w + col_b) : 0u;
            u32 e0 = 0, e1 = 0;
            F::extra(L, (8 * h + gq) * U + u, e0, e1);
            F::decode(wa, wb, e0, e1, t, lo[h], hi[h]);
            sc[h] = F::scale(L, (8 * h + gq) * U + u, sb[h]);
        }
#pragma unroll
        for (int f = 0; f < NF; ++f) {
            const int at = u * 16 + f * 8;  // the fragment's first token from x0
            const int2 b = *reinterpret_cast<const int2*>(xb + at * 32);
            const float2 d = *reinterpret_cast<const float2*>(xdt + at);
            const float2 m = F::has_min ? *reinterpret_cast<const float2*>(xst + at)
                                        : make_float2(0.f, 0.f);
            int c_lo[4], c_hi[4] = {0, 0, 0, 0};
            if (F::split) {
                mma_k16(c_lo, lo[0], lo[1], b.x, SUM_BIAS);
                mma_k16(c_hi, hi[0], hi[1], b.y, SUM_BIAS);
            } else {
                mma_k32(c_lo, lo[0], lo[1], hi[0], hi[1], b.x, b.y, SUM_BIAS);
            }
            float(&a)[4] = acc[CH == 1 ? 0 : u][f];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const GroupScale& gs = sc[e >> 1];
                if constexpr (CH > 1) {
                    a[e] = group_term<F>(a[e], c_lo[e], c_hi[e], gs, e & 1 ? d.y : d.x,
                                         e & 1 ? m.y : m.x);
                } else {
                    const float p = F::split ? gs.s_lo * biased_sum(c_lo[e]) +
                                                   gs.s_hi * biased_sum(c_hi[e])
                                             : gs.s_lo * biased_sum(c_lo[e]);
                    a[e] += (e & 1 ? d.y : d.x) * p;
                    if (F::has_min) a[e] += gs.m * (e & 1 ? m.y : m.x);
                }
            }
        }
    }
}

// y (+)= the block's results: lane's acc [fragment][element] for rows row_base + gq + 8 (e >> 1),
// tokens tok_base + 8f + 2t + (e & 1)
template <int NF>
__device__ __forceinline__ void mma_store(const float (&acc)[NF][4], float* y, int row_base,
                                          int tok_base, int N, int n_tok, int accumulate) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row_base + gq + 8 * (e >> 1), tok = tok_base + 8 * f + 2 * t + (e & 1);
            if (row < N && tok < n_tok) {
                float* out = y + (long long)tok * N + row;
                *out = accumulate ? *out + acc[f][e] : acc[f][e];
            }
        }
}

// Dynamic shared memory: max(W * stages * ChunkTile<F>::BYTES, W * 1 KB) (the partial sums).
// NF: the 8-token fragments of the block's tile of 16 tokens computed (1: tokens 0..7 alone,
// for products of at most 8 tokens: half the mma and float work).
template <class F, int W, int NF>
__global__ void __launch_bounds__(W * 32, MMA_SM_WARPS / W)
    matmul_mma(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
               const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
               int accumulate, int stages) {
    pdl_trigger();
    const Planes P = PLANES;
    using T = ChunkTile<F>;
    constexpr int U = T::U;
    extern __shared__ __align__(16) unsigned char smem[];
    const int G = K >> 5, chunks = G / U;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row_base = blockIdx.x * 16, tok_base = blockIdx.y * MMA_TOKENS;
    // the warp's chunks are warp, warp + W, ...; the k-th lands in tile k % stages of its ring
    unsigned char* const ring = smem + warp * stages * T::BYTES;
    unsigned char* const ring_end = ring + stages * T::BYTES;
    int next = warp;  // the next chunk to copy
    auto issue = [&](unsigned char* tile) {  // a copy group, even if no chunk is left
        if (next < chunks) T::issue(P, lane, row_base, G, next * U, tile);
        cp_async_commit();
        next += W;
    };
    for (int s = 0; s < stages; ++s) issue(ring + s * T::BYTES);
    pdl_wait();  // the first weights are on their way: now the activations may be read
    static_assert(NF == 1 || NF == 2, "a tile of 16 tokens: one or two 8-token fragments");
    float acc[1][NF][4];
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][f][e] = 0.f;
    unsigned char* tile = ring;
    for (int chunk = warp; chunk < chunks; chunk += W) {
        cp_async_wait_dyn(stages - 1);  // this chunk has landed (this lane's copies)
        __syncwarp();  // ... and every lane's
        const int c0 = chunk * U;
        const long long x0 = ((long long)blockIdx.y * G + c0) * 16;
        mma_chunk<F, NF, 1>(tile, row_base, G, c0, xq, xd, xs, x0, acc);
        __syncwarp();  // the tile is read: the chunk `stages` on may take its place
        issue(tile);
        tile = tile + T::BYTES == ring_end ? ring : tile + T::BYTES;
    }
    cp_async_wait<0>();
    __syncthreads();  // every tile is read: the space holds the partial sums now
    float(*partial)[8][32] = reinterpret_cast<float(*)[8][32]>(smem);
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][f * 4 + e][lane] = acc[0][f][e];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < W; ++w) v += partial[w][f * 4 + e][lane];
                acc[0][f][e] = v;
            }
        mma_store<NF>(acc[0], y, row_base, tok_base, N, n_tok, accumulate);
    }
}

// ---- a few tokens on tensor cores, matvec_q's bits per token: chains ------------------------
// matmul_mma's pipeline (each warp's chunks through its own ring of cp.async tiles) with the
// float work in matvec_q's order, so every token gets, bit for bit, what the one-token matvec_q
// gives it alone. matvec_q's lane l adds a row's groups l, l + 32, l + 64, ... in turn (a
// chain), then warp_sum's butterfly adds the 32 chains; an int8 mma gives a group's sums as
// the same integers dp4a does. With W = 32 / U warps (U groups a chunk), warp w takes chunks
// w, w + W, w + 2W, ...: group u of each lies on chain U * w + u, and the warp adds the
// chunks in turn, so each of its U chains gets its groups in order (group_term, as
// matvec_q). At the end the 32 chains meet in shared memory in the butterfly's tree.
// Dynamic shared memory: max(W * stages * ChunkTile<F>::BYTES, 32 * NF * 4 * 32 * 4).

#ifndef CHAIN_SM_WARPS
#define CHAIN_SM_WARPS 16  // warps an SM must hold: caps the registers (backend.py)
#endif

template <class F, int NF>
__global__ void __launch_bounds__(32 * 32 / ChunkTile<F>::U,
                                  CHAIN_SM_WARPS * ChunkTile<F>::U / 32)
    matmul_chains(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
                  const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
                  int accumulate, int stages) {
    static_assert(NF == 1 || NF == 2, "a tile of 16 tokens: one or two 8-token fragments");
    pdl_trigger();
    const Planes P = PLANES;
    using T = ChunkTile<F>;
    constexpr int U = T::U, W = 32 / U;
    extern __shared__ __align__(16) unsigned char smem[];
    const int G = K >> 5, chunks = G / U;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row_base = blockIdx.x * 16, tok_base = blockIdx.y * MMA_TOKENS;
    unsigned char* const ring = smem + warp * stages * T::BYTES;
    unsigned char* const ring_end = ring + stages * T::BYTES;
    int next = warp;  // the next chunk to copy
    auto issue = [&](unsigned char* tile) {  // a copy group, even if no chunk is left
        if (next < chunks) T::issue(P, lane, row_base, G, next * U, tile);
        cp_async_commit();
        next += W;
    };
    for (int s = 0; s < stages; ++s) issue(ring + s * T::BYTES);
    pdl_wait();  // the first weights are on their way: now the activations may be read
    float acc[U][NF][4];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[u][f][e] = 0.f;
    unsigned char* tile = ring;
    for (int chunk = warp; chunk < chunks; chunk += W) {
        cp_async_wait_dyn(stages - 1);
        __syncwarp();
        const int c0 = chunk * U;
        const long long x0 = ((long long)blockIdx.y * G + c0) * 16;
        mma_chunk<F, NF, U>(tile, row_base, G, c0, xq, xd, xs, x0, acc);
        __syncwarp();
        issue(tile);
        tile = tile + T::BYTES == ring_end ? ring : tile + T::BYTES;
    }
    cp_async_wait<0>();
    __syncthreads();  // every tile is read: the space holds the chains now
    float(*partial)[NF * 4][32] = reinterpret_cast<float(*)[NF * 4][32]>(smem);  // [chain]
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[U * warp + u][f * 4 + e][lane] = acc[u][f][e];
    __syncthreads();
    const int gq = lane >> 2, t = lane & 3;
    for (int fe = warp; fe < NF * 4; fe += W) {  // element fe of every lane's results
        float v[32];
#pragma unroll
        for (int c = 0; c < 32; ++c) v[c] = partial[c][fe][lane];
        // warp_sum's butterfly: chains differing in bit 4 first, then bits 3, 2, 1, 0
#pragma unroll
        for (int c = 0; c < 16; ++c) v[c] = v[c] + v[c + 16];
#pragma unroll
        for (int c = 0; c < 8; ++c) v[c] = v[c] + v[c + 8];
#pragma unroll
        for (int c = 0; c < 4; ++c) v[c] = v[c] + v[c + 4];
        v[0] = v[0] + v[2];
        v[1] = v[1] + v[3];
        v[0] = v[0] + v[1];
        const int f = fe >> 2, e = fe & 3;
        const int row = row_base + gq + 8 * (e >> 1), tok = tok_base + 8 * f + 2 * t + (e & 1);
        if (row < N && tok < n_tok) {
            float* out = y + (long long)tok * N + row;
            *out = accumulate ? *out + v[0] : v[0];
        }
    }
}

// ---- a few tokens on tensor cores, the weights straight into registers --------------------
// A block computes 16 weight rows x up to 8 * NF tokens (one tile of the tiled activation,
// quantize.cuh); its warps (blockDim.x / 32, at most 8) split the rows' groups into
// contiguous ranges. Each lane loads its own A-fragment words (load_quad: word t of rows gq
// and gq + 8), the next U groups' loads issued while these U are multiplied, and reads the
// activation's B fragments through L1 (a fragment: 256 contiguous bytes). The warps' partial
// sums meet in shared memory. Results are near, not bit-identical to, matvec_q's (another
// order of summation); an alternative to matvec_tile that the backend takes where told to.

template <class F, int NF, int U>
__global__ void __launch_bounds__(256)
    matmul_few(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
               const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
               int accumulate) {
    pdl_trigger();
    const Planes P = PLANES;
    __shared__ float partial[8][NF * 4][32];
    const int G = K >> 5, warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    const int row_base = blockIdx.x * 16, tile = blockIdx.y;
    const int per = (G + warps - 1) / warps, ga = min(G, warp * per), gb = min(G, ga + per);
    const int rows[2] = {min(row_base + gq, N - 1), min(row_base + gq + 8, N - 1)};

    int lo[U][2], hi[U][2];
    GroupScale sc[U][2];
    auto load = [&](int g0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = g0 + u;
            if (g < gb) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const long long rg = (long long)rows[h] * G + g;
                    load_quad<F>(P, rg, t, lo[u][h], hi[u][h]);
                    sc[u][h] = F::scale(P, rg, (long long)rows[h] * (G >> 3) + (g >> 3));
                }
            }
        }
    };
    load(ga);
    pdl_wait();
    const long long x0 = (long long)tile * G * 16;  // the tile's group 0, token 0
    const signed char* xb = xq + (x0 + gq) * 32 + 8 * t;  // B column gq: words t and 4 + t
    const float* xdt = xd + x0 + 2 * t;  // the scales of tokens 2t and 2t + 1
    const float* xst = xs + x0 + 2 * t;
    float acc[NF][4];
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[f][e] = 0.f;
    for (int g0 = ga; g0 < gb; g0 += U) {
        int clo[U][2], chi[U][2];
        GroupScale cs[U][2];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                clo[u][h] = lo[u][h];
                chi[u][h] = hi[u][h];
                cs[u][h] = sc[u][h];
            }
        if (g0 + U < gb) load(g0 + U);  // on their way while these are multiplied
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = g0 + u;
            if (g >= gb) break;
#pragma unroll
            for (int f = 0; f < NF; ++f) {
                const int at = g * 16 + f * 8;  // the fragment's first token's group
                const int2 b = *reinterpret_cast<const int2*>(xb + (long long)at * 32);
                const float2 d = *reinterpret_cast<const float2*>(xdt + at);
                const float2 m = F::has_min ? *reinterpret_cast<const float2*>(xst + at)
                                            : make_float2(0.f, 0.f);
                int c_lo[4], c_hi[4];
                if (F::split) {
                    mma_k16(c_lo, clo[u][0], clo[u][1], b.x, SUM_BIAS);
                    mma_k16(c_hi, chi[u][0], chi[u][1], b.y, SUM_BIAS);
                } else {
                    mma_k32(c_lo, clo[u][0], clo[u][1], chi[u][0], chi[u][1], b.x, b.y, SUM_BIAS);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const GroupScale& gs = cs[u][e >> 1];
                    const float p = F::split ? gs.s_lo * biased_sum(c_lo[e]) +
                                                   gs.s_hi * biased_sum(c_hi[e])
                                             : gs.s_lo * biased_sum(c_lo[e]);
                    acc[f][e] += (e & 1 ? d.y : d.x) * p;
                    if (F::has_min) acc[f][e] += gs.m * (e & 1 ? m.y : m.x);
                }
            }
        }
    }
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][f * 4 + e][lane] = acc[f][e];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = 0.f;
            for (int w = 0; w < warps; ++w) v += partial[w][f * 4 + e][lane];
            const int row = row_base + gq + 8 * (e >> 1);
            const int tok = tile * 16 + 8 * f + 2 * t + (e & 1);
            if (row < N && tok < n_tok) {
                float* out = y + (long long)tok * N + row;
                *out = accumulate ? *out + v : v;
            }
        }
}

// ---- a few tokens on tensor cores, in matvec_q's order --------------------------------------
// Products of 2..16 tokens (speculation's checking passes, small batches) that give every
// token, bit for bit, what the one-token matvec_q gives it. matvec_q's lane l adds the terms
// of a row's groups l, l + 32, l + 64, ... in turn (a "chain"), then warp_sum's butterfly
// adds the 32 chains (pairs differing in bit 4 of the lane first, then bits 3, 2, 1, 0). An
// int8 mma gives a group's sums as the same integers dp4a does, so only the float work must
// follow matvec_q: each group's term (group_term) added to its chain g % 32 in turn, then
// the chains combined in the butterfly's tree.
// A block takes 16 rows and a tile of the tiled activation (quantize.cuh), 8 * NF of its
// tokens. Its EXACT_WARPS warps split the chains: warp w keeps chains 4w .. 4w + 3 in
// registers, so a round k of its loop takes groups 32k + 4w + j (j < 4: 64 contiguous bytes
// of each row's plane 0). Lane (gq, t) loads group 32k + 4w + t of rows gq and gq + 8 whole
// (a 16-byte load each), EXACT_ROUNDS rounds in flight (a round's successor is issued as
// soon as its registers are decoded), and the four lanes of a quad transpose the words into
// the mma's layout (word t of every group). At the end the chains meet in shared memory:
// the tree's levels across warps (chain bits 4..2 = warp bits 2..0), then those within a
// warp (bits 1, 0). Weights past the last row: the last row's, not stored; tokens past
// n_tok: the tile's padding, not stored.

#define EXACT_WARPS 8
#define EXACT_CHAINS 4  // chains a warp: 32 / EXACT_WARPS
static_assert(EXACT_WARPS * EXACT_CHAINS == 32, "the warps hold matvec_q's 32 chains");
#ifndef EXACT_ROUNDS
#define EXACT_ROUNDS 1  // rounds of loads in flight a warp
#endif
#ifndef EXACT_MIN_BLOCKS
#define EXACT_MIN_BLOCKS 2  // blocks an SM must hold: caps the registers
#endif

// v[i] = word i of lane t's group in, word t of group i (lane i's) out, for the four lanes
// t = lane & 3 of each quad: two rounds of pairwise swaps, across bit 0 then bit 1 of t.
__device__ __forceinline__ void quad_transpose(u32 (&v)[4], int t) {
#pragma unroll
    for (int b = 1; b <= 2; b <<= 1) {
        const bool upper = t & b;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i & b) continue;  // the pair (i, i | b): the lane keeps the word of its half
            const u32 sent = upper ? v[i] : v[i | b];
            const u32 got = __shfl_xor_sync(0xffffffffu, sent, b);
            if (upper)
                v[i] = got;
            else
                v[i | b] = got;
        }
    }
}

// The value of lane (gq, j) of this lane's quad.
template <class T>
__device__ __forceinline__ T from_quad(T v, int lane, int j) {
    return __shfl_sync(0xffffffffu, v, (lane & ~3) | j);
}

// A lane's share of one round as loaded: its group of rows gq and gq + 8
template <class F>
struct ExactRound {
    uint4 raw[2][F::qbytes / 16];
    u32 e0[2], e1[2];
    GroupScale sc[2];
};

template <class F, int NF>
__global__ void __launch_bounds__(EXACT_WARPS * 32, EXACT_MIN_BLOCKS)
    matmul_exact(PLANE_ARGS, const signed char* __restrict__ xq, const float* __restrict__ xd,
                 const float* __restrict__ xs, float* __restrict__ y, int K, int N, int n_tok,
                 int accumulate) {
    static_assert(NF == 1 || NF == 2, "a tile of 16 tokens: one or two 8-token fragments");
    pdl_trigger();
    const Planes P = PLANES;
    constexpr int V = F::qbytes / 16;  // 16-byte vectors of plane 0 a group
    constexpr int C = EXACT_CHAINS, U = EXACT_ROUNDS;
    __shared__ float partial[EXACT_WARPS][C][NF * 4][32];
    const int G = K >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = lane >> 2, t = lane & 3;
    const int row_base = blockIdx.x * 16, first = C * warp;  // the warp's chain 0
    const int rounds = G > first ? (G - first + 31) / 32 : 0;
    int rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) rows[h] = min(row_base + 8 * h + gq, N - 1);

    ExactRound<F> in[U];  // round k's loads in in[k % U]
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int v = 0; v < V; ++v) in[u].raw[h][v] = make_uint4(0, 0, 0, 0);
            in[u].e0[h] = in[u].e1[h] = 0;
            in[u].sc[h] = {0.f, 0.f, 0.f};
        }
    auto load = [&](ExactRound<F>& r, int k) {
        const int g = 32 * k + first + t;
        if (k >= rounds || g >= G) return;  // a slot past the row's end: never multiplied
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long rg = (long long)rows[h] * G + g;
            const uint4* wq = reinterpret_cast<const uint4*>(P.p[0]) + rg * V;
#pragma unroll
            for (int v = 0; v < V; ++v) r.raw[h][v] = load_weights16(wq + v);
            F::extra(P, rg, r.e0[h], r.e1[h]);
            r.sc[h] = F::scale(P, rg, (long long)rows[h] * (G >> 3) + (g >> 3));
        }
    };
#pragma unroll
    for (int u = 0; u < U; ++u) load(in[u], u);
    pdl_wait();  // the first weights are on their way: now the activation

    const long long x0 = (long long)blockIdx.y * G * 16;  // the tile's group 0, token 0
    const signed char* xb = xq + (x0 + gq) * 32 + 8 * t;  // B column gq: words t and 4 + t
    const float* xdt = xd + x0 + 2 * t;  // the scales of tokens 2t and 2t + 1
    const float* xst = xs + x0 + 2 * t;
    float acc[C][NF][4];
#pragma unroll
    for (int j = 0; j < C; ++j)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][f][e] = 0.f;

    for (int k0 = 0; k0 < rounds; k0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = k0 + u;
            if (k >= rounds) break;  // (the same for the whole warp)
            // round k as mma fragments: the lo/hi quads t of every slot j, and their scales
            int lo[2][C], hi[2][C];
            GroupScale sc[2][C];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const ExactRound<F>& r = in[u];
                u32 wa[4] = {r.raw[h][0].x, r.raw[h][0].y, r.raw[h][0].z, r.raw[h][0].w};
                u32 wb[4] = {0u, 0u, 0u, 0u};
                quad_transpose(wa, t);
                if constexpr (V == 2) {
                    const uint4 b = r.raw[h][1];
                    wb[0] = b.x, wb[1] = b.y, wb[2] = b.z, wb[3] = b.w;
                    quad_transpose(wb, t);
                }
#pragma unroll
                for (int j = 0; j < C; ++j) {
                    const u32 e0 = from_quad(r.e0[h], lane, j), e1 = from_quad(r.e1[h], lane, j);
                    F::decode(wa[j], wb[j], e0, e1, t, lo[h][j], hi[h][j]);
                    sc[h][j].s_lo = from_quad(r.sc[h].s_lo, lane, j);
                    sc[h][j].s_hi = F::split ? from_quad(r.sc[h].s_hi, lane, j) : sc[h][j].s_lo;
                    sc[h][j].m = F::has_min ? from_quad(r.sc[h].m, lane, j) : 0.f;
                }
            }
            load(in[u], k + U);  // on their way while these are multiplied
#pragma unroll
            for (int j = 0; j < C; ++j) {
                const int g = 32 * k + first + j;
                if (g >= G) break;  // (the same for the whole warp)
#pragma unroll
                for (int f = 0; f < NF; ++f) {
                    const int at = g * 16 + f * 8;  // the fragment's first token's group
                    const int2 b = *reinterpret_cast<const int2*>(xb + (long long)at * 32);
                    const float2 d = *reinterpret_cast<const float2*>(xdt + at);
                    const float2 s = F::has_min ? *reinterpret_cast<const float2*>(xst + at)
                                                : make_float2(0.f, 0.f);
                    int c_lo[4], c_hi[4] = {0, 0, 0, 0};
                    if (F::split) {
                        mma_k16(c_lo, lo[0][j], lo[1][j], b.x, SUM_BIAS);
                        mma_k16(c_hi, hi[0][j], hi[1][j], b.y, SUM_BIAS);
                    } else {
                        mma_k32(c_lo, lo[0][j], lo[1][j], hi[0][j], hi[1][j], b.x, b.y, SUM_BIAS);
                    }
                    // element e: row gq + 8 (e >> 1), token 2t + (e & 1) of the fragment
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[j][f][e] = group_term<F>(acc[j][f][e], c_lo[e], c_hi[e],
                                                     sc[e >> 1][j], e & 1 ? d.y : d.x,
                                                     e & 1 ? s.y : s.x);
                }
            }
        }
    }

    // the chains' tree: thread i takes element (f, e) = i / 32 of lane i % 32's results
#pragma unroll
    for (int j = 0; j < C; ++j)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[warp][j][f * 4 + e][lane] = acc[j][f][e];
    __syncthreads();
    const int mine = threadIdx.x >> 5;
    if (mine >= NF * 4) return;
    float v[EXACT_WARPS][C];
#pragma unroll
    for (int w = 0; w < EXACT_WARPS; ++w)
#pragma unroll
        for (int j = 0; j < C; ++j) v[w][j] = partial[w][j][mine][lane];
    // chain c = C * w + j: its bits 4, 3, 2 are w's bits 2, 1, 0, then j's bits 1, 0
#pragma unroll
    for (int half = EXACT_WARPS / 2; half > 0; half >>= 1)
#pragma unroll
        for (int w = 0; w < half; ++w)
#pragma unroll
            for (int j = 0; j < C; ++j) v[w][j] = v[w][j] + v[w + half][j];
#pragma unroll
    for (int half = C / 2; half > 0; half >>= 1)
#pragma unroll
        for (int j = 0; j < half; ++j) v[0][j] = v[0][j] + v[0][j + half];
    const int f = mine >> 2, e = mine & 3;
    const int row = row_base + gq + 8 * (e >> 1), tok = blockIdx.y * 16 + 8 * f + 2 * t + (e & 1);
    if (row < N && tok < n_tok) {
        float* out = y + (long long)tok * N + row;
        *out = accumulate ? *out + v[0][0] : v[0][0];
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
// Four threads per group of 32, each writing 8 consecutive weights as one 16-byte store (a
// warp: 512 contiguous bytes): out [N, K] half. Thread j of a group takes weights 8j..8j+7:
// quads 2(j & 1) and 2(j & 1) + 1, their low halves for j < 2, the high ones after.

template <class F>
__global__ void dequant_f16(PLANE_ARGS, __half* __restrict__ out, int K, long long n_groups) {
    pdl_start();
    const Planes P = PLANES;
    const long long th = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long rg = th >> 2;
    if (rg >= n_groups) return;
    const int j = th & 3, G = K >> 5;
    const long long row = rg / G;
    const int g = rg % G;
    const GroupScale s = F::scale(P, rg, row * (G >> 3) + (g >> 3));
    const bool high = j >= 2;
    const float scale = high ? s.s_hi : s.s_lo;
    __align__(16) __half2 v[4];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        int lo, hi;
        load_quad<F>(P, rg, 2 * (j & 1) + u, lo, hi);
        const int q = high ? hi : lo;
#pragma unroll
        for (int b = 0; b < 4; b += 2) {
            const float q0 = (signed char)((q >> (8 * b)) & 0xFF);
            const float q1 = (signed char)((q >> (8 * b + 8)) & 0xFF);
            v[2 * u + b / 2] = __floats2half2_rn(scale * q0 + s.m, scale * q1 + s.m);
        }
    }
    reinterpret_cast<uint4*>(out)[th] = *reinterpret_cast<const uint4*>(v);
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
