// Element-wise and row operations: RMSNorm, RoPE, SiLU-multiply, KV-cache writes, attention.
#include <cuda_fp16.h>

#include "launch.cuh"
#include "quantize.cuh"

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += scratch[w];
    return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, scratch[w]);
    return m;
}

// y [n, d] = x / rms(x) * w; one block per row.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ y, int d, double eps) {
    pdl_start();
    __shared__ double scratch[32];
    const float* xr = x + (long long)blockIdx.x * d;
    double ss = 0.0;  // float squares summed in double, mean and scale in float: as ggml
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += (double)(xr[i] * xr[i]);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += scratch[w];
    const float scale = 1.0f / sqrtf((float)(total / d) + (float)eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        y[(long long)blockIdx.x * d + i] = (xr[i] * scale) * w[i];
}

// RoPE angle of pair i at position pos as llama.cpp's CPU recurrence takes it: pos times
// base^(-2/n_dims) (powers[1], from the host), i times, each product rounded to float32;
// then / factors[i] and * freq_scale.
__device__ __forceinline__ float rope_theta(int pos, int i, const float* powers,
                                            const float* factors, float freq_scale) {
    float theta = (float)pos;
    for (int j = 0; j < i; ++j) theta *= powers[1];
    if (factors) theta = theta / factors[i];
    return freq_scale * theta;
}

// The two elements of pair i: (2i, 2i+1) in llama's layout, (i, i + n_dims/2) in NEOX's.
__device__ __forceinline__ void rope_pair(int i, int half, int neox, int& a, int& b) {
    a = neox ? i : 2 * i;
    b = neox ? i + half : 2 * i + 1;
}

// Rotate x [n, heads, hd] in place.
extern "C" __global__ void rope(float* __restrict__ x, const int* __restrict__ pos,
                                const float* __restrict__ powers,
                                const float* __restrict__ factors, int n, int heads, int hd,
                                int n_dims, float freq_scale, int neox) {
    pdl_start();
    const int half = n_dims >> 1;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * heads * half) return;
    const int i = idx % half;
    const long long th = idx / half;  // token * heads + head
    float s, c;
    sincosf(rope_theta(pos[th / heads], i, powers, factors, freq_scale), &s, &c);
    int ia, ib;
    rope_pair(i, half, neox, ia, ib);
    float* v = x + th * hd;
    const float a = v[ia], b = v[ib];
    v[ia] = a * c - b * s;
    v[ib] = a * s + b * c;
}

// A layer's RoPE as the kernels that rotate take it (the host's RopeConfig and table).
struct RopeArgs {
    const float* powers;  // powers[1]: base^(-2 / n_dims) (rope_theta)
    const float* factors;  // per-pair divisors, or null
    int n_dims, neox;
    float freq_scale;
};

// Element r of a head's rotation: pair r (r < n_dims / 2) rotated to position p, or past the
// pairs one unrotated element twice, from the head's row src plus its bias (null: none), as
// (ia, a) and (ib, b). per_head: the elements of a head, rope_elements(hd).
__device__ __forceinline__ int rope_elements(const RopeArgs& rope, int hd) {
    return (rope.n_dims >> 1) + (hd - rope.n_dims);
}

__device__ __forceinline__ void rope_element(const RopeArgs& rope, int r, const float* src,
                                             const float* bias, int p, int& ia, int& ib,
                                             float& a, float& b) {
    const int half = rope.n_dims >> 1;
    if (r < half) {
        rope_pair(r, half, rope.neox, ia, ib);
    } else {
        ia = ib = rope.n_dims + (r - half);
    }
    a = src[ia];
    b = src[ib];
    if (bias) {
        a += bias[ia];
        b += bias[ib];
    }
    if (r < half) {
        float s, c;
        sincosf(rope_theta(p, r, rope.powers, rope.factors, rope.freq_scale), &s, &c);
        const float ra = a * c - b * s, rb = a * s + b * c;
        a = ra;
        b = rb;
    }
}

// A q head (src, bias) rotated to position p into dst [hd], by the block's threads.
__device__ __forceinline__ void rope_q_head(const RopeArgs& rope, const float* src,
                                            const float* bias, int p, int hd, float* dst) {
    for (int r = threadIdx.x; r < rope_elements(rope, hd); r += blockDim.x) {
        int ia, ib;
        float a, b;
        rope_element(rope, r, src, bias, p, ia, ib, a, b);
        dst[ia] = a;
        dst[ib] = b;
    }
}

// A token's k head rotated to position p and its v head (plus their biases) stored as fp16
// at k_dst, v_dst [hd], by the block's threads.
__device__ __forceinline__ void rope_kv_head(const RopeArgs& rope, const float* k_src,
                                             const float* v_src, const float* bk,
                                             const float* bv, int p, int hd, __half* k_dst,
                                             __half* v_dst) {
    for (int r = threadIdx.x; r < rope_elements(rope, hd); r += blockDim.x) {
        int ia, ib;
        float a, b;
        rope_element(rope, r, k_src, bk, p, ia, ib, a, b);
        k_dst[ia] = __float2half_rn(a);
        k_dst[ib] = __float2half_rn(b);
    }
    for (int e = threadIdx.x; e < hd; e += blockDim.x)
        v_dst[e] = __float2half_rn(bv ? v_src[e] + bv[e] : v_src[e]);
}

// A layer's projections before RoPE, for an attention kernel that rotates and stores them
// itself (attn_split): q [n, h * hd] and k, v [n, hk * hd] in rows q_stride
// and kv_stride floats apart (views into a fused product), their biases (or null), each
// token's cache slot. k null: q is rotated already, [n, h, hd], and the cache is written.
struct AttnInputs {
    const float *k, *v;
    int q_stride, kv_stride;
    const float *bq, *bk, *bv;
    const int* slots;
    RopeArgs rope;
};

// Token tok's q head `head` rotated into dst [hd] (rope_q_head), as rope_kv writes it.
__device__ __forceinline__ void attn_q_head(const AttnInputs& in, const float* q, int tok,
                                            int head, int hd, int p, float* dst) {
    const int off = head * hd;
    rope_q_head(in.rope, q + (long long)tok * in.q_stride + off, in.bq ? in.bq + off : nullptr,
                p, hd, dst);
}

