// Weight formats as the CUDA kernels read them: GGUF blocks repacked at load time into planes
// (backends/cuda/weights.py), all in groups of 32 weights.
//
// Plane layouts, per row of K weights (G = K / 32 groups, S = K / 256 super-blocks):
//   qs   u8  [G][16]  4-bit formats: byte i holds weight i (low nibble) and weight i+16 (high)
//   q8   i8  [G][32]  Q8_0
//   qh   u32 [G]      Q5_0/Q5_1/Q5_K: bit i = fifth bit of weight i
//   qh2  u32 [G][2]   Q6_K: two bits per weight, weights 0..15 in word 0, 16..31 in word 1
//   d, m f16 [G]      32-block scale and min (Q4_0 ... Q8_0)
//   sc, mn u8 [G]     Q4_K/Q5_K 6-bit sub-block scale and min;  Q6_K: sc i8 [G][2] (per 16)
//   D, DM f16 [S]     K-quant super-block scale and min scale
//
// Each format gives a group as int8x4 "quads": lo[t] = weights 4t..4t+3, hi[t] = weights
// 16+4t..16+4t+3 (t < 4), and its scales such that the group's dot product with an 8-bit
// activation group (xq, xd, xs) is
//     xd * (s_lo * dot(lo, xq_lo) + s_hi * dot(hi, xq_hi)) + m * xs.
// xs is the activation format's sum term: Q8_1's s, or xd * sum(xq) for Q8_K.
#pragma once
#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned char u8;

struct Planes {
    const void* p[6];
};
// Kernels take the planes as six pointers (unused ones repeat plane 0) and gather them.
#define PLANE_ARGS                                                                           \
    const void *__restrict__ p0, const void *__restrict__ p1, const void *__restrict__ p2,   \
        const void *__restrict__ p3, const void *__restrict__ p4, const void *__restrict__ p5
#define PLANES {{p0, p1, p2, p3, p4, p5}}

__device__ __forceinline__ float h2f(const void* p, long long i) {
    return __half2float(reinterpret_cast<const __half*>(p)[i]);
}

// 4 bits b0..b3 -> bit 4 of bytes 0..3
__device__ __forceinline__ u32 spread_bits(u32 b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// 4 two-bit fields -> bits 4..5 of bytes 0..3
__device__ __forceinline__ u32 spread_pairs(u32 b) {
    return ((b & 0x03u) << 4) | ((b & 0x0Cu) << 10) | ((b & 0x30u) << 16) | ((b & 0xC0u) << 22);
}

// q - bias in each byte (as int8), for bytes q <= 127 + bias: offset by 128 - bias, which
// carries out of no byte, then the top bits flipped (vsub4 takes several instructions).
__device__ __forceinline__ int minus_bytes(u32 q, u32 bias) {
    return (int)((q + (0x80u - bias) * 0x01010101u) ^ 0x80808080u);
}

// Entry k (1 to 5) of a format's bytes per group of planes 1..5; 0 past its last plane.
__host__ __device__ constexpr int plane_entry(int k, int b1, int b2 = 0, int b3 = 0, int b4 = 0,
                                              int b5 = 0) {
    return k == 1 ? b1 : k == 2 ? b2 : k == 3 ? b3 : k == 4 ? b4 : k == 5 ? b5 : 0;
}

struct GroupScale {
    float s_lo, s_hi, m;
};

// A format gives, for group rg (= row * G + g): its raw words, its extra high bits, how quad t
// decodes from them, and its scales (rs = row * S + g / 8 indexes super-block planes).
//   qbytes: bytes of plane 0 per group (16 for 4-bit formats, 32 for Q8_0)
//   plane_bytes(k): bytes per group of plane k >= 1, negative for a per-super-block plane
//   decode(wa, wb, e0, e1, t): wa = word t of the group's plane-0 bytes, wb = word 4 + t

// ---- 32-weight block formats -------------------------------------------------------------

// act_k: activation scale per 32 (0) or per 256 (1); has_min: m is not 0;
// split: s_lo != s_hi (the tensor-core path then runs the two halves apart)
struct FmtQ4_0 {  // planes: qs, d
    static constexpr int act_k = 0, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) { return plane_entry(k, 2); }
    static constexpr bool has_min = false, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {}
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        lo = minus_bytes(wa & 0x0F0F0F0Fu, 8);
        hi = minus_bytes((wa >> 4) & 0x0F0F0F0Fu, 8);
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        float d = h2f(P.p[1], rg);
        return {d, d, 0.f};
    }
};

struct FmtQ4_1 {  // planes: qs, d, m
    static constexpr int act_k = 0, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) { return plane_entry(k, 2, 2); }
    static constexpr bool has_min = true, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {}
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        lo = wa & 0x0F0F0F0Fu;
        hi = (wa >> 4) & 0x0F0F0F0Fu;
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        float d = h2f(P.p[1], rg);
        return {d, d, h2f(P.p[2], rg)};
    }
};

