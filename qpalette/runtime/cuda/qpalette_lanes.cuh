// The lane-major code layout (qpalette/runtime/lanes.py) and the decoders that turn one lane's
// words into mma.m16n8k16 A-fragment registers. Host + device code, so a host test can emulate a
// warp on the same source (tests/runtime/lanes_emulator.cpp); no PyTorch headers.
//
// A group is 8 tiles of one row tile. Lane ℓ holds WPG = W/4 words of it: its own W bits of each
// tile (tile stream bits ℓ·W .. ℓ·W + W), tile 0 first, MSB first (TCQ with KV = 6: those bytes
// reordered, lanes.KV6_BYTES). TCQ windows that run past a lane's own bits continue in lane ℓ+1's
// (lane 31 → lane 0: the tail-biting wrap); the kernel passes those words in `nb`, fetched by one
// shuffle a word.
//
// Tables live in shared memory, entry e's copy c at word e·STRIDE + c (C copies, lane ℓ reads copy
// ℓ mod C, so a warp's lookups never conflict while C = 32; STRIDE = C but for byte-addressed
// tables). TCQ tables are sign-folded: entries 2^Q..2^(Q+1)-1 hold the first 2^Q with x negated,
// so bit 15 of the hash selects the entry.
#pragma once

#include <stdint.h>

#include <type_traits>

#ifdef __CUDACC__
#define QP_HD __host__ __device__ __forceinline__
#else
#define QP_HD inline
#endif

namespace qp {

constexpr int GROUP_TILES = 8;
constexpr int LUT_MAX_WORDS = 32768;  // 128 KB

QP_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
#endif
}

// Bits [pos, pos+len) of the MSB-first stream (a:b), moved to start at bit `shl`; bits outside
// the field are garbage. Constant arguments after unrolling: one funnel shift.
QP_HD uint32_t field(uint32_t a, uint32_t b, int pos, int len, int shl) {
  const int r = 64 - pos - len - shl;
  const uint64_t v = (static_cast<uint64_t>(a) << 32) | b;
  return r >= 0 ? static_cast<uint32_t>(v >> r) : static_cast<uint32_t>(v << (-r));
}

// the top 32 bits of (hi:lo) << n, 0 < n < 32: one funnel shift
QP_HD uint32_t funnel_l(uint32_t lo, uint32_t hi, int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, n);
#else
  return (hi << n) | (lo >> (32 - n));
#endif
}

// `field` over a lane's WPG words (words past the end read as 0).
template <int WPG>
QP_HD uint32_t lane_field(const uint32_t* c, int pos, int len, int shl) {
  const int i = pos >> 5;
  return field(c[i], i + 1 < WPG ? c[i + 1] : 0u, pos & 31, len, shl);
}

// 2^LOG2E table entries, sign-folded (FOLD = 1) or not; entries 2^LOGS words apart (at least C: a
// wider stride leaves words unused, for byte-aligned entry offsets)
template <int LOG2E, int FOLD, int LOGS_MIN = 0>
struct LutGeom {
  static constexpr int SOURCE = 1 << LOG2E;  // entries of the codebook
  static constexpr int STORED = 1 << (LOG2E + FOLD);
  static constexpr int LOGC = (15 - LOG2E - FOLD) < 5 ? (15 - LOG2E - FOLD) : 5;
  static constexpr int C = 1 << LOGC;
  static constexpr int LOGS = LOGS_MIN > LOGC ? LOGS_MIN : LOGC;
  static constexpr int STRIDE = 1 << LOGS;  // words from one entry's copies to the next's
  static constexpr int WORDS = STORED * STRIDE;
  static constexpr int ESHIFT = 2 + LOGS;  // byte offset of entry e = e << ESHIFT
  static constexpr uint32_t MASK = static_cast<uint32_t>(STORED - 1) << ESHIFT;
  static constexpr bool BYTE_PAIRS = false;
  static_assert(WORDS <= LUT_MAX_WORDS && C >= 4, "table geometry");
  // stored entry e from the E source entries (x negated in the folded half)
  static QP_HD uint32_t entry(const uint32_t* src, int e) {
    return src[e & ((1 << LOG2E) - 1)] ^ (e >> LOG2E ? 0x8000u : 0u);
  }
  static QP_HD uint32_t word(const uint32_t* src, int i) { return entry(src, i >> LOGS); }  // table word i
  static QP_HD uint32_t lane_offset(int lane) { return static_cast<uint32_t>(lane & (C - 1)) << 2; }
};