// Token tok's k and v heads of KV head kvh into their cache row slots[tok], as rope_kv
// writes them; kc, vc: the layer's cache [rows, hk, hd].
__device__ __forceinline__ void attn_kv_head(const AttnInputs& in, int tok, int kvh, int hk,
                                             int hd, int p, __half* kc, __half* vc) {
    const int off = kvh * hd;
    const long long src = (long long)tok * in.kv_stride + off;
    const long long dst = (long long)in.slots[tok] * hk * hd + off;
    rope_kv_head(in.rope, in.k + src, in.v + src, in.bk ? in.bk + off : nullptr,
                 in.bv ? in.bv + off : nullptr, p, hd, kc + dst, vc + dst);
}

__device__ __forceinline__ AttnInputs attn_inputs(const float* k, const float* v, int q_stride,
                                                  int kv_stride, const float* bq,
                                                  const float* bk, const float* bv,
                                                  const int* slots, const float* powers,
                                                  const float* factors, int n_dims,
                                                  float freq_scale, int neox) {
    AttnInputs in;
    in.k = k;
    in.v = v;
    in.q_stride = q_stride;
    in.kv_stride = kv_stride;
    in.bq = bq;
    in.bk = bk;
    in.bv = bv;
    in.slots = slots;
    in.rope.powers = powers;
    in.rope.factors = factors;
    in.rope.n_dims = n_dims;
    in.rope.neox = neox;
    in.rope.freq_scale = freq_scale;
    return in;
}

// The attention inputs, block (token, head) in one pass: biases added (when given), q head
// rotated into q_out [n, h * hd]; a k head rotated and its v head stored as fp16 at cache row
// slots[token] (heads h .. h + hk - 1 of the grid).
// Rows of q and of k, v are q_stride and kv_stride floats apart (views into a fused product).
extern "C" __global__ void rope_kv(const float* __restrict__ q, const float* __restrict__ k,
                                   const float* __restrict__ v, int q_stride, int kv_stride,
                                   const float* __restrict__ bq, const float* __restrict__ bk,
                                   const float* __restrict__ bv, float* __restrict__ q_out,
                                   __half* __restrict__ kc, __half* __restrict__ vc,
                                   const int* __restrict__ pos, const int* __restrict__ slots,
                                   const float* __restrict__ powers,
                                   const float* __restrict__ factors, int h, int hk, int hd,
                                   int n_dims, float freq_scale, int neox) {
    pdl_start();
    const int tok = blockIdx.x, j = blockIdx.y;
    const AttnInputs in = attn_inputs(k, v, q_stride, kv_stride, bq, bk, bv, slots, powers,
                                      factors, n_dims, freq_scale, neox);
    if (j < h)
        attn_q_head(in, q, tok, j, hd, pos[tok], q_out + ((long long)tok * h + j) * hd);
    else
        attn_kv_head(in, tok, j - h, hk, hd, pos[tok], kc, vc);
}

// silu(gate) * up, element-wise.
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ y, long long n) {
    pdl_start();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = g[i] / (1.f + (float)exp(-(double)g[i])) * u[i];  // as matmul.cu's silu
}

// gelu(gate) * up as llama.cpp's CPU geglu: gate rounded to fp16, GELU (tanh form, float)
// rounded to fp16 as its lookup table holds it; 0 from -10 down, gate itself from 10 up.
extern "C" __global__ void gelu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ y, long long n) {
    pdl_start();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float x = g[i];
    float gelu = x;
    if (x <= -10.f) {
        gelu = 0.f;
    } else if (x < 10.f) {
        const float h = __half2float(__float2half_rn(x));
        const float inner = 0.7978845608028654f * h * (1.f + 0.044715f * h * h);
        gelu = __half2float(__float2half_rn(0.5f * h * (1.f + tanhf(inner))));
    }
    y[i] = gelu * u[i];
}

// x [n] -> cap * tanh(x / cap) in place (soft-capped logits).
extern "C" __global__ void softcap(float* __restrict__ x, long long n, float cap) {
    pdl_start();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// k, v [n, hk * hd] float -> cache rows slots[i] of kc, vc [c, hk * hd] half.
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    __half* __restrict__ kc, __half* __restrict__ vc,
                                    const int* __restrict__ slots, int n, int width) {
    pdl_start();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * width) return;
    const int i = idx / width, e = idx % width;
    const long long dst = (long long)slots[i] * width + e;
    kc[dst] = __float2half_rn(k[idx]);
    vc[dst] = __float2half_rn(v[idx]);
}

// Rows src .. src + n of every layer of the fp16 caches ks, vs to rows dst .. dst + n of kd, vd
// ([layers, rows, width] each, layer strides in halves); keys rotated by `shift` positions as
// rope would (a context shift moves the kept tokens down: shift < 0; a prefix copy: 0). One
// thread an element; the first element of a rotated pair writes both. Source and destination
// rows must not overlap (the host stages an overlapping move through scratch rows).
extern "C" __global__ void kv_copy(const __half* __restrict__ ks, const __half* __restrict__ vs,
                                   long long src_stride, __half* __restrict__ kd,
                                   __half* __restrict__ vd, long long dst_stride, int layers,
                                   int n, int width, int hd, int shift,
                                   const float* __restrict__ powers,
                                   const float* __restrict__ factors, int n_dims,
                                   float freq_scale, int neox) {
    pdl_start();
    const long long per_layer = (long long)n * width;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= per_layer * layers) return;
    const long long layer = idx / per_layer, at = idx % per_layer;
    const long long src = layer * src_stride + at, dst = layer * dst_stride + at;
    vd[dst] = vs[src];
    const int e = at % hd, half = n_dims >> 1;  // element within its head
    if (shift == 0 || e >= n_dims) {
        kd[dst] = ks[src];
        return;
    }
    const int i = neox ? (e < half ? e : e - half) : e >> 1;  // its pair
    int ia, ib;
    rope_pair(i, half, neox, ia, ib);
    if (e != ia) return;
    float s, c;
    sincosf(rope_theta(shift, i, powers, factors, freq_scale), &s, &c);
    const float a = __half2float(ks[src]), b = __half2float(ks[src + (ib - ia)]);
    kd[dst] = __float2half_rn(a * c - b * s);
    kd[dst + (ib - ia)] = __float2half_rn(a * s + b * c);
}