struct FmtQ5_0 {  // planes: qs, d, qh
    static constexpr int act_k = 0, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) { return plane_entry(k, 2, 4); }
    static constexpr bool has_min = false, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {
        e0 = reinterpret_cast<const u32*>(P.p[2])[rg];
    }
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        lo = minus_bytes((wa & 0x0F0F0F0Fu) | spread_bits(e0 >> (4 * t)), 16);
        hi = minus_bytes(((wa >> 4) & 0x0F0F0F0Fu) | spread_bits(e0 >> (16 + 4 * t)), 16);
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        return FmtQ4_0::scale(P, rg, rs);
    }
};

struct FmtQ5_1 {  // planes: qs, d, m, qh
    static constexpr int act_k = 0, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) { return plane_entry(k, 2, 2, 4); }
    static constexpr bool has_min = true, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {
        e0 = reinterpret_cast<const u32*>(P.p[3])[rg];
    }
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        lo = (wa & 0x0F0F0F0Fu) | spread_bits(e0 >> (4 * t));
        hi = ((wa >> 4) & 0x0F0F0F0Fu) | spread_bits(e0 >> (16 + 4 * t));
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        return FmtQ4_1::scale(P, rg, rs);
    }
};

struct FmtQ8_0 {  // planes: q8, d
    static constexpr int act_k = 0, qbytes = 32;
    __host__ __device__ static constexpr int plane_bytes(int k) { return plane_entry(k, 2); }
    static constexpr bool has_min = false, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {}
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        lo = (int)wa;
        hi = (int)wb;
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        return FmtQ4_0::scale(P, rg, rs);
    }
};

// ---- K-quants (super-blocks of 256 = 8 groups) -------------------------------------------

struct FmtQ4_K {  // planes: qs, sc, mn, D, DM
    static constexpr int act_k = 1, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) {
        return plane_entry(k, 1, 1, -2, -2);
    }
    static constexpr bool has_min = true, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {}
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        FmtQ4_1::decode(wa, wb, e0, e1, t, lo, hi);
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        float s = h2f(P.p[3], rs) * reinterpret_cast<const u8*>(P.p[1])[rg];
        return {s, s, -(h2f(P.p[4], rs) * reinterpret_cast<const u8*>(P.p[2])[rg])};
    }
};

struct FmtQ5_K {  // planes: qs, sc, mn, D, DM, qh
    static constexpr int act_k = 1, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) {
        return plane_entry(k, 1, 1, -2, -2, 4);
    }
    static constexpr bool has_min = true, split = false;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {
        e0 = reinterpret_cast<const u32*>(P.p[5])[rg];
    }
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        FmtQ5_1::decode(wa, wb, e0, e1, t, lo, hi);
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        return FmtQ4_K::scale(P, rg, rs);
    }
};

struct FmtQ6_K {  // planes: qs, sc (i8 [G][2], per 16 weights), D, qh2
    static constexpr int act_k = 1, qbytes = 16;
    __host__ __device__ static constexpr int plane_bytes(int k) { return plane_entry(k, 2, -2, 8); }
    static constexpr bool has_min = false, split = true;
    __device__ static void extra(const Planes& P, long long rg, u32& e0, u32& e1) {
        uint2 h = reinterpret_cast<const uint2*>(P.p[3])[rg];
        e0 = h.x;
        e1 = h.y;
    }
    __device__ static void decode(u32 wa, u32 wb, u32 e0, u32 e1, int t, int& lo, int& hi) {
        lo = minus_bytes((wa & 0x0F0F0F0Fu) | spread_pairs(e0 >> (8 * t)), 32);
        hi = minus_bytes(((wa >> 4) & 0x0F0F0F0Fu) | spread_pairs(e1 >> (8 * t)), 32);
    }
    __device__ static GroupScale scale(const Planes& P, long long rg, long long rs) {
        const signed char* sc = reinterpret_cast<const signed char*>(P.p[1]) + rg * 2;
        float D = h2f(P.p[2], rs);
        return {D * sc[0], D * sc[1], 0.f};
    }
};

// Quad t of group rg, loading only the words it needs (the tensor-core path).
template <class F>
__device__ __forceinline__ void load_quad(const Planes& P, long long rg, int t, int& lo, int& hi) {
    const u32* w = reinterpret_cast<const u32*>(P.p[0]) + rg * (F::qbytes / 4);
    u32 e0 = 0, e1 = 0;
    F::extra(P, rg, e0, e1);
    F::decode(w[t], F::qbytes == 32 ? w[4 + t] : 0u, e0, e1, t, lo, hi);
}

// The weight itself, for embedding rows; rounding as the NumPy reference dequantizes.
template <class F>
__device__ float weight_value(const Planes& P, long long row, int G, int k) {
    int g = k >> 5, i = k & 31;
    long long rg = row * G + g, rs = row * (G >> 3) + (g >> 3);
    int lo, hi;
    load_quad<F>(P, rg, (i & 15) >> 2, lo, hi);
    int q = (int)(signed char)(((i < 16 ? lo : hi) >> (8 * (i & 3))) & 0xFF);
    GroupScale s = F::scale(P, rg, rs);
    float scale = i < 16 ? s.s_lo : s.s_hi;
    return __fadd_rn(__fmul_rn(scale, (float)q), s.m);
}
