// The power-of-two Walsh–Hadamard transform of one row held 8 elements a thread, shared by the
// standalone rotation kernel (hadamard.cu) and the GEMV's fused rotation (qpalette_gemv.cuh).
//
// n = 2^p points (p = 3..12), thread t < n/8 of the row's threads holding elements 8t..8t+7 in
// fp32: index bits 0-2 are butterflies in registers, bits 3-7 butterflies between lanes
// (shuffles); bits 8.. (n > 256) go through one transpose in shared memory z (n floats): thread t
// then holds 8 elements whose bits 8..10 vary (n = 4096: bit 11 between lanes t and t ^ 1).
// Sylvester order, the same numbers as the reference's butterflies up to fp32 rounding. Several
// rows (segments) can be transformed at once by consecutive groups of n/8 threads, each with its
// own z and out: t is the thread's index inside its group, and groups start at multiples of n/8
// lanes (so shuffles stay inside a group). Every thread of the block calls it (one barrier when
// n > 256); inactive threads hold zeros and write nothing.
// Also shared: forming a row's input (silu(gate) ⊙ up, RMSNorm, signs) and H_K's mix of a row's K
// segments (n = K·2^m), on the tensor cores where it fits (mix_segments_mma).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "qpalette_mma.cuh"

namespace qp {

template <class T>
struct Cvt;
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

__device__ __forceinline__ void butterflies_in_registers(float (&v)[8], int levels) {
#pragma unroll
  for (int l = 0; l < 3; ++l)
    if (l < levels)
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (!(k & (1 << l))) {
          const float a = v[k], c = v[k | (1 << l)];
          v[k] = a + c;
          v[k | (1 << l)] = a - c;
        }
}

__device__ __forceinline__ void butterflies_between_lanes(float (&v)[8], int lane_mask) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float o = __shfl_xor_sync(0xffffffffu, v[k], lane_mask);
    v[k] = lane & lane_mask ? o - v[k] : v[k] + o;
  }
}

// phase-2 element of thread t, register k (r = p − 8 transposed bits)
__device__ __forceinline__ int phase2_index(int t, int k, int r) {
  if (r == 4) return (k << 8) | ((t & 1) << 11) | (t >> 1);
  return ((k & ((1 << r) - 1)) << 8) | (k >> r) | (t << (3 - r));
}