// Eight fp16 values (one 16-byte load) as floats.
__device__ __forceinline__ void half8_to_float(uint4 u, float (&f)[8]) {
    const __half2* h2 = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 v = __half22float2(h2[e]);
        f[2 * e] = v.x;
        f[2 * e + 1] = v.y;
    }
}

// ---- attention over the fp16 KV cache: split over the cache length, then combined ---------
// Where a query's position p lives: row starts[query] + p of the cache, or on a sliding-window
// layer's ring (ring > 0 rows a sequence) row starts[query] + (p + offsets[query]) % ring.
// first: the row (within the sequence's rows) of the first position read, lo; the position
// lo + j is then at first + j, less ring past its end (a window is shorter than the ring:
// one wrap at most).
__device__ __forceinline__ int ring_first(int lo, const int* __restrict__ offsets, int query,
                                          int ring) {
    return ring > 0 ? (lo + offsets[query]) % ring : lo;
}

__device__ __forceinline__ int ring_row(int first, int j, int ring) {
    const int r = first + j;
    return ring > 0 && r >= ring ? r - ring : r;
}

// Block (head, split, query) covers an equal share of the query's positions 0..pos (of the
// sequence that starts at cache row starts[query]) in rounds of ATTN_DEPTH positions per lane
// group, with an online softmax, and writes its unnormalised output o [hd], running max m and
// sum l. hd: a multiple of 8, at most 256. The last of a (query, head)'s split blocks to
// finish merges all splits (flash-decoding) into out [n, h * hd] (and, given xq, its
// Q8_0/Q8_1 quantization for the output projection, as quantize_rows would write it) and
// resets the ticket, so the counters are all zero again for the next launch (or replay).
#define ATTN_MAX_SPLITS 128  // one per thread of the merge (ATTN_THREADS)

// The merge of a (query, head)'s `active` splits into out (and xq, xd, xs), by the block that
// finished last; resets the ticket.
__device__ void merge_splits(const float* part_o, const float2* part_ml, int* tickets,
                             float* out, int qh, int hd, int splits, int active,
                             float* scratch, int h, signed char* xq, float* xd, float* xs,
                             int tiled) {
    __shared__ float weight[ATTN_MAX_SPLITS];
    __threadfence();
    // every split's (m, l) read at once, then its weight exp(m_s - m) into shared memory
    const long long base = (long long)qh * splits;
    float2 ml = make_float2(-1e30f, 0.f);
    if (threadIdx.x < active) ml = __ldcg(&part_ml[base + threadIdx.x]);
    const float m = block_max(ml.x, scratch);
    const float w = threadIdx.x < active ? expf(ml.x - m) : 0.f;
    if (threadIdx.x < active) weight[threadIdx.x] = w;
    const float l = block_sum(ml.y * w, scratch);  // its barriers publish weight[]
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.f;
#pragma unroll 8
        for (int s = 0; s < active; ++s) o += __ldcg(&part_o[(base + s) * hd + d]) * weight[s];
        const float v = o / l;
        out[(long long)qh * hd + d] = v;
        if (xq)  // whole warps (hd: a multiple of 32), each a group of 32 of the query's row
            quantize_q8_32(v, act_group(qh / h, (qh % h) * hd + d, h * hd, tiled),
                           tiled, xq, xd, xs);
    }
    if (threadIdx.x == 0) tickets[qh] = 0;
}

__device__ void merge_if_last(const float* part_o, const float2* part_ml, int* tickets,
                              float* out, int qh, int hd, int splits, int active, int* last,
                              float* scratch, int h, signed char* xq, float* xd, float* xs,
                              int tiled) {
    __threadfence();  // this block's partial results are visible before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(&tickets[qh], 1) == active - 1;
    __syncthreads();
    if (!*last) return;
    merge_splits(part_o, part_ml, tickets, out, qh, hd, splits, active, scratch, h, xq, xd, xs,
                 tiled);
}

#define ATTN_THREADS 128
#define ATTN_DEPTH 8  // positions in flight per lane group: their K and V rows load together
#ifndef ATTN_MIN_BLOCKS
#define ATTN_MIN_BLOCKS 1  // blocks an SM must hold: caps the registers (backend.py)
#endif

// A lane's place in a block: gp lanes (a power of two) hold one position's row, 8 dims each
// (dg), so a warp reads per_warp = 32 / gp positions per load (sub: which), and each lane
// group keeps its own online softmax (a "stream"); stride: positions between a stream's
// consecutive loads, round: positions a round of ATTN_DEPTH loads covers.
struct AttnLane {
    int gp, per_warp, dg, sub, stride, round;
    bool dims;
};

__device__ __forceinline__ AttnLane attn_lane(int hd) {
    AttnLane a;
    const int groups = hd >> 3, lane = threadIdx.x & 31;
    a.gp = 1;
    while (a.gp < groups) a.gp <<= 1;
    a.per_warp = 32 / a.gp;
    a.dg = lane % a.gp;
    a.sub = lane / a.gp;
    a.dims = a.dg < groups;
    a.stride = (ATTN_THREADS / 32) * a.per_warp;
    a.round = ATTN_DEPTH * a.stride;
    return a;
}

// A query's positions lo .. lo + len - 1 and its split's share of them, p0 .. p1 - 1 (every
// split whole rounds of loads; splits from `active` on have none).
struct AttnSpan {
    int lo, len, share, active, p0, p1;
};

__device__ __forceinline__ AttnSpan attn_span(int pos, int window, int splits, int split,
                                              int round) {
    AttnSpan s;
    s.lo = window > 0 ? max(0, pos - window + 1) : 0;
    s.len = pos + 1 - s.lo;
    s.share = ((s.len + splits - 1) / splits + round - 1) / round * round;
    s.active = (s.len + s.share - 1) / s.share;
    s.p0 = split * s.share;
    s.p1 = min(s.p0 + s.share, s.len);
    return s;
}

// One round's K and V rows of a stream: positions base + sub + u * stride below p1.
__device__ __forceinline__ void attn_load(const AttnLane& a, const __half* kc, const __half* vc,
                                          int base, int p1, int first, int ring, int row,
                                          uint4 (&kr)[ATTN_DEPTH], uint4 (&vr)[ATTN_DEPTH]) {
#pragma unroll
    for (int u = 0; u < ATTN_DEPTH; ++u) {
        const int pp = base + a.sub + u * a.stride;
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
        if (a.dims && pp < p1) {
            const long long at = (long long)ring_row(first, pp, ring) * row;
            kr[u] = reinterpret_cast<const uint4*>(kc + at)[a.dg];
            vr[u] = reinterpret_cast<const uint4*>(vc + at)[a.dg];
        }
    }
}

