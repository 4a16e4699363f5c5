// Shared by the GPU benchmark and the host self-test: today's TCQ packed format (reference
// decode), the new "lane-major" layout (repack), and the per-lane window extraction of the new
// kernel, all as __host__ __device__ code so the host can emulate a warp bit-exactly.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define HD __host__ __device__ __forceinline__
#else
#define HD inline
#endif

namespace kv2 {

// ---- bit helpers (device intrinsics, host emulation) --------------------------------------
HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 7u;
    r |= static_cast<uint32_t>((v >> (8 * sel)) & 0xFFu) << (8 * i);
  }
  return r;
#endif
}
// upper 32 bits of (hi:lo) << n, 0 <= n <= 31
HD uint32_t fshl(uint32_t lo, uint32_t hi, int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, n);
#else
  return n == 0 ? hi : (hi << n) | (lo >> (32 - n));
#endif
}

// ---- today's format (docs/format.md) ------------------------------------------------------
// A tile is 4*KV int32 words; stream bit i = bit 31 - (i % 32) of word i / 32. Step t's state is
// the 16-bit window at t*KV, read circularly in the 128*KV-bit stream (trellis.stream_to_states).
HD uint32_t ref_state(const uint32_t* tile_words, int kv, int t) {
  const int len = 128 * kv;
  uint32_t s = 0;
  for (int k = 0; k < 16; ++k) {
    const int b = (t * kv + k) % len;
    s = (s << 1) | ((tile_words[b >> 5] >> (31 - (b & 31))) & 1u);
  }
  return s;
}
// value(s) of the hybrid table T (2^9 entries, each (x | y << 16) as fp16 bits), Q = 9:
// h = s(s+1) mod 2^16, idx = (h >> 6) & 511, x negated when bit 15 of h is set.
HD uint32_t ref_value(uint32_t s, const uint32_t* T) {
  const uint32_t h = (s * (s + 1u)) & 0xFFFFu;
  const uint32_t idx = (h >> 6) & 511u;
  return T[idx] ^ ((h & 0x8000u) ? 0x8000u : 0u);
}
// Position p = 2t + e of a tile (fragment order, tiles.py) -> (row, col) inside the tile.
HD void frag_pos(int p, int& row, int& col) {
  const int lane = p >> 3, k = (p >> 1) & 3, e = p & 1;
  const int g = lane >> 2, c = lane & 3;
  row = g + 8 * (k & 1);
  col = 2 * c + 8 * (k >> 1) + e;
}

// ---- the new layout ----------------------------------------------------------------------
// Codes of row tile i, K-group j (8 consecutive 16-column tiles) form one block of 32 lanes x KV
// words (32*KV*4 bytes), blocks in row-major (i, j) order. Lane l's KV words hold its own bits
// (stream bits [4*l*KV, 4*l*KV + 4*KV), "own") of the 8 tiles u = 0..7 of the group:
//   KV=4: word q = own(2q) << 16 | own(2q+1)
//   KV=8: word q = own(q)
//   KV=6: own(u) = bytes b0 b1 b2 (b0 first in the stream); for u < 6 word u = [b2 | y_u | b0 | b1]
//         (MSB..LSB), y_0..y_2 = b0,b1,b2 of tile 6, y_3..y_5 = b0,b1,b2 of tile 7.
// In memory the block is split into planes so that every load instruction of a warp reads 512
// contiguous bytes: KV=4 one uint4 plane; KV=8 two uint4 planes (words 0-3, 4-7);
// KV=6 one uint4 plane (words 0-3) then one uint2 plane (words 4-5).
HD uint32_t own_bits(const uint32_t* tile_words, int kv, int lane) {
  const int nb = 4 * kv, off = lane * nb;  // never crosses the stream end
  const uint64_t w = (static_cast<uint64_t>(tile_words[off >> 5]) << 32) |
                     ((off >> 5) + 1 < 4 * kv ? tile_words[(off >> 5) + 1] : 0u);
  return static_cast<uint32_t>((w >> (64 - (off & 31) - nb)) & ((1ull << nb) - 1));
}
// lane words of one group from the 8 tiles' own bits
HD void pack_lane(int kv, const uint32_t (&own)[8], uint32_t* w) {
  if (kv == 4) {
    for (int q = 0; q < 4; ++q) w[q] = (own[2 * q] << 16) | (own[2 * q + 1] & 0xFFFFu);
  } else if (kv == 8) {
    for (int q = 0; q < 8; ++q) w[q] = own[q];
  } else {  // kv == 6
    uint32_t y[6];
    for (int t = 0; t < 2; ++t)
      for (int b = 0; b < 3; ++b) y[3 * t + b] = (own[6 + t] >> (16 - 8 * b)) & 0xFFu;
    for (int u = 0; u < 6; ++u) {
      const uint32_t b0 = (own[u] >> 16) & 0xFFu, b1 = (own[u] >> 8) & 0xFFu, b2 = own[u] & 0xFFu;
      w[u] = (b2 << 24) | (y[u] << 16) | (b0 << 8) | b1;
    }
  }
}
// word index (within the block, in 32-bit units) of lane l's word q
HD int block_word(int kv, int lane, int q) {
  if (kv == 4) return lane * 4 + q;
  if (kv == 8) return (q >> 2) * 128 + lane * 4 + (q & 3);
  return q < 4 ? lane * 4 + q : 128 + lane * 2 + (q - 4);  // kv == 6
}