// Two 4-bit pair codes a byte: entry b of 256 holds the values of b's high and low codes (8 bytes),
// 32 copies 8 bytes apart, entries 256 bytes apart, so one byte permute and one LDS.64 look up two
// codes (a half-warp's 8-byte loads cover the 32 banks once: no conflicts).
struct BytePairGeom {
  static constexpr int SOURCE = 16, STORED = 256, C = 32, LOGC = 5, LOGS = 6;
  static constexpr int STRIDE = 1 << LOGS;  // words from one entry's copies to the next's
  static constexpr int WORDS = STORED * STRIDE;
  static constexpr bool BYTE_PAIRS = true;
  static QP_HD int source(int i) {  // the codebook entry table word i holds
    const int b = i >> LOGS;
    return i & 1 ? b & 15 : b >> 4;
  }
  static QP_HD uint32_t word(const uint32_t* src, int i) { return src[source(i)]; }
  static QP_HD uint32_t lane_offset(int lane) { return static_cast<uint32_t>(lane & (C - 1)) << 3; }
};

QP_HD uint32_t lds(const uint32_t* lut, uint32_t byte_off) {
  return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut) + byte_off);
}
QP_HD void lds2(const uint32_t* lut, uint32_t byte_off, uint32_t& lo, uint32_t& hi) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut) + byte_off);
#ifdef __CUDA_ARCH__
  const uint2 v = *reinterpret_cast<const uint2*>(p);  // one LDS.64
  lo = v.x, hi = v.y;
#else
  lo = p[0], hi = p[1];
#endif
}

// f(a, b, c) bit by bit in one LOP3; LUT is f's truth table, bit 4a + 2b + c (PTX's immLut)
template <uint32_t LUT>
QP_HD uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
#else
  uint32_t r = 0;
  for (int i = 0; i < 8; ++i)
    if ((LUT >> i) & 1u) r |= (i & 4 ? a : ~a) & (i & 2 ? b : ~b) & (i & 1 ? c : ~c);
  return r;
#endif
}

// (v & mask) | bits in one LOP3 (left to itself nvcc sometimes masks twice)
QP_HD uint32_t and_or(uint32_t v, uint32_t mask, uint32_t bits) { return lop3<0xEAu>(v, mask, bits); }

// bits of a where m is set, of b elsewhere, in one LOP3 (nvcc splits the expression into masks and ORs)
QP_HD uint32_t select_bits(uint32_t a, uint32_t b, uint32_t m) { return lop3<0xE4u>(a, b, m); }

// ---- decoders: tile<U>(c, nb, lut, lanebits, a) = A registers of tile U of the group -------------

// Byte-addressed tables (entries 256 bytes apart): one byte permute puts byte `byte` of word w over
// the lane's copy offset (byte 0 of lanebits, whose other bytes are zero), where a field extract and
// a mask took two instructions.
constexpr int BYTE_LOGS = 6;
QP_HD uint32_t byte_entry(uint32_t w, int byte, uint32_t lanebits) {
  return byte_perm(w, lanebits, 0x5504u | (static_cast<uint32_t>(byte) << 4));
}

template <int CB>  // pair codes of CB bits (VQ with CB = 2·bits; NUQ-b ≤ 5 as 2b-bit pairs)
struct PairLanes {
  static constexpr int TW = 4 * CB;  // bits of one lane in one tile
  static constexpr int WPG = CB;
  static constexpr int HALO = 0;
  using L = std::conditional_t<CB == 4, BytePairGeom, LutGeom<CB, 0, CB == 8 ? BYTE_LOGS : 0>>;
  template <int U>
  static QP_HD void tile(const uint32_t* c, const uint32_t*, const uint32_t* lut, uint32_t lanebits,
                         uint32_t (&a)[4]) {
    if constexpr (CB == 4) {  // tile U = half U % 2 of word U / 2, MSB first: codes 0, 1 then 2, 3
      lds2(lut, byte_entry(c[U / 2], 3 - 2 * (U % 2), lanebits), a[0], a[1]);
      lds2(lut, byte_entry(c[U / 2], 2 - 2 * (U % 2), lanebits), a[2], a[3]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (CB == 8) a[k] = lds(lut, byte_entry(c[U], 3 - k, lanebits));  // word U = tile U, MSB first
        else a[k] = lds(lut, and_or(lane_field<WPG>(c, U * TW + k * CB, CB, L::ESHIFT), L::MASK, lanebits));
      }
    }
  }
};