// A stream's online softmax over one round's rows (positions below p1 count).
__device__ __forceinline__ void attn_update(const AttnLane& a, const uint4 (&kr)[ATTN_DEPTH],
                                            const uint4 (&vr)[ATTN_DEPTH], const float (&qf)[8],
                                            float (&acc)[8], float& m, float& l, int base,
                                            int p1, float scale, float softcap) {
    float sc[ATTN_DEPTH];
    float m_new = m;
#pragma unroll
    for (int u = 0; u < ATTN_DEPTH; ++u) {
        const __half2* k2 = reinterpret_cast<const __half2*>(&kr[u]);
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float2 kf = __half22float2(k2[c]);
            dot += qf[2 * c] * kf.x + qf[2 * c + 1] * kf.y;
        }
        for (int o = a.gp >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const bool valid = base + a.sub + u * a.stride < p1;
        const float score = softcap > 0.f ? softcap * tanhf(dot * scale / softcap) : dot * scale;
        sc[u] = valid ? score : -1e30f;
        m_new = fmaxf(m_new, sc[u]);
    }
    const float rescale = expf(m - m_new);
    l *= rescale;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= rescale;
#pragma unroll
    for (int u = 0; u < ATTN_DEPTH; ++u) {
        const float w = base + a.sub + u * a.stride < p1 ? expf(sc[u] - m_new) : 0.f;
        l += w;
        const __half2* v2 = reinterpret_cast<const __half2*>(&vr[u]);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float2 vf = __half22float2(v2[c]);
            acc[2 * c] += w * vf.x;
            acc[2 * c + 1] += w * vf.y;
        }
    }
    m = m_new;
}

// The warp's streams merged (lanes gp apart hold the same dims), then the block's warps, into
// the split's partial output part_o [part] and (max, sum) part_ml [part]. Ends on a barrier:
// warp_ml and warp_o may be reused after.
__device__ __forceinline__ void attn_partial(const AttnLane& a, float (&acc)[8], float m,
                                             float l, float (*warp_ml)[2], float (*warp_o)[256],
                                             float* part_o, float2* part_ml, long long part,
                                             int hd) {
    constexpr int WARPS = ATTN_THREADS / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float m_w = m;
    for (int o = a.gp; o < 32; o <<= 1) m_w = fmaxf(m_w, __shfl_xor_sync(0xffffffffu, m_w, o));
    const float w_s = expf(m - m_w);
    l *= w_s;
    for (int o = a.gp; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        acc[e] *= w_s;
        for (int o = a.gp; o < 32; o <<= 1) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    }
    if (lane == 0) {
        warp_ml[warp][0] = m_w;
        warp_ml[warp][1] = l;
    }
    if (a.sub == 0 && a.dims)
#pragma unroll
        for (int e = 0; e < 8; ++e) warp_o[warp][8 * a.dg + e] = acc[e];
    __syncthreads();
    float big = -1e30f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) big = fmaxf(big, warp_ml[w][0]);
    for (int d = threadIdx.x; d < hd; d += ATTN_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) o += warp_o[w][d] * expf(warp_ml[w][0] - big);
        part_o[part * hd + d] = o;
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += warp_ml[w][1] * expf(warp_ml[w][0] - big);
        part_ml[part] = make_float2(big, total);
    }
    __syncthreads();
}