// v (this thread's 8 elements, signs applied) → out[0..n) = scale · H_n v, rounded to T.
template <class T>
__device__ __forceinline__ void fwht_row(float (&v)[8], int log2n, float scale, float* z, T* out, int t,
                                         bool active) {
  const int r = log2n - 8;
  butterflies_in_registers(v, 3);
  for (int b = 3; b < log2n && b < 8; ++b) butterflies_between_lanes(v, 1 << (b - 3));
  if (r <= 0) {
    if (active) {
      T o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = Cvt<T>::from_float(v[k] * scale);
      *reinterpret_cast<uint4*>(out + 8 * t) = *reinterpret_cast<const uint4*>(o);
    }
    return;
  }
  if (active) {
    reinterpret_cast<float4*>(z)[2 * t] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(z)[2 * t + 1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = active ? z[phase2_index(t, k, r)] : 0.f;
  butterflies_in_registers(v, r < 3 ? r : 3);
  if (r == 4) butterflies_between_lanes(v, 1);
  if (active)
#pragma unroll
    for (int k = 0; k < 8; ++k) out[phase2_index(t, k, r)] = Cvt<T>::from_float(v[k] * scale);
}

// f(a_k, b_k) over the 8 elements of two 16-byte chunks, in fp32, each result rounded to T once
template <class T, class F>
__device__ __forceinline__ uint4 map_chunks(const uint4& a, const uint4& b, F f) {
  const T* ae = reinterpret_cast<const T*>(&a);
  const T* be = reinterpret_cast<const T*>(&b);
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = Cvt<T>::from_float(f(Cvt<T>::to_float(ae[k]), Cvt<T>::to_float(be[k])));
  return out;
}

// silu(g) ⊙ u, rounded once (a gated MLP's down-projection input). __fdividef (reciprocal + multiply,
// 2 ulp; 0 for a denominator past 2^126, silu's limit there): an IEEE division is a branch region an
// element that serializes the chains, and a K-split down's CTA forms all 14336 products (2.0 µs of
// its staging on an H200, results/kernels_h200/v20/).
template <class T>
__device__ __forceinline__ uint4 silu_mul(const uint4& g, const uint4& u) {
  return map_chunks<T>(g, u, [](float a, float b) { return __fdividef(a, 1.f + __expf(-a)) * b; });
}

// a + b, each sum rounded to T (a residual add, as torch computes it)
template <class T>
__device__ __forceinline__ uint4 add_chunks(const uint4& a, const uint4& b) {
  return map_chunks<T>(a, b, [](float x, float y) { return x + y; });
}

// Σ h² of a chunk's 8 elements in fp32
template <class T>
__device__ __forceinline__ float sum_squares(const uint4& h) {
  const T* e = reinterpret_cast<const T*>(&h);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += Cvt<T>::to_float(e[k]) * Cvt<T>::to_float(e[k]);
  return s;
}

// LlamaRMSNorm's arithmetic on a chunk: w ⊙ T(h · r), r = rsqrt(mean h² + eps), rounded to T twice
template <class T>
__device__ __forceinline__ uint4 rms_scaled(const uint4& h, const uint4& w, float r) {
  return map_chunks<T>(h, w, [r](float x, float wk) { return wk * Cvt<T>::to_float(Cvt<T>::from_float(x * r)); });
}

// v summed over the block, in a fixed order (warp shuffles, then the warps' sums from `part`, one
// float a warp); every thread calls it, one barrier
__device__ __forceinline__ float block_sum(float v, float* part) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += part[w];
  return s;
}

// LlamaRMSNorm of the block's row, chunk `h` of it (n elements over the block; inactive threads hold
// none): w ⊙ T(h · rsqrt(mean h² + eps)). The GEMV's batch-1 staging and the rotation kernel at batch
// 2–8 both call it, so the two paths round alike. Every thread calls it (block_sum: one barrier).
template <class T>
__device__ __forceinline__ uint4 rms_normed_chunk(const uint4& h, const uint4& w, bool active, int n, float eps,
                                                  float* part) {
  const float ss = block_sum(active ? sum_squares<T>(h) : 0.f, part);
  return rms_scaled<T>(h, w, rsqrtf(ss / static_cast<float>(n) + eps));
}

// the 8 elements of a 16-byte chunk, sign byte `sb` applied (bit 7 − k set ⇔ element k negated)
template <class T>
__device__ __forceinline__ void signed_chunk(const uint4& raw, uint32_t sb, float (&v)[8]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = (sb >> (7 - k)) & 1u ? -Cvt<T>::to_float(e[k]) : Cvt<T>::to_float(e[k]);
}

// the 16-byte chunk `raw` of 8 16-bit floats with sign byte `sb` applied (bit 7 − k set ⇔ element k
// negated) by flipping sign bits: exact, and no conversion where the result stays 16-bit
__device__ __forceinline__ uint4 sign_flipped(uint4 raw, uint32_t sb) {
  // word w holds elements 2w (sign bit 15) and 2w + 1 (sign bit 31): sb's bits 7 − 2w and 6 − 2w
  const auto mask = [sb](int w) {
    const uint32_t b = sb >> (6 - 2 * w);
    return (b & 2u) << 14 | b << 31;
  };
  raw.x ^= mask(0);
  raw.y ^= mask(1);
  raw.z ^= mask(2);
  raw.w ^= mask(3);
  return raw;
}

// v += the 8 elements of a 16-byte chunk, in fp32
template <class T>
__device__ __forceinline__ void add_chunk(float (&v)[8], const uint4& raw) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] += Cvt<T>::to_float(e[k]);
}

// A row of K segments of 2^m (chunks of 8 elements), signs applied (exact), into shared memory `raw` in
// the activation dtype for a K-term mix: GATED reads [gate | up] and stages silu(gate) ⊙ up. U chunks a
// thread in flight (GATED: two loads each, so U = 4 holds as many registers as the plain U = 8). log2q ≥ 0:
// chunk c of segment c >> log2q at swizzled_piece (2^log2q chunks a segment), the layout mix_segments_mma
// reads; −1: unswizzled, for the scalar mix.
template <class T, int U, bool GATED>
__device__ __forceinline__ void stage_signed_row(const T* row, const uint8_t* signs, int chunks, T* raw, int log2q) {
  const uint4* xr = reinterpret_cast<const uint4*>(row);
  for (int base = threadIdx.x; base < chunks; base += U * blockDim.x) {
    uint4 v[U], up[GATED ? U : 1];
    uint32_t sb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * blockDim.x;
      v[u] = c < chunks ? __ldg(xr + c) : make_uint4(0, 0, 0, 0);
      if constexpr (GATED) up[u] = c < chunks ? __ldg(xr + chunks + c) : make_uint4(0, 0, 0, 0);
      sb[u] = c < chunks ? __ldg(signs + c) : 0u;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * blockDim.x;
      if (c < chunks) {
        if constexpr (GATED) v[u] = silu_mul<T>(v[u], up[u]);
        const int at = log2q >= 0 ? swizzled_piece(c >> log2q, c & ((1 << log2q) - 1), 1 << log2q) : c;
        reinterpret_cast<uint4*>(raw)[at] = sign_flipped(v[u], sb[u]);
      }
    }
  }
}

// ---- H_K's mix on the tensor cores (the GEMV's staging and hadamard_gated_mma_kernel) -------------
// Segments s < segs of (H_K ⊗ I) r for a block's rows of H_K, r the staged row (stage_signed_row,
// swizzled): one mma.m16n8k16 per 8 columns and 16 terms, A = the rows of H_K (±1, 0 past K or segs:
// exact in either 16-bit type), B = r through ldmatrix (the swizzle puts the 8 segments of an 8×8
// matrix in different banks). Fits when K ≤ 32, segs ≤ 16, 2^m ≥ 64 and each warp holds at most
// MIX_TILES tiles of 8 columns (their sums cross one barrier). A thread's scalar mix took ~25
// instructions a term, 28 terms for down's 28·512 (results/kernels_h200/v20/).
constexpr int MIX_TILES = 5;
__host__ __device__ constexpr bool mix_fits_tensor_cores(int k, int segs, int log2p2, int warps) {
  return k <= 32 && segs <= 16 && log2p2 >= 6 && (1 << (log2p2 - 3)) <= MIX_TILES * warps;
}