template <int B>  // scalar codes of B bits, two lookups a pair (NUQ-6..8)
struct ScalarLanes {
  static constexpr int TW = 8 * B;
  static constexpr int WPG = 2 * B;
  static constexpr int HALO = 0;
  using L = LutGeom<B, 0, B == 8 ? BYTE_LOGS : 0>;
  template <int U>
  static QP_HD void tile(const uint32_t* c, const uint32_t*, const uint32_t* lut, uint32_t lanebits,
                         uint32_t (&a)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t v0, v1;
      if constexpr (B == 8) {  // words 2U, 2U+1 = tile U, MSB first
        v0 = lds(lut, byte_entry(c[2 * U + k / 2], 3 - 2 * (k % 2), lanebits));
        v1 = lds(lut, byte_entry(c[2 * U + k / 2], 2 - 2 * (k % 2), lanebits));
      } else {
        v0 = lds(lut, and_or(lane_field<WPG>(c, U * TW + 2 * k * B, B, L::ESHIFT), L::MASK, lanebits));
        v1 = lds(lut, and_or(lane_field<WPG>(c, U * TW + (2 * k + 1) * B, B, L::ESHIFT), L::MASK, lanebits));
      }
      a[k] = byte_perm(v0, v1, 0x5410);  // low halves: the pair
    }
  }
};

template <int KV, int Q>  // TCQ: KV bits a step, 16-bit states, hybrid table of 2^Q pairs
struct TcqLanes {
  static constexpr int TW = 4 * KV;
  static constexpr int WPG = KV;
  static constexpr int HALO = KV <= 3 ? 2 : 1;  // lanes whose bits a window may reach
  using L = LutGeom<Q, 1>;
  // the hash's index bits (15-Q)..15 land on the table's entry bits at byte offset << ESHIFT
  static constexpr int SH = L::ESHIFT - (15 - Q);
  static_assert(SH >= 0, "table shift");