// Block (head, split, query) covers an equal share of the query's positions 0..pos (of the
// sequence that starts at cache row starts[query]) in rounds of ATTN_DEPTH positions per lane
// group, with an online softmax, and writes its unnormalised output o [hd], running max m and
// sum l. hd: a multiple of 8, at most 256. The last of a (query, head)'s split blocks to
// finish merges all splits (flash-decoding) into out [n, h * hd] (and, given xq, its
// Q8_0/Q8_1 quantization for the output projection, as quantize_rows would write it) and
// resets the ticket, so the counters are all zero again for the next launch (or replay).
// Given k_in (AttnInputs), q holds the raw projections of a decode step whose every query is
// its sequence's only new token: each block rotates its query head itself, and the query's
// last split stores its new K and V rows before reading them, in place of rope_kv (a launch
// a layer fewer). kc and vc are then written and read by one launch: no read-only loads.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS)
    attn_split(const float* __restrict__ q, __half* kc, __half* vc, const int* __restrict__ pos,
               const int* __restrict__ starts, float* __restrict__ part_o,
               float2* __restrict__ part_ml, int* __restrict__ tickets,
               float* __restrict__ out, int h, int hk, int hd, int splits, float scale,
               signed char* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs,
               int tiled, int window, float softcap, const int* __restrict__ offsets,
               int ring, const float* __restrict__ k_in, const float* __restrict__ v_in,
               int q_stride, int kv_stride, const float* __restrict__ bq,
               const float* __restrict__ bk, const float* __restrict__ bv,
               const int* __restrict__ slots, const float* __restrict__ powers,
               const float* __restrict__ factors, int n_dims, float freq_scale, int neox) {
    pdl_start();
    constexpr int WARPS = ATTN_THREADS / 32;
    __shared__ float warp_ml[WARPS][2];  // each warp's running max and sum
    __shared__ float warp_o[WARPS][256];  // and its unnormalised output
    __shared__ float scratch[32];
    __shared__ float q_rot[256];  // the query's head, rotated here (k_in given)
    __shared__ int last;
    const int head = blockIdx.x, split = blockIdx.y, i = blockIdx.z;
    const int warp = threadIdx.x >> 5;
    const AttnLane a = attn_lane(hd);
    // the grid has splits for the whole cache (a graph replays it as the sequence grows);
    // each active one takes whole rounds of loads, the rest leave at once
    // window > 0: the query sees only its last `window` positions, lo .. pos[i]
    const AttnSpan sp = attn_span(pos[i], window, splits, split, a.round);
    const long long part = ((long long)i * h + head) * splits + split;
    if (split >= sp.active) return;
    const int kvh = head / (h / hk), row = hk * hd;  // row: halves per cache row
    const float* qr = q + ((long long)i * h + head) * hd;
    if (k_in) {  // the projections raw, each query its sequence's only new token
        const AttnInputs in = attn_inputs(k_in, v_in, q_stride, kv_stride, bq, bk, bv, slots,
                                          powers, factors, n_dims, freq_scale, neox);
        attn_q_head(in, q, i, head, hd, pos[i], q_rot);
        // the new row is the last this query reads: its last split stores it (the blocks of
        // the other query heads of its KV head store the same bits)
        if (split == sp.active - 1) attn_kv_head(in, i, kvh, hk, hd, pos[i], kc, vc);
        __syncthreads();  // q_rot; the row, before this block's loads of it
        qr = q_rot;
    }
    kc += (long long)starts[i] * row + kvh * hd;
    vc += (long long)starts[i] * row + kvh * hd;
    const int first = ring_first(sp.lo, offsets, i, ring);  // the row of position lo
    qr += 8 * a.dg;
    float qf[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[e] = a.dims ? __half2float(__float2half_rn(qr[e])) : 0.f;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float m = -1e30f, l = 0.f;
    for (int base = sp.p0 + warp * a.per_warp; base < sp.p1; base += a.round) {
        uint4 kr[ATTN_DEPTH], vr[ATTN_DEPTH];
        attn_load(a, kc, vc, base, sp.p1, first, ring, row, kr, vr);
        attn_update(a, kr, vr, qf, acc, m, l, base, sp.p1, scale, softcap);
    }
    attn_partial(a, acc, m, l, warp_ml, warp_o, part_o, part_ml, part, hd);
    merge_if_last(part_o, part_ml, tickets, out, i * h + head, hd, splits, sp.active, &last,
                  scratch, h, xq, xd, xs, tiled);
}

// ---- attention for a few queries a block (speculation's checking passes) ------------------
// attn_split's work for the queries i0 .. i0 + group - 1 of the pass in one block (head,
// split, query group): each query's arithmetic is attn_split's, term for term (the same
// streams, rounds, merges and splits), so each gets the bits it would get alone, but queries
// of one sequence that split its positions alike (a run: the same first cache row, window
// start, share and ring offset; consecutive) read each round's K and V rows once for all of
// them. Each lane's streams of the run's queries wait in dynamic shared memory between
// rounds (st [group][10][ATTN_THREADS]: acc, m, l), their fp16-rounded q rows beside them
// (qs [group][hd]); the block's tickets are taken together at the end. group: at most
// ATTN_GROUP_N.
#define ATTN_GROUP_N 16

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS)
    attn_group(const float* __restrict__ q, const __half* __restrict__ kc,
               const __half* __restrict__ vc, const int* __restrict__ pos,
               const int* __restrict__ starts, float* __restrict__ part_o,
               float2* __restrict__ part_ml, int* __restrict__ tickets,
               float* __restrict__ out, int h, int hk, int hd, int splits, float scale,
               signed char* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs,
               int tiled, int window, float softcap, const int* __restrict__ offsets,
               int ring, int n, int group) {
    pdl_start();
    constexpr int WARPS = ATTN_THREADS / 32;
    __shared__ float warp_ml[WARPS][2];
    __shared__ float warp_o[WARPS][256];
    __shared__ float scratch[32];
    __shared__ int key[ATTN_GROUP_N][4];  // each query's run key: start, lo, share, first
    __shared__ int last[ATTN_GROUP_N];
    extern __shared__ __align__(16) float st[];
    const int head = blockIdx.x, split = blockIdx.y, i0 = blockIdx.z * group;
    const int ng = min(group, n - i0), tid = threadIdx.x, warp = tid >> 5;
    const AttnLane a = attn_lane(hd);
    const int kvh = head / (h / hk), row = hk * hd;
    float* const qs = st + group * 10 * ATTN_THREADS;
    if (tid < ng) {
        const int i = i0 + tid;
        const AttnSpan s = attn_span(pos[i], window, splits, split, a.round);
        key[tid][0] = starts[i];
        key[tid][1] = s.lo;
        key[tid][2] = s.share;
        key[tid][3] = ring_first(s.lo, offsets, i, ring);
    }
    for (int x = tid; x < ng * hd; x += ATTN_THREADS) {
        const int j = x / hd, d = x - j * hd;
        qs[x] = __half2float(__float2half_rn(q[((long long)(i0 + j) * h + head) * hd + d]));
    }
    auto state = [&](int j, int k) -> float& { return st[(j * 10 + k) * ATTN_THREADS + tid]; };
    for (int j = 0; j < ng; ++j) {  // a thread's own slots: no barrier needed for them
#pragma unroll
        for (int e = 0; e < 8; ++e) state(j, e) = 0.f;
        state(j, 8) = -1e30f;
        state(j, 9) = 0.f;
    }
    __syncthreads();  // key, qs
    for (int r0 = 0; r0 < ng;) {  // (the same for the whole block)
        int r1 = r0 + 1;  // the run: queries r0 .. r1 - 1
        while (r1 < ng && key[r1][0] == key[r0][0] && key[r1][1] == key[r0][1] &&
               key[r1][2] == key[r0][2] && key[r1][3] == key[r0][3])
            ++r1;
        const int lo = key[r0][1], share = key[r0][2], first = key[r0][3];
        const int p0 = split * share;
        int top = p0;  // rows below top: any of the run's
        for (int j = r0; j < r1; ++j) top = max(top, min(p0 + share, pos[i0 + j] + 1 - lo));
        const __half* kb = kc + (long long)key[r0][0] * row + kvh * hd;
        const __half* vb = vc + (long long)key[r0][0] * row + kvh * hd;
        for (int base = p0 + warp * a.per_warp; base < top; base += a.round) {
            uint4 kr[ATTN_DEPTH], vr[ATTN_DEPTH];
            attn_load(a, kb, vb, base, top, first, ring, row, kr, vr);
            for (int j = r0; j < r1; ++j) {
                const int p1 = min(p0 + share, pos[i0 + j] + 1 - lo);
                if (base >= p1) continue;  // past this query's rows: attn_split stops there
                float qf[8], acc[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    qf[e] = a.dims ? qs[j * hd + min(8 * a.dg + e, hd - 1)] : 0.f;
                    acc[e] = state(j, e);
                }
                float m = state(j, 8), l = state(j, 9);
                attn_update(a, kr, vr, qf, acc, m, l, base, p1, scale, softcap);
#pragma unroll
                for (int e = 0; e < 8; ++e) state(j, e) = acc[e];
                state(j, 8) = m;
                state(j, 9) = l;
            }
        }
        for (int j = r0; j < r1; ++j) {
            if (p0 >= pos[i0 + j] + 1 - lo) continue;  // no rows in this split
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = state(j, e);
            const long long part = ((long long)(i0 + j) * h + head) * splits + split;
            attn_partial(a, acc, state(j, 8), state(j, 9), warp_ml, warp_o, part_o, part_ml,
                         part, hd);
        }
        r0 = r1;
    }
    __threadfence();  // the block's partial results are visible before its tickets are
    __syncthreads();
    if (tid < ng) {
        const int i = i0 + tid;
        const AttnSpan s = attn_span(pos[i], window, splits, split, a.round);
        last[tid] = split < s.active && atomicAdd(&tickets[i * h + head], 1) == s.active - 1;
    }
    __syncthreads();
    for (int j = 0; j < ng; ++j) {
        if (!last[j]) continue;  // (the same for the whole block)
        const int i = i0 + j;
        const AttnSpan s = attn_span(pos[i], window, splits, split, a.round);
        merge_splits(part_o, part_ml, tickets, out, i * h + head, hd, splits, s.active, scratch,
                     h, xq, xd, xs, tiled);
        __syncthreads();  // weight[] and scratch are free for the next query's merge
    }
}