template <class T>
struct PlusOne;
template <>
struct PlusOne<__half> {
  static constexpr uint32_t bits = 0x3C00u;
};
template <>
struct PlusOne<__nv_bfloat16> {
  static constexpr uint32_t bits = 0x3F80u;
};

// entries c and c + 1 of an H_K row (bit a of neg: −1; 0 at or past k) as one register of two T
template <class T>
__device__ __forceinline__ uint32_t hk_pair(uint64_t neg, int c, int k) {
  const auto e = [&](int a) { return a < k ? PlusOne<T>::bits | (static_cast<uint32_t>(neg >> a) & 1u) << 15 : 0u; };
  return e(c) | e(c + 1) << 16;
}

// v ← chunk t of segment jj (active threads) of the mix. z holds the staged row and then the sums (rows of
// 2^m + 8 floats: a warp's float2 stores meet no bank twice); hka, hkb: rows g and g + 8 of the block's
// H_K rows as −1 bits, g = lane / 4 (0 past segs). Every thread calls it (two barriers).
template <class T>
__device__ __forceinline__ void mix_segments_mma(float* z, uint64_t hka, uint64_t hkb, int k, int segs, int log2p2,
                                                 float (&v)[8], bool active, int jj, int t) {
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int tiles = 1 << (log2p2 - 3), zs = (1 << log2p2) + 8;
  const int ka = g < segs ? k : 0, kb = g + 8 < segs ? k : 0;
  uint32_t a0[4], a1[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = 16 * h + 2 * tq;
    uint32_t(&a)[4] = h ? a1 : a0;
    a[0] = hk_pair<T>(hka, c, ka);
    a[1] = hk_pair<T>(hkb, c, kb);
    a[2] = hk_pair<T>(hka, c + 8, ka);
    a[3] = hk_pair<T>(hkb, c + 8, kb);
  }
  // lane l addresses row l (term l) of the four 8×8 matrices: terms 0–15, then 16–31; rows past K
  // read term 0 (finite) against A's zeros
  const int term = lane < k ? lane : 0;
  const uint4* staged = reinterpret_cast<const uint4*>(z);
  float c[MIX_TILES][4];
#pragma unroll
  for (int i = 0; i < MIX_TILES; ++i) {
    c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    const int nt = warp + i * warps;
    if (nt < tiles) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, staged + swizzled_piece(term, nt, tiles));
      mma_16816<T>(c[i], a0, b[0], b[1]);
      if (k > 16) mma_16816<T>(c[i], a1, b[2], b[3]);
    }
  }
  __syncthreads();  // every warp has read the staged row: z takes the sums
#pragma unroll
  for (int i = 0; i < MIX_TILES; ++i) {
    const int nt = warp + i * warps, col = 8 * nt + 2 * tq;
    if (nt < tiles && g < segs) *reinterpret_cast<float2*>(z + g * zs + col) = make_float2(c[i][0], c[i][1]);
    if (nt < tiles && g + 8 < segs) *reinterpret_cast<float2*>(z + (g + 8) * zs + col) = make_float2(c[i][2], c[i][3]);
  }
  __syncthreads();
  if (active) {
    const float4* src = reinterpret_cast<const float4*>(z + jj * zs + 8 * t);
    const float4 lo = src[0], hi = src[1];
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
  }
}

// v += Σ_a H_K[seg, a] (s ⊙ x)[a·2^m + 8t + ·] over a = a0, a0 + step, … < K (hk: K·K ±1, unused
// when K = 1): chunk t of segment seg of (H_K ⊗ I) (s ⊙ x), before the 2^m-point transform.
// GATED: x is a gated MLP's [gate | up] (2n wide) and the input is silu(gate) ⊙ up (silu_mul).
template <class T, bool GATED = false>
__device__ __forceinline__ void mix_segments(float (&v)[8], const T* x, const uint8_t* signs, const int8_t* hk,
                                             int k, int log2p2, int seg, int t, int a0, int step) {
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const int up = (k << log2p2) >> 3;  // chunks from a gate chunk to its up chunk
#pragma unroll 4
  for (int a = a0; a < k; a += step) {
    const int chunk = ((a << log2p2) >> 3) + t;
    uint4 raw = __ldg(x4 + chunk);
    if constexpr (GATED) raw = silu_mul<T>(raw, __ldg(x4 + up + chunk));
    float w[8];
    signed_chunk<T>(raw, __ldg(signs + chunk), w);
    const bool neg = k > 1 && __ldg(hk + seg * k + a) < 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] += neg ? -w[e] : w[e];
  }
}

}  // namespace qp