  // s[k] = state of step k in the low 16 bits (garbage above: the hash works mod 2^16)
  template <int U>
  static QP_HD void windows(const uint32_t* c, const uint32_t* nb, uint32_t (&s)[4]) {
    constexpr int P = U * TW;
    if constexpr (KV == 4) {  // a word is tiles 2q, 2q+1: one byte permute joins own and halo bits
      const uint32_t R = c[U / 2], H = nb[U / 2];
      const uint32_t x = byte_perm(R, H, U % 2 ? 0x1054u : 0x3276u);  // [own(U) | halo(U)]
      s[0] = U % 2 ? R : R >> 16;
      s[1] = x >> 12;
      s[2] = x >> 8;
      s[3] = x >> 4;
    } else if constexpr (KV == 2) {  // a tile is one byte a lane: x = [own | lane+1 | lane+2 | .] by byte
      // permutes: y interleaves the two halo lanes' bytes of two tiles (computed once for both), one
      // permute a tile adds the own byte. The shifts and masks of the KV = 3 branch took 26.6 SASS
      // instructions a tile against 23.7 here; tcq-1.0 3–7% faster (results/kernels_h100/v11/)
      constexpr int I = U / 4, J = U % 4;
      const uint32_t y = byte_perm(nb[I], nb[WPG + I], J < 2 ? 0x3726u : 0x1504u);
      const uint32_t x = byte_perm(c[I], y, J == 0 ? 0x3760u : J == 1 ? 0x2540u : J == 2 ? 0x1760u : 0x0540u);
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] = x >> (16 - k * KV);
    } else if constexpr (KV == 6) {  // word j < 6 = [b2 y b0 b1] of tile j; tiles 6, 7 in the y bytes (lanes.py)
      uint32_t w, h;
      if constexpr (U < 6) {
        w = c[U], h = nb[U];
      } else {  // [b2 . b0 b1] from the y bytes of words 3(U−6) .. 3(U−6)+2
        constexpr int J = 3 * (U - 6);
        w = byte_perm(byte_perm(c[J], c[J + 1], 0x0026u), c[J + 2], 0x6010u);
        h = byte_perm(byte_perm(nb[J], nb[J + 1], 0x0026u), nb[J + 2], 0x6010u);
      }
      const uint32_t v = byte_perm(w, h, 0x0354u);  // [b1 b2 h0 h1]
      s[0] = w;                      // stream bits 0..15: [b0 b1]
      s[1] = (w << 6) | (w >> 26);   // 6..21: a rotate
      s[2] = v >> 12;                // 12..27
      s[3] = v >> 6;                 // 18..33
    } else if constexpr (HALO == 1 && TW < 32) {  // KV 5, 7: the own bits right-aligned, the halo's on top
      const uint32_t own = lane_field<WPG>(c, P, TW, 0), halo = lane_field<WPG>(nb, P, 32, 0);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = KV * k + 16 - TW;  // halo bits in window k
        s[k] = n <= 0 ? own >> -n : funnel_l(halo, own, n);
      }
    } else if constexpr (TW >= 32) {  // KV ≥ 8: each window inside the own bits is one funnel shift of the
      // lane's words; the rest join the last 32 own bits to the halo's. KV 9, 10: 27.2 / 26.2 → 24.3 / 24.1
      // SASS instructions a tile against shifting two extracted 32-bit fields (results/kernels_h100/v13/)
      const uint32_t last = lane_field<WPG>(c, P + TW - 32, 32, 0), halo = lane_field<WPG>(nb, P, 32, 0);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int end = KV * k + 16;  // window k = stream bits [end − 16, end): one funnel shift each
        s[k] = end <= TW ? lane_field<WPG>(c, P + end - 16, 16, 0) : funnel_l(halo, last, end - TW);
      }
    } else {  // KV 3: the windows' 25 stream bits low-aligned in x (stream bit j at bit 24 − j): the own
      // 12 at 13..24, lane ℓ+1's 12 at 1..12, lane ℓ+2's first at 0. Each field lands in place with
      // one shift, two selects join them and the last window needs no shift: 26.3 SASS instructions
      // a tile against 28.3 when 32-bit fields were masked after extraction; tcq-1.5 2–3% faster
      // (results/kernels_h100/v12/)
      const uint32_t own = lane_field<WPG>(c, P, TW, 1 + TW), h1 = lane_field<WPG>(nb, P, TW, 1);
      const uint32_t h2 = lane_field<WPG>(nb + WPG, P, 1, 0);
      const uint32_t x = select_bits(select_bits(own, h1, ~0u << (1 + TW)), h2, ~1u);
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] = x >> ((3 - k) * KV);
    }
  }
  template <int U>
  static QP_HD void tile(const uint32_t* c, const uint32_t* nb, const uint32_t* lut, uint32_t lanebits,
                         uint32_t (&a)[4]) {
    uint32_t s[4];
    windows<U>(c, nb, s);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t h = s[k] * s[k] + s[k];  // low 16 bits = s(s+1) mod 2^16
      a[k] = lds(lut, and_or(h << SH, L::MASK, lanebits));
    }
  }
};

// word index (in 32-bit units, inside a block of 32·WPG words) of lane ℓ's word q: planes of 4
// words, then one of 2, then one of 1; half-TCQ's second half: the first half's planes (WPG − 1
// words), then a plane of its last word (lanes.block_order)
QP_HD int block_word(int wpg, int lane, int q, bool second_half = false) {
  if (second_half) return q < wpg - 1 ? block_word(wpg - 1, lane, q) : (wpg - 1) * 32 + lane;
  const int full = wpg / 4 * 4;
  if (q < full) return (q / 4) * 128 + lane * 4 + q % 4;
  if (q < full + 2 && wpg - full >= 2) return full * 32 + lane * 2 + (q - full);
  return (wpg - 1) * 32 + lane;
}

}  // namespace qp