// ---- attention for prefill: tiles of queries of one sequence ------------------------------
// Block (head, tile) takes up to AT_QT queries of one sequence (tiles[tile] = first query,
// count; the host groups them: same cache start, consecutive positions) and walks the keys
// of their span in chunks of AT_KT positions staged in shared memory, each chunk's K and V
// read once for all the tile's queries (attn_split reads them once a query). Thread t holds
// a 4 x 4 block of scores (queries 4 (t / 8).., keys 4 (t % 8)..) and the output of the same
// 4 queries over HD / 8 dimensions, with the online softmax of flash attention; the 8 threads
// of a query block are neighbouring lanes, which exchange row maxima and sums by shuffles.
// window > 0: query at position p sees positions p - window + 1 .. p only. ring > 0: the
// cache is a sliding-window layer's ring (ring_first / ring_row); the tile's queries share
// one sequence, so one offset, and its span (a window and a pass) fits the ring.
#define AT_QT 64
#define AT_KT 32
#define AT_MASKED __int_as_float(0xff800000)  // -inf (NVRTC has no math.h)

template <int HD>
__device__ __forceinline__ void attn_tiles_body(
    const float* __restrict__ q, const __half* __restrict__ kc, const __half* __restrict__ vc,
    const int* __restrict__ pos, const int* __restrict__ starts, const int2* __restrict__ tiles,
    float* __restrict__ out, int h, int hk, float scale, int window, float softcap,
    const int* __restrict__ offsets, int ring) {
    pdl_start();
    extern __shared__ __align__(16) unsigned char at_smem[];
    constexpr int LD = HD + 8;  // halves a staged row: rows 16 bytes apart on the banks
    constexpr int DS = HD / 8;  // output dimensions a thread
    __half* sq = reinterpret_cast<__half*>(at_smem);
    __half* sk = sq + AT_QT * LD;
    __half* sv = sk + AT_KT * LD;
    float* sp = reinterpret_cast<float*>(sv + AT_KT * LD);  // [AT_QT][AT_KT + 1]
    const int head = blockIdx.x, t = threadIdx.x;
    const int2 tl = tiles[gridDim.y - 1 - blockIdx.y];  // the longest spans start first
    const int first = tl.x, count = tl.y;
    const int row = hk * HD;  // halves a cache row
    const long long base = (long long)starts[first] * row + (head / (h / hk)) * HD;
    for (int i = t; i < AT_QT * HD / 2; i += blockDim.x) {  // q rounded to fp16, as attn_split
        const int r = i / (HD / 2), c = (i % (HD / 2)) * 2;
        float2 v = make_float2(0.f, 0.f);
        if (r < count)
            v = *reinterpret_cast<const float2*>(q + ((long long)(first + r) * h + head) * HD + c);
        *reinterpret_cast<__half2*>(sq + r * LD + c) = __floats2half2_rn(v.x, v.y);
    }
    const int qg = (t >> 3) * 4, kg = (t & 7) * 4, d0 = (t & 7) * DS;
    int qpos[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) qpos[a] = qg + a < count ? pos[first + qg + a] : -1;
    const int p_last = pos[first + count - 1];
    const int k_lo = window > 0 ? max(0, pos[first] - window + 1) : 0;
    const int k_first = ring_first(k_lo, offsets, first, ring);  // the row of position k_lo
    float o[4][DS], m[4], l[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = -1e30f;
        l[a] = 0.f;
#pragma unroll
        for (int d = 0; d < DS; ++d) o[a][d] = 0.f;
    }
    for (int kb = k_lo; kb <= p_last; kb += AT_KT) {
        __syncthreads();  // the previous chunk is used up (and the q tile staged)
        for (int i = t; i < AT_KT * HD / 8; i += blockDim.x) {
            const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (kb + r <= p_last) {
                const long long at = base + (long long)ring_row(k_first, kb + r - k_lo, ring) * row;
                kv = *reinterpret_cast<const uint4*>(kc + at + c);
                vv = *reinterpret_cast<const uint4*>(vc + at + c);
            }
            *reinterpret_cast<uint4*>(sk + r * LD + c) = kv;
            *reinterpret_cast<uint4*>(sv + r * LD + c) = vv;
        }
        __syncthreads();
        float s[4][4] = {};
#pragma unroll 2
        for (int c = 0; c < HD; c += 8) {
            float qf[4][8], kf[4][8];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                half8_to_float(*reinterpret_cast<const uint4*>(sq + (qg + a) * LD + c), qf[a]);
                half8_to_float(*reinterpret_cast<const uint4*>(sk + (kg + a) * LD + c), kf[a]);
            }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b)
#pragma unroll
                    for (int e = 0; e < 8; ++e) s[a][b] += qf[a][e] * kf[b][e];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            float m_new = m[a];
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int p = kb + kg + b;
                const bool seen = p <= qpos[a] && (window <= 0 || p > qpos[a] - window);
                const float score = softcap > 0.f ? softcap * tanhf(s[a][b] * scale / softcap)
                                                  : s[a][b] * scale;
                s[a][b] = seen ? score : AT_MASKED;
                m_new = fmaxf(m_new, s[a][b]);
            }
            for (int x = 1; x < 8; x <<= 1)
                m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, x));
            const float rescale = expf(m[a] - m_new);
            float sum = 0.f;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const float p = s[a][b] == AT_MASKED ? 0.f : expf(s[a][b] - m_new);
                sp[(qg + a) * (AT_KT + 1) + kg + b] = p;
                sum += p;
            }
            for (int x = 1; x < 8; x <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
            l[a] = l[a] * rescale + sum;
            m[a] = m_new;
#pragma unroll
            for (int d = 0; d < DS; ++d) o[a][d] *= rescale;
        }
        __syncthreads();
