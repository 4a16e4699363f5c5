// Decoding of the packed palette formats (docs/format.md) straight into mma.m16n8k16 A-fragment
// registers, plus the small PTX helpers the kernels share. Header-only, no PyTorch headers, so
// every .cu compiles standalone with nvcc (CI compile-checks them that way).
//
// A tile is 256·bits bits = W int32 words (W = 8·bits). Lane ℓ of a warp owns tile positions
// 8ℓ..8ℓ+7 = its four A registers; its bits start at stream bit ℓ·W for every family:
//   pair codes (VQ-c/2 and NUQ-b≤5 read as 2b-bit pair codes): 4 codes of c bits;
//   scalar codes (NUQ-6..8): 8 codes of b bits;
//   TCQ (KV bits a step): 4 steps, the 16-bit state windows at ℓ·W + k·KV (circular in the tile).
// Values come from a table in shared memory replicated C times (entry e, copy ℓ mod C at word
// e·C + ℓ mod C) so the 32 lanes of a warp never hit the same bank with different addresses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace qp {

// Table of 2^LOG2E 32-bit entries replicated into at most 64 KB (16384 words).
template <int LOG2E>
struct LutGeom {
  static constexpr int LOGC = (14 - LOG2E) < 5 ? (14 - LOG2E) : 5;
  static constexpr int C = 1 << LOGC;
  static constexpr int E = 1 << LOG2E;
  static constexpr int WORDS = E * C;
  static constexpr int ESHIFT = 2 + LOGC;  // byte offset of entry e = e << ESHIFT
};

// Bits [pos, pos+len) of the 64-bit MSB-first word pair (a:b), moved so that the field starts at
// bit `shl` of the result; bits above the field are garbage (callers mask). All arguments are
// compile-time constants after unrolling, so this is one shift/funnel-shift instruction.
__device__ __forceinline__ uint32_t field(uint32_t a, uint32_t b, int pos, int len, int shl) {
  const int r = 64 - pos - len - shl;
  const uint64_t v = (static_cast<uint64_t>(a) << 32) | b;
  return r >= 0 ? static_cast<uint32_t>(v >> r) : static_cast<uint32_t>(v << (-r));
}

// How many consecutive words a lane must read (max over lanes) for `span` bits from ℓ·W.
__host__ __device__ constexpr int lane_words(int w, int span) {
  int most = 1;
  for (int l = 0; l < 32; ++l) {
    const int o = (l * w) & 31;
    const int n = (o + span + 31) / 32;
    most = n > most ? n : most;
  }
  return most;
}

__device__ __forceinline__ uint32_t lds_byte(const uint32_t* lut, uint32_t byte_off) {
  return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut) + byte_off);
}

// ---- decoders -------------------------------------------------------------------------------
// Each has: W (words a tile), SPAN (bits a lane reads), LOG2E (table entries), and
// decode(a, b, lut, lanebits, r): (a:b) = the lane's bits, MSB-aligned; r = 4 A registers.

template <int CB>  // pair codes of CB bits (VQ with CB = 2·bits; NUQ-b with CB = 2b)
struct PairDec {
  static constexpr int W = 4 * CB;
  static constexpr int SPAN = 4 * CB;
  static constexpr int LOG2E = CB;
  using G = LutGeom<LOG2E>;
  __device__ __forceinline__ static void decode(uint32_t a, uint32_t b, const uint32_t* lut,
                                                uint32_t lanebits, uint32_t (&r)[4]) {
    constexpr uint32_t MASK = (uint32_t(G::E) - 1) << G::ESHIFT;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t f = field(a, b, k * CB, CB, G::ESHIFT);
      r[k] = lds_byte(lut, (f & MASK) | lanebits);
    }
  }
};

template <int B>  // scalar codes of B bits, two lookups a pair (NUQ-6..8)
struct ScalarDec {
  static constexpr int W = 8 * B;
  static constexpr int SPAN = 8 * B;
  static constexpr int LOG2E = B;
  using G = LutGeom<LOG2E>;
  __device__ __forceinline__ static void decode(uint32_t a, uint32_t b, const uint32_t* lut,
                                                uint32_t lanebits, uint32_t (&r)[4]) {
    constexpr uint32_t MASK = (uint32_t(G::E) - 1) << G::ESHIFT;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t f0 = field(a, b, 2 * k * B, B, G::ESHIFT);
      const uint32_t f1 = field(a, b, (2 * k + 1) * B, B, G::ESHIFT);
      const uint32_t v0 = lds_byte(lut, (f0 & MASK) | lanebits);
      const uint32_t v1 = lds_byte(lut, (f1 & MASK) | lanebits);
      r[k] = __byte_perm(v0, v1, 0x5410);  // low half of v0, low half of v1
    }
  }
};

template <int KV, int Q>  // TCQ, KV bits a step, hybrid table of 2^Q pairs
struct TcqDec {
  static constexpr int W = 4 * KV;
  static constexpr int SPAN = 3 * KV + 16;
  static constexpr int LOG2E = Q;
  using G = LutGeom<LOG2E>;
  __device__ __forceinline__ static void decode(uint32_t a, uint32_t b, const uint32_t* lut,
                                                uint32_t lanebits, uint32_t (&r)[4]) {
    // idx = (h >> (15 − Q)) & (2^Q − 1) at byte offset idx << ESHIFT: shift h by SH.
    constexpr int SH = G::ESHIFT - (15 - Q);
    constexpr uint32_t MASK = (uint32_t(G::E) - 1) << G::ESHIFT;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t s = field(a, b, k * KV, 16, 0);  // state in bits 0..15 (+ garbage above)
      const uint32_t h = s * s + s;                  // low 16 bits = s(s+1) mod 2^16
      const uint32_t f = SH >= 0 ? (h << (SH >= 0 ? SH : 0)) : (h >> (SH < 0 ? -SH : 0));
      r[k] = lds_byte(lut, (f & MASK) | lanebits) ^ (h & 0x8000u);  // bit 15 flips x's sign
    }
  }
};

// Per-lane constants for reading a tile's words: first word, bit offset, lane's table copy.
template <class D>
struct LaneGeom {
  static constexpr int NWORDS = lane_words(D::W, D::SPAN);
  int off[NWORDS];
  uint32_t o;
  uint32_t lanebits;
  __device__ __forceinline__ explicit LaneGeom(int lane) {
    const int start = lane * D::W;
    o = static_cast<uint32_t>(start & 31);
#pragma unroll
    for (int i = 0; i < NWORDS; ++i) off[i] = ((start >> 5) + i) % D::W;
    lanebits = static_cast<uint32_t>(lane & (D::G::C - 1)) << 2;
  }
  // words w[0..NWORDS) → MSB-aligned (a:b)
  __device__ __forceinline__ void align(const uint32_t (&w)[NWORDS], uint32_t& a, uint32_t& b) const {
    if constexpr (NWORDS == 1) {
      a = w[0] << o;
      b = 0;
    } else if constexpr (NWORDS == 2) {
      a = __funnelshift_l(w[1], w[0], o);
      b = w[1] << o;
    } else {
      a = __funnelshift_l(w[1], w[0], o);
      b = __funnelshift_l(w[2], w[1], o);
    }
  }
};

// ---- activations and the tensor-core product --------------------------------------------------

template <class T>
struct Act;
template <>
struct Act<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Act<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace qp