// Windows of the 4 steps of each of the 8 tiles of a group: low 16 bits = the state, bits above
// are garbage (the hash only needs s mod 2^16). c = own lane words, n = lane+1's words (halo).
template <int KV>
struct Lay;
template <>
struct Lay<4> {
  HD static void windows(const uint32_t* c, const uint32_t* n, uint32_t (&w)[8][4]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t R = c[q], H = n[q];
      const uint32_t xa = prmt(R, H, 0x3276u);  // [own(2q) | halo(2q)]
      const uint32_t xb = prmt(R, H, 0x1054u);  // [own(2q+1) | halo(2q+1)]
      w[2 * q][0] = R >> 16;
      w[2 * q][1] = xa >> 12;
      w[2 * q][2] = xa >> 8;
      w[2 * q][3] = xa >> 4;
      w[2 * q + 1][0] = R;
      w[2 * q + 1][1] = xb >> 12;
      w[2 * q + 1][2] = xb >> 8;
      w[2 * q + 1][3] = xb >> 4;
    }
  }
};
template <>
struct Lay<8> {
  HD static void windows(const uint32_t* c, const uint32_t* n, uint32_t (&w)[8][4]) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint32_t O = c[u];
      w[u][0] = O >> 16;
      w[u][1] = O >> 8;
      w[u][2] = O;
      w[u][3] = fshl(n[u], O, 8);
    }
  }
};
template <>
struct Lay<6> {
  HD static void windows(const uint32_t* c, const uint32_t* n, uint32_t (&w)[8][4]) {
#pragma unroll
    for (int u = 0; u < 6; ++u) {
      const uint32_t O = c[u];
      const uint32_t D = prmt(O, n[u], 0x0354u);  // [b1 b2 nb0 nb1] = stream 8..39
      w[u][0] = O;                               // b0 b1 in the low half
      w[u][1] = fshl(O, O, 6);                   // rotate: stream 6..21
      w[u][2] = D >> 12;
      w[u][3] = D >> 6;
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint32_t E = prmt(c[3 * t], c[3 * t + 1], 0x0026u);  // [_ _ y0 y1]
      const uint32_t F = prmt(E, c[3 * t + 2], 0x6010u);        // [y2 _ y0 y1]
      const uint32_t G = prmt(n[3 * t], n[3 * t + 1], 0x0026u);  // [_ _ ny0 ny1]
      const uint32_t D = prmt(F, G, 0x0354u);                   // [y1 y2 ny0 ny1]
      w[6 + t][0] = F;
      w[6 + t][1] = fshl(F, F, 6);
      w[6 + t][2] = D >> 12;
      w[6 + t][3] = D >> 6;
    }
  }
};

// Byte offset in the 32-copy sign-folded table: entry e = h bits 6..15 (bit 9 = sign), copy =
// lane: word e*32 + lane. Table word (e, c) = T[e & 511] ^ (e & 512 ? 0x8000 : 0).
HD uint32_t lut_off(uint32_t w, uint32_t lanebits) {
  const uint32_t h = w * w + w;
#ifdef __CUDA_ARCH__
  uint32_t r;  // one LOP3 (a & b) | c; left to itself nvcc re-masks lanebits with a second LOP3
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(h << 1), "n"(0x1FF80), "r"(lanebits));
  return r;
#else
  return ((h << 1) & 0x1FF80u) | lanebits;
#endif
}

}  // namespace kv2