#pragma unroll 4
        for (int j = 0; j < AT_KT; ++j) {
            float pj[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) pj[a] = sp[(qg + a) * (AT_KT + 1) + j];
#pragma unroll
            for (int c = 0; c < DS; c += 8) {
                const uint4 va = *reinterpret_cast<const uint4*>(sv + j * LD + d0 + c);
                const __half2* v2 = reinterpret_cast<const __half2*>(&va);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 vf = __half22float2(v2[e]);
#pragma unroll
                    for (int a = 0; a < 4; ++a) {
                        o[a][c + 2 * e] += pj[a] * vf.x;
                        o[a][c + 2 * e + 1] += pj[a] * vf.y;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        if (qg + a >= count) continue;
        const float inv = 1.f / l[a];
        float* dst = out + ((long long)(first + qg + a) * h + head) * HD + d0;
#pragma unroll
        for (int d = 0; d < DS; d += 4)
            *reinterpret_cast<float4*>(dst + d) =
                make_float4(o[a][d] * inv, o[a][d + 1] * inv, o[a][d + 2] * inv, o[a][d + 3] * inv);
    }
}

#define ATTN_TILES(HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attn_tiles_##HD(                         \
        const float* __restrict__ q, const __half* __restrict__ kc,                            \
        const __half* __restrict__ vc, const int* __restrict__ pos,                            \
        const int* __restrict__ starts, const int2* __restrict__ tiles, float* __restrict__ out, \
        int h, int hk, float scale, int window, float softcap, const int* __restrict__ offsets,  \
        int ring) {                                                                            \
        attn_tiles_body<HD>(q, kc, vc, pos, starts, tiles, out, h, hk, scale, window, softcap,  \
                            offsets, ring);                                                    \
    }
ATTN_TILES(64)
ATTN_TILES(128)
ATTN_TILES(256)

// ---- attention for a few queries of one sequence (speculation's checking passes) ----------
// Block (head, split) takes every query of the pass (n <= AF_QN; the host knows them to be of one
// sequence: starts[0], offsets[0]) and walks its split's share of the span of their positions
// (the smallest window start .. the largest position) in chunks of AF_KT positions staged in
// shared memory: each chunk's K and V are read once for all the queries, where attn_split
// reads them once a query in n times its blocks (a 9-token pass: 2.9x a step's attention).
// Warp w takes queries 4w .. 4w + 3 (a warp with none only stages rows), lane j key j of a
// chunk: each fp16 key converted once serves its 4 queries, whose rows wait in shared memory
// as floats (fp16-rounded, as attn_split's); flash attention's online softmax across the
// lanes; lane j then holds dims j * HD / 32 .. of the 4 outputs, weighing each V row by the
// probability shuffled from its lane. Partial outputs are attn_split's (attn_few_merge merges
// them). Not attn_split's numbers bit for bit: for the passes whose products are not either.
#define AF_QN 16
#define AF_KT 32

// The span of attn_few's queries: the smallest window start lo .. the largest position hi,
// each split's share of it (whole chunks) and the splits that have rows (`active`).
struct AttnFewSpan {
    int lo, hi, share, active;
};

__device__ __forceinline__ AttnFewSpan attn_few_span(const int* __restrict__ pos, int n,
                                                     int window, int splits) {
    AttnFewSpan s;
    s.lo = 1 << 30;
    s.hi = -1;
    for (int i = 0; i < n; ++i) {
        s.lo = min(s.lo, window > 0 ? max(0, pos[i] - window + 1) : 0);
        s.hi = max(s.hi, pos[i]);
    }
    const int len = s.hi + 1 - s.lo;
    s.share = ((len + splits - 1) / splits + AF_KT - 1) / AF_KT * AF_KT;
    s.active = (len + s.share - 1) / s.share;
    return s;
}

template <int HD>
__device__ __forceinline__ void attn_few_body(
    const float* __restrict__ q, const __half* __restrict__ kc, const __half* __restrict__ vc,
    const int* __restrict__ pos, const int* __restrict__ starts, float* __restrict__ part_o,
    float2* __restrict__ part_ml, int h, int hk, int splits, float scale, int window,
    float softcap, const int* __restrict__ offsets, int ring, int n) {
    pdl_start();
    extern __shared__ __align__(16) unsigned char af_smem[];
    constexpr int LD = HD + 8;  // halves a staged row: 16 bytes apart on the banks
    constexpr int DL = HD / 32;  // output dimensions a lane
    float* sq = reinterpret_cast<float*>(af_smem);  // [AF_QN][HD]
    __half* sk = reinterpret_cast<__half*>(sq + AF_QN * HD);  // [AF_KT][LD]
    __half* sv = sk + AF_KT * LD;
    const int head = blockIdx.x, split = blockIdx.y, t = threadIdx.x;
    const int lane = t & 31, q0 = (t >> 5) * 4;
    const AttnFewSpan span = attn_few_span(pos, n, window, splits);
    if (split >= span.active) return;
    const int p0 = span.lo + split * span.share, p1 = min(p0 + span.share, span.hi + 1);
    const bool busy = q0 < n;  // (the same for the whole warp)
    int qpos[4], qlo[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        qpos[a] = q0 + a < n ? pos[q0 + a] : -1;
        qlo[a] = window > 0 ? qpos[a] - window + 1 : 0;
    }
    const int row = hk * HD;  // halves a cache row
    const long long base = (long long)starts[0] * row + (head / (h / hk)) * HD;
    const int off = ring > 0 ? offsets[0] : 0;
    // q rounded to fp16, as attn_split; every load of a thread issued before any store
    constexpr int QV = AF_QN * HD / 4 / 128;  // float4s a thread
    float4 qv[QV];
#pragma unroll
    for (int u = 0; u < QV; ++u) {
        const int i = (t + u * 128) * 4, r = i / HD;
        const float* src = q + ((long long)r * h + head) * HD + i - r * HD;
        qv[u] = r < n ? *reinterpret_cast<const float4*>(src) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < QV; ++u) {
        const float4 v = qv[u];
        *reinterpret_cast<float4*>(sq + (t + u * 128) * 4) =
            make_float4(__half2float(__float2half_rn(v.x)), __half2float(__float2half_rn(v.y)),
                        __half2float(__float2half_rn(v.z)), __half2float(__float2half_rn(v.w)));
    }
    float o[4][DL], m[4], l[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = -1e30f;
        l[a] = 0.f;
#pragma unroll
        for (int d = 0; d < DL; ++d) o[a][d] = 0.f;
    }
    for (int kb = p0; kb < p1; kb += AF_KT) {
        constexpr int KV = AF_KT * HD / 8 / 128;  // 8-half pieces of K (and V) a thread
        uint4 kv[KV], vv[KV];
#pragma unroll
        for (int u = 0; u < KV; ++u) {  // loads first, all in flight together
            const int i = t + u * 128, r = i / (HD / 8), c = (i % (HD / 8)) * 8;
            kv[u] = vv[u] = make_uint4(0, 0, 0, 0);
            if (kb + r < p1) {
                const int slot = ring > 0 ? (kb + r + off) % ring : kb + r;
                const long long at = base + (long long)slot * row + c;
                kv[u] = *reinterpret_cast<const uint4*>(kc + at);
                vv[u] = *reinterpret_cast<const uint4*>(vc + at);
            }
        }
        __syncthreads();  // the previous chunk is used up (and the q rows staged)
#pragma unroll
        for (int u = 0; u < KV; ++u) {
            const int i = t + u * 128, r = i / (HD / 8), c = (i % (HD / 8)) * 8;
            *reinterpret_cast<uint4*>(sk + r * LD + c) = kv[u];
            *reinterpret_cast<uint4*>(sv + r * LD + c) = vv[u];
        }
        __syncthreads();
        if (!busy) continue;
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int c = 0; c < HD; c += 8) {
            float kf[8];
            half8_to_float(*reinterpret_cast<const uint4*>(sk + lane * LD + c), kf);
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float4 x = *reinterpret_cast<const float4*>(sq + (q0 + a) * HD + c);
                const float4 y = *reinterpret_cast<const float4*>(sq + (q0 + a) * HD + c + 4);
                s[a] += x.x * kf[0] + x.y * kf[1] + x.z * kf[2] + x.w * kf[3] + y.x * kf[4] +
                        y.y * kf[5] + y.z * kf[6] + y.w * kf[7];
            }
        }
        const int p = kb + lane;
        float pr[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const bool seen = p < p1 && p <= qpos[a] && p >= qlo[a];
            const float score =
                softcap > 0.f ? softcap * tanhf(s[a] * scale / softcap) : s[a] * scale;
            const float m_new = fmaxf(m[a], warp_max(seen ? score : -1e30f));
            const float rescale = expf(m[a] - m_new);
            pr[a] = seen ? expf(score - m_new) : 0.f;
            float sum = pr[a];
            for (int x = 16; x > 0; x >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
            l[a] = l[a] * rescale + sum;
            m[a] = m_new;
#pragma unroll
            for (int d = 0; d < DL; ++d) o[a][d] *= rescale;
        }
#pragma unroll 4
        for (int j = 0; j < AF_KT; ++j) {
            float vf[DL];
            const __half2* v2 = reinterpret_cast<const __half2*>(sv + j * LD + lane * DL);
#pragma unroll
            for (int e = 0; e < DL / 2; ++e) {
                const float2 f = __half22float2(v2[e]);
                vf[2 * e] = f.x;
                vf[2 * e + 1] = f.y;
            }
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float pj = __shfl_sync(0xffffffffu, pr[a], j);
#pragma unroll
                for (int d = 0; d < DL; ++d) o[a][d] += pj * vf[d];
            }
        }
    }
    if (!busy) return;
#pragma unroll
    for (int a = 0; a < 4; ++a) {  // this split's part of each output, unnormalised
        if (q0 + a >= n) break;
        const long long part = ((long long)(q0 + a) * h + head) * splits + split;
#pragma unroll
        for (int d = 0; d < DL; ++d) part_o[part * HD + lane * DL + d] = o[a][d];
        if (lane == 0) part_ml[part] = make_float2(m[a], l[a]);
    }
}

// The splits' merge after attn_few: block (head, query), merge_splits' work. A launch of its
// own: with tickets, the block that finished last for one query did for all of them (their
// tickets fall together), n merges one after another.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_few_merge(const float* __restrict__ part_o, const float2* __restrict__ part_ml,
                   int* __restrict__ tickets, float* __restrict__ out,
                   const int* __restrict__ pos, int h, int hd, int splits,
                   signed char* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs,
                   int tiled, int window, int n) {
    pdl_start();
    __shared__ float scratch[32];
    const AttnFewSpan sp = attn_few_span(pos, n, window, splits);
    merge_splits(part_o, part_ml, tickets, out, blockIdx.y * h + blockIdx.x, hd, splits,
                 sp.active, scratch, h, xq, xd, xs, tiled);
}

#define ATTN_FEW(HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_few_##HD(                           \
        const float* __restrict__ q, const __half* __restrict__ kc,                            \
        const __half* __restrict__ vc, const int* __restrict__ pos,                            \
        const int* __restrict__ starts, float* __restrict__ part_o,                            \
        float2* __restrict__ part_ml, int h, int hk, int splits, float scale, int window,      \
        float softcap, const int* __restrict__ offsets, int ring, int n) {                     \
        attn_few_body<HD>(q, kc, vc, pos, starts, part_o, part_ml, h, hk, splits, scale,       \
                          window, softcap, offsets, ring, n);                                  \
    }
ATTN_FEW(64)
ATTN_FEW(128)
ATTN_FEW(256)
