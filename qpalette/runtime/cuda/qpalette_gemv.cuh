// Fused dequantize + GEMV for batch 1..8 on the lane-major layout, and the dequantize kernel
// (batch > 8: then cuBLAS), both reading the same packed codes.
//
// Persistent grid, one CTA an SM, optionally clusters of CS CTAs splitting K. Cluster q owns row
// tiles [q·RT/ncl, (q+1)·RT/ncl); CTA rank r owns groups [r·cgc, (r+1)·cgc) of the padded K
// axis; warp w owns NG = 2 of those groups (16 tiles) for the whole kernel and keeps their
// activation B fragments in registers. An "item" = (row tile, the warp's groups): NG blocks of
// coalesced 16-byte loads straight into registers, RR − 1 items in flight (a register ring).
// Each tile: the lane's windows (TCQ: + one shuffle a word for the halo from lane ℓ+1), one
// table lookup a register pair, one mma.m16n8k16 with the batch as n = 8, so per-tile work does
// not grow with the batch. Every RR row tiles (a round) each warp stores its 16×8 fp32 partial in
// shared memory; warps 0..RR−1 sum them over the warps in a fixed order, scale and write y. The
// warps meet by named barriers as producers and consumers (bar.arrive/bar.sync): only the
// reducers wait for a round's partials; the others wait only for the buffer of two rounds back.
// With CS > 1 each CTA's scaled sums go to rank 0's shared memory (distributed shared memory), which
// adds them after one cluster barrier every fr rounds (flush_cluster). No global atomics, no
// workspace, deterministic. The table and the codes of the first items are fetched before
// `griddepcontrol.wait`: with programmatic dependent launch that prologue overlaps the previous
// kernel; x is read and y written only after it (the reducers fetch each round's row scales at
// the round's start). With `signs` the staging also rotates x (stage_x_rotated), each CTA its own
// columns; at batch > 1 with K = 1 a cluster of CTAs splits the rows' transforms and shares them
// through distributed shared memory (share_rotated_rows). `gated` (with signs): x rows hold a gated
// MLP's [gate | up] and the staging forms silu(gate) ⊙ up before rotating it, so the down
// projection follows the gate/up GEMV without an elementwise kernel between them. `norm_w` (with
// signs, K = 1, one CTA a cluster): the staging first adds `x_add` (a residual; CTA 0 writes the sum
// to `h_out`) and applies an RMSNorm (block-wide sum of squares), so a decoder block's add + norm
// kernel disappears too; `y_add` is added to y as it is written (the residual after down).
// half-TCQ: segment 0 (codes_a, the first half of the columns) and segment 1 (codes_b) are
// consecutive ranges of groups; a warp decodes each group with its segment's decoder.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "qpalette_fwht.cuh"
#include "qpalette_hopper.cuh"
#include "qpalette_kernels.h"
#include "qpalette_lanes.cuh"
#include "qpalette_mma.cuh"

namespace qp {

constexpr int NG = 2;        // groups a warp owns
constexpr int MAX_WARPS = 16;
constexpr int MAX_ROWS = 8;  // activation rows of the fused GEMV (the mma's n)
constexpr int MAX_ROTATION_CLUSTER = 8;  // CTAs sharing the rows' rotation at batch > 1

struct Segment {
  const uint4* codes;  // (RT, cg, 32·WPG) int32
  int cg;              // groups a row tile
  int ct;              // real tiles a row tile (the rest of the last group is padding)
  int col0;            // first input column
};

struct GemvParams {
  Segment seg[2];      // seg[1] only for half-TCQ (else seg[1].cg == 0)
  const char* x;       // (m, ldx) activations
  long long ldx;
  char* y;             // (m, ldy)
  long long ldy;
  const __half* row_scale;
  const uint32_t* lut; // source table, 2^LOG2E words
  int m, rt;
  int cs, cgc, ncl;    // cluster size, groups a CTA, clusters
  int fr;              // cs > 1: rounds of row tiles a flush of the cluster sums (flush_cluster)
  int nw;              // warps a CTA
  int rs;              // rotation cluster: CTAs that split the rows' fused rotation (1: none; then cs == 1)
  const uint8_t* signs;  // fused rotation x ← H(s ⊙ x)/√n, H = H_K ⊗ H_{2^m} (n = cols), or nullptr
  const unsigned long long* hk_neg;  // H_K by rows, bit a of row j set ⇔ H_K[j, a] = −1 (K ≤ 64); nullptr when K = 1
  int rot_k, log2p2;
  int gated;           // with signs: x rows are [gate | up] (2n values) and the input is silu(gate) ⊙ up
  const char* norm_w;  // with signs, K = 1, cs = rs = 1: x ← rmsnorm(x + x_add) ⊙ norm_w first (n values), or nullptr
  float norm_eps;
  const char* x_add;   // with norm_w: (m, n) contiguous, added before the norm, or nullptr
  char* h_out;         // with x_add: x + x_add, (m, n), written by CTA 0
  const char* y_add;   // (m, ldy) added to y as it is written, or nullptr
  float rot_scale;     // 1/√n
  // expert launch (GemvArgs): blockIdx.y = slot v, y row v ← x row x_rows[v] · W_{members[v]}ᵀ
  const long long* experts;  // (members, 4): codes_a, codes_b, row_scale, signs addresses; nullptr: one matrix
  const long long* members;
  const long long* x_rows;
};


__device__ __forceinline__ uint4 ld_stream4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_stream2(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_stream1(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned short ld_stream_u16(const __half* p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}

// one word a lane, left as it was when `on` is false (a predicate, no branch)
__device__ __forceinline__ void ld_stream1_if(uint32_t& c, const uint32_t* p, bool on) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q ld.global.nc.L1::no_allocate.u32 %0, [%1];\n}\n"
               : "+r"(c) : "l"(p), "r"(static_cast<int>(on)));
}

// lane's WPG words of the block at `blk` (planes: block_word)
template <int WPG>
__device__ __forceinline__ void load_group(uint32_t* c, const uint4* blk, int lane) {
  constexpr int P4 = WPG / 4, REM = WPG % 4;
#pragma unroll
  for (int p = 0; p < P4; ++p) {
    const uint4 v = ld_stream4(blk + p * 32 + lane);
    c[4 * p] = v.x; c[4 * p + 1] = v.y; c[4 * p + 2] = v.z; c[4 * p + 3] = v.w;
  }
  const uint32_t* tail = reinterpret_cast<const uint32_t*>(blk + P4 * 32);
  if constexpr (REM >= 2) {
    const uint2 v = ld_stream2(reinterpret_cast<const uint2*>(tail) + lane);
    c[4 * P4] = v.x; c[4 * P4 + 1] = v.y;
  }
  if constexpr (REM % 2) c[WPG - 1] = ld_stream1(tail + (REM >= 2 ? 64 : 0) + lane);
}

// lane's word in the plane of half-TCQ's last word, after the first half's WA planes (block_word)
template <int WA>
__device__ __forceinline__ const uint32_t* last_word(const uint4* blk, int lane) {
  return reinterpret_cast<const uint32_t*>(blk) + 32 * WA + lane;
}

// half-TCQ's second half (WA + 1 words a lane): the first half's planes and a plane of the last word
// (block_word)
template <int WA>
__device__ __forceinline__ void load_group_second(uint32_t* c, const uint4* blk, int lane) {
  load_group<WA>(c, blk, lane);
  c[WA] = ld_stream1(last_word<WA>(blk, lane));
}

// a group of either half (`b`: the second): the first layout's loads and the second's last word under
// a predicate, into the same registers and without a branch. With a branch a group, ptxas joined the
// two layouts' registers by moves that waited for the loads: long-scoreboard stalls of 2.8 against
// tcq-3.5's 1.2 cycles an instruction (results/kernels_h200/v17/).
template <int WA>
__device__ __forceinline__ void load_group_either(uint32_t* c, const uint4* blk, int lane, bool b) {
  load_group<WA>(c, blk, lane);
  ld_stream1_if(c[WA], last_word<WA>(blk, lane), b);
}

// the words of lanes ℓ+1 (and ℓ+2) that TCQ windows reach into
template <class D>
__device__ __forceinline__ void halo(const uint32_t* c, uint32_t* nb, int lane) {
#pragma unroll
  for (int h = 0; h < D::HALO; ++h)
#pragma unroll
    for (int q = 0; q < D::WPG; ++q) nb[h * D::WPG + q] = __shfl_sync(0xffffffffu, c[q], (lane + 1 + h) & 31);
}

// the 8 tiles of one group into the accumulators (two chains: half the mma dependency chain)
template <class D, class T>
__device__ __forceinline__ void group_mma(const uint32_t* c, int lane, const uint32_t* lut, uint32_t lanebits,
                                          const uint32_t (*bx)[2], float (&a0)[4], float (&a1)[4]) {
  uint32_t nb[D::HALO ? D::HALO * D::WPG : 1];
  halo<D>(c, nb, lane);
  auto one = [&](auto u_const) {
    constexpr int U = decltype(u_const)::value;
    uint32_t a[4];
    D::template tile<U>(c, nb, lut, lanebits, a);
    if constexpr (U % 2) mma_16816<T>(a1, a, bx[U][0], bx[U][1]);
    else mma_16816<T>(a0, a, bx[U][0], bx[U][1]);
  };
  one(std::integral_constant<int, 0>{}); one(std::integral_constant<int, 1>{});
  one(std::integral_constant<int, 2>{}); one(std::integral_constant<int, 3>{});
  one(std::integral_constant<int, 4>{}); one(std::integral_constant<int, 5>{});
  one(std::integral_constant<int, 6>{}); one(std::integral_constant<int, 7>{});
}

template <class DA, class DB>
struct Pair {
  static constexpr int WMAX = DA::WPG > DB::WPG ? DA::WPG : DB::WPG;
  static constexpr bool TWO = !std::is_same<DA, DB>::value;
  static constexpr int RR = NG * WMAX <= 12 ? 3 : 2;  // ring depth (prototype sweep: 3 up to 12 words)
  using L = typename DB::L;
  // batch > 1 may split the fused rotation over a cluster (share_rotated_rows); not half-TCQ and
  // the widest words, whose registers would spill with it
  static constexpr bool SHARE_ROTATION = !TWO && WMAX <= 12;
  // the staging that forms its input (silu(gate) ⊙ up, add + RMSNorm): the same registers to spare
  static constexpr bool FORMS_INPUT = SHARE_ROTATION;
  // H_K's mix on the tensor cores (mix_on_tensor_cores)
  static constexpr bool MIX_MMA = WMAX <= 12;
  // half-TCQ loads a group of either half without a branch (load_group_either), which needs this
  static_assert(!TWO || DB::WPG == DA::WPG + 1, "half-TCQ: the second half's lanes hold one word more");
  static_assert(DA::L::WORDS == DB::L::WORDS && DA::L::C == DB::L::C && DA::L::STRIDE == DB::L::STRIDE,
                "the two halves share one table");
};

__host__ __device__ constexpr size_t red_bytes(int rr, int nw) { return size_t(2) * rr * nw * 32 * 16; }
__host__ __device__ constexpr size_t xs_bytes(int cgc, int m) { return size_t(m) * (cgc * 64 + 4) * 4; }
// K split over a cluster: each CTA's scaled row-tile sums go to rank 0's shared memory, `fr` rounds
// of row tiles at a time (the most of MAX_FLUSH_ROUNDS, 2, 1 that fits), summed there after one
// cluster barrier (not one a round)
constexpr int MAX_FLUSH_ROUNDS = 4;
__host__ __device__ constexpr size_t cpart_bytes(int rr, int cs, int fr) { return cs > 1 ? size_t(fr) * rr * cs * 32 * 16 : 0; }
// z (double buffered) and the RMSNorm's per-warp sums (double buffered)
__host__ __device__ constexpr size_t rot_bytes(int n) { return n ? (size_t(2) * n + 2 * MAX_WARPS) * 4 : 0; }
template <class L>
__host__ __device__ constexpr size_t gemv_smem(int rr, int nw, int cgc, int cs, int fr, int m, int rot_n) {
  return size_t(L::WORDS) * 4 + (red_bytes(rr, nw) > xs_bytes(cgc, m) ? red_bytes(rr, nw) : xs_bytes(cgc, m)) +
         cpart_bytes(rr, cs, fr) + rot_bytes(rot_n);
}

// The byte-pair table (BytePairGeom): every 16-byte piece holds two copies of one entry, their words
// at L::source (the layout's one definition, which the host emulator test reads too); 8 pieces a
// thread, their source words loaded first (all in flight).
template <class L>
__device__ __forceinline__ void fill_byte_pairs(uint32_t* lut, const uint32_t* src) {
  constexpr int PIECES = L::WORDS / 4;  // 16 bytes: two copies of one entry
  uint4* l4 = reinterpret_cast<uint4*>(lut);
  for (int base = threadIdx.x; base < PIECES; base += 8 * blockDim.x) {
    uint32_t hi[8], lo[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // words 4i, 4i + 1 of piece i (4i + 2, 4i + 3 repeat them)
      const int i = base + k * blockDim.x;
      hi[k] = i < PIECES ? __ldg(src + L::source(4 * i)) : 0u;
      lo[k] = i < PIECES ? __ldg(src + L::source(4 * i + 1)) : 0u;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (base + k * blockDim.x < PIECES) l4[base + k * blockDim.x] = make_uint4(hi[k], lo[k], hi[k], lo[k]);
  }
}

// The table, replicated C times (entries STRIDE words apart). Thread t writes 16-byte piece
// t mod C/4 of its entries, so a warp's stores are contiguous; each round first loads 8 entries a
// thread (all in flight: they come from L2), then stores them (and their sign-flipped copies in a
// folded table).
template <class L>
__device__ __forceinline__ void fill_table_any(uint32_t* lut, const uint32_t* src) {
  if constexpr (L::BYTE_PAIRS) {
    fill_byte_pairs<L>(lut, src);
    return;
  }
  constexpr int E = L::SOURCE, PIECES = L::C / 4, STRIDE4 = L::STRIDE / 4;
  uint4* l4 = reinterpret_cast<uint4*>(lut);
  const int step = blockDim.x / PIECES, e0 = threadIdx.x / PIECES, j = threadIdx.x % PIECES;
  for (int base = e0; base < E; base += 8 * step) {
    uint32_t v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = base + k * step < E ? __ldg(src + base + k * step) : 0u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int e = base + k * step;
      if (e < E) {
        l4[e * STRIDE4 + j] = make_uint4(v[k], v[k], v[k], v[k]);
        if (L::STORED > E) {
          const uint32_t n = v[k] ^ 0x8000u;
          l4[(e + E) * STRIDE4 + j] = make_uint4(n, n, n, n);
        }
      }
    }
  }
}

// Whether a CTA of NT threads splits the table's 16-byte pieces evenly, at most 8 a thread (byte
// pairs: whole steps of 256 pieces, see fill_table_even)
template <class L, int NT>
__host__ __device__ constexpr bool fills_evenly() {
  if constexpr (L::BYTE_PAIRS) return (L::WORDS / 4) % NT == 0 && (L::WORDS / 4) / NT <= 8 && NT % 256 == 0;
  else return NT % (L::C / 4) == 0 && L::SOURCE % (NT / (L::C / 4)) == 0 && L::SOURCE / (NT / (L::C / 4)) <= 8;
}

// The same table from a CTA of exactly NT threads that fills it evenly: every thread's loads and
// stores sit at compile-time offsets from one address, no bounds, no loop. The prologue runs once a
// launch at a low issue rate, and fill_table_any's runtime strides and predicates made it ~175 (byte
// pairs) and ~190 (TCQ) instructions a warp.
template <class L, int NT>
__device__ __forceinline__ void fill_table_even(uint32_t* lut, const uint32_t* src) {
  static_assert(fills_evenly<L, NT>(), "an even split");
  uint4* l4 = reinterpret_cast<uint4*>(lut);
  const int t = threadIdx.x;
  if constexpr (L::BYTE_PAIRS) {
    constexpr int PER = L::WORDS / 4 / NT;
    // piece i's words are codes i >> 8 and (i >> 4) & 15 (L::source): over pieces t + k·NT the
    // second stays, the first steps by NT / 256 (the compiler did not see it: ~100 instructions)
    static_assert(L::SOURCE == 16 && L::LOGS == 6, "byte-pair layout");
    const uint32_t lo = __ldg(src + L::source(4 * t + 1));
    const uint32_t* hs = src + L::source(4 * t);
    uint32_t hi[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) hi[k] = __ldg(hs + k * (NT / 256));
#pragma unroll
    for (int k = 0; k < PER; ++k) l4[t + k * NT] = make_uint4(hi[k], lo, hi[k], lo);
  } else {
    constexpr int E = L::SOURCE, PIECES = L::C / 4, STRIDE4 = L::STRIDE / 4, STEP = NT / PIECES;
    constexpr int PER = E / STEP;  // entries a thread, STEP apart
    const uint32_t* s = src + t / PIECES;
    uint4* d = l4 + (t / PIECES) * STRIDE4 + t % PIECES;
    uint32_t v[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) v[k] = __ldg(s + k * STEP);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      d[k * STEP * STRIDE4] = make_uint4(v[k], v[k], v[k], v[k]);
      if constexpr (L::STORED > E) {
        const uint32_t n = v[k] ^ 0x8000u;
        d[(k * STEP + E) * STRIDE4] = make_uint4(n, n, n, n);
      }
    }
  }
}

// the table from the CTA's nt threads: the even split when nt is the full CTA and it applies
template <class L>
__device__ __forceinline__ void fill_table(uint32_t* lut, const uint32_t* src, int nt) {
  constexpr int FULL = MAX_WARPS * 32;
  if constexpr (fills_evenly<L, FULL>()) {
    if (nt == FULL) {
      fill_table_even<L, FULL>(lut, src);
      return;
    }
  }
  fill_table_any<L>(lut, src);
}

// The activations of this CTA's padded columns → shared memory (zeros on padding tiles): thread t
// stages 16-byte chunk t of every row (chunks = 16·cgc ≤ the CTA's threads, as nw ≥ cgc / NG), all
// rows' loads in flight at once; no division by a runtime value (each costs ~20 instructions, and
// the prologue runs at a low issue rate).
template <class T>
__device__ __forceinline__ void stage_x(const GemvParams& p, uint32_t* xs, int rank) {
  const int ch = threadIdx.x, xsw = p.cgc * 64 + 4;
  if (ch >= p.cgc * 16) return;
  const int gg = rank * p.cgc + ch / 16;  // global group
  const int s = gg >= p.seg[0].cg;
  const int lt = (gg - (s ? p.seg[0].cg : 0)) * 8 + (ch & 15) / 2;  // tile inside the segment
  const bool valid = gg < p.seg[0].cg + p.seg[1].cg && lt < (s ? p.seg[1].ct : p.seg[0].ct);
  const T* src = reinterpret_cast<const T*>(p.x) + (s ? p.seg[1].col0 : 0) + lt * 16 + (ch & 1) * 8;
  if (p.m == 1) {  // batch 1 on its own path: the rows' predicated loads and stores cost ~120
                   // instructions a warp of a prologue that runs at a low issue rate
    *reinterpret_cast<uint4*>(xs + 4 * ch) = valid ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
    return;
  }
  uint4 v[MAX_ROWS];
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r)
    v[r] = valid && r < p.m ? __ldg(reinterpret_cast<const uint4*>(src + r * p.ldx)) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r)
    if (r < p.m) *reinterpret_cast<uint4*>(xs + r * xsw + 4 * ch) = v[r];
}

// Staging with the rotation fused: this CTA's columns of x ← H(s ⊙ x)/√n, H = H_K ⊗ H_{2^m}, in
// fp32, rounded to the activation dtype into the x buffer (qpalette_fwht.cuh), row by row. The
// CTA's columns are whole segments of 2^m (checked at launch), each held by 2^m/8 threads: each
// thread's chunk is mixed over the K segments of the row (H_K first: the factors commute), then
// the segments' 2^m-point transforms run side by side. K = 1: each thread loads its own chunk.
// K > 1: the whole row, signs applied (exact), is first staged in z (2n bytes ≤ z's 8·columns
// bytes: clusters of at most 4) with all loads in flight, so that the K-term sums read shared
// memory (the tensor-core mix then writes its sums there too: segments · (2^m + 8) floats ≤ z's
// 2·columns + 32); `hk` (bit a: H_K[segment, a] = −1) was read before the wait for the previous kernel.
// The mix runs on the tensor cores where it fits (mix_segments_mma) and MMA (decoders of at most 12 words
// a lane: with wider ones, nuq-8, the sums held across its barrier spilled registers in the main loop),
// else ~25 instructions a term a thread. Needs unpadded K (cols = groups · 128).
template <bool MMA>
__device__ __forceinline__ bool mix_on_tensor_cores(const GemvParams& p) {
  return MMA && p.rot_k > 1 && mix_fits_tensor_cores(p.rot_k, (p.cgc * 128) >> p.log2p2, p.log2p2, p.nw);
}

// rows of H_K as −1 bits: the thread's segment's (scalar mix: `a`), or the lane's A-fragment rows g and
// g + 8 of the CTA's segments (tensor cores: `a`, `b`); zero where there is no such row
struct HkRows {
  uint64_t a, b;
};
template <bool MMA>
__device__ __forceinline__ HkRows rotation_factor_rows(const GemvParams& p, int rank) {
  HkRows r{0ull, 0ull};
  if (!p.signs || p.rot_k == 1) return r;
  const int ccols = p.cgc * 128, segs = ccols >> p.log2p2, first = rank * segs;
  if (mix_on_tensor_cores<MMA>(p)) {
    const int g = (threadIdx.x & 31) >> 2;
    if (g < segs) r.a = __ldg(p.hk_neg + first + g);
    if (g + 8 < segs) r.b = __ldg(p.hk_neg + first + g + 8);
  } else if (threadIdx.x < ccols / 8) {
    r.a = __ldg(p.hk_neg + first + (threadIdx.x >> (p.log2p2 - 3)));  // 2^m / 8 threads a segment
  }
  return r;
}

// the row staged for the K > 1 mix (stage_signed_row); swizzled for mix_segments_mma
template <class T, int U, bool GATED>
__device__ __forceinline__ void stage_signed_row(const GemvParams& p, int row, T* raw, bool swizzled) {
  stage_signed_row<T, U, GATED>(reinterpret_cast<const T*>(p.x) + row * p.ldx, p.signs, (p.rot_k << p.log2p2) / 8, raw,
                                swizzled ? p.log2p2 - 3 : -1);
}

// K = 1 with p.norm_w (the CTA holds the whole row: cs = rs = 1): chunk c of this row of
// rmsnorm(x + x_add) ⊙ norm_w from x's chunk `in`, x_add's `res` and norm_w's `wn`; CTA 0 writes
// x + x_add to h_out. Every thread calls it (block_sum: one barrier; `part` alternates by row).
template <class T>
__device__ __forceinline__ uint4 normed_chunk(const GemvParams& p, uint4 in, const uint4& res, const uint4& wn, int row,
                                              int c, bool active, float* part) {
  if (p.x_add && active) {
    in = add_chunks<T>(in, res);
    if (blockIdx.x == 0) reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.h_out) + (row << p.log2p2))[c] = in;
  }
  return rms_normed_chunk<T>(in, wn, active, 1 << p.log2p2, p.norm_eps, part);
}

// SHARE (kernels that may run in a rotation cluster, p.rs > 1: batch > 1, K = 1, no K split): CTA
// `rrank` of the cluster transforms rows rrank, rrank + rs, … only, and share_rotated_rows gives
// every CTA the others'. Without SHARE the loop is the plain one (more registers spill otherwise).
// FORMS (Pair::FORMS_INPUT): the kernel may form silu(gate) ⊙ up (p.gated) or add + RMSNorm
// (p.norm_w) as it loads.
template <class T, bool SHARE, bool FORMS, bool MMA>
__device__ __forceinline__ void stage_x_rotated(const GemvParams& p, uint32_t* xs, float* z, int rank,
                                                const HkRows& hk, int rrank) {
  const int ccols = p.cgc * 128, xsw = p.cgc * 64 + 4, cpt = (1 << p.log2p2) / 8;
  const int jj = threadIdx.x >> (p.log2p2 - 3), t = threadIdx.x - jj * cpt;  // no runtime division
  const bool active = threadIdx.x < ccols / 8;
  const T* raw = reinterpret_cast<const T*>(z);
  int done = 0;  // rows transformed so far: z's half for K = 1 alternates with it
  for (int row = SHARE ? rrank : 0; row < p.m; row += SHARE ? p.rs : 1) {
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (p.rot_k == 1) {  // K = 1: n = 2^m
      const int c = (jj << p.log2p2) / 8 + t;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      uint4 in = zero, other = zero, wn = zero;  // other: up (gated) or the residual (norm)
      uint32_t sb = 0;
      if (active) {  // every load in flight at once
        const uint4* xr = reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.x) + row * p.ldx);
        in = __ldg(xr + c);
        sb = __ldg(p.signs + c);
        if (FORMS && p.gated) other = __ldg(xr + (1 << p.log2p2) / 8 + c);
        if (FORMS && p.norm_w) {
          wn = __ldg(reinterpret_cast<const uint4*>(p.norm_w) + c);
          if (p.x_add) other = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.x_add) + (row << p.log2p2)) + c);
        }
        if (FORMS && p.gated) in = silu_mul<T>(in, other);
      }
      if (FORMS && p.norm_w) in = normed_chunk<T>(p, in, other, wn, row, c, active, z + 2 * ccols + (row & 1) * MAX_WARPS);
      if (active) signed_chunk<T>(in, sb, v);
    } else {
      if (row > 0) __syncthreads();  // the last row's transform has read z
      const bool mma = mix_on_tensor_cores<MMA>(p);
      if (FORMS && p.gated) stage_signed_row<T, 4, FORMS>(p, row, reinterpret_cast<T*>(z), mma);
      else stage_signed_row<T, 8, false>(p, row, reinterpret_cast<T*>(z), mma);
      __syncthreads();
      if (mma) {
        mix_segments_mma<T>(z, hk.a, hk.b, p.rot_k, ccols >> p.log2p2, p.log2p2, v, active, jj, t);
      } else if (active) {  // H_K's −1 flips the chunk's sign bits (no select an element)
        const uint4* src = reinterpret_cast<const uint4*>(raw) + t;
        const int step = (1 << p.log2p2) >> 3;
        uint64_t neg = hk.a;
        for (int a = 0; a < p.rot_k; ++a, src += step, neg >>= 1) {
          const uint32_t flip = static_cast<uint32_t>(neg & 1u) * 0x80008000u;
          uint4 q = *src;
          q.x ^= flip, q.y ^= flip, q.z ^= flip, q.w ^= flip;
          add_chunk<T>(v, q);
        }
      }
      __syncthreads();  // z is the transform's buffer next
    }
    fwht_row<T>(v, p.log2p2, p.rot_scale, z + (p.rot_k == 1 ? ((SHARE ? done++ : row) & 1) * ccols : 0) + (jj << p.log2p2),
                reinterpret_cast<T*>(xs + row * xsw) + (jj << p.log2p2), t, active);
  }
}

// Rotation cluster: after one cluster barrier (every CTA's own rows are in its x buffer) each CTA
// reads the rows it did not transform from their owners' shared memory (distributed shared
// memory; thread t copies 16-byte chunk t of each row, all loads in flight), then a second barrier:
// no CTA reuses its x buffer (as the reduction buffer) while a peer may still read it. Batch 8
// then costs each CTA one row's transform instead of eight.
__device__ __forceinline__ void share_rotated_rows(const GemvParams& p, uint32_t* xs, int rrank) {
  const int ch = threadIdx.x, xsw = p.cgc * 64 + 4;
  const bool mine = ch < p.cgc * 16;  // chunks ≤ threads (stage_x)
  cluster_sync();
  uint4 v[MAX_ROWS];
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r) {
    const int owner = r & (p.rs - 1);  // rs: a power of two
    v[r] = make_uint4(0, 0, 0, 0);
    if (mine && r < p.m && owner != rrank) v[r] = reinterpret_cast<const uint4*>(cluster_peer(xs + r * xsw, owner))[ch];
  }
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r)
    if (mine && r < p.m && (r & (p.rs - 1)) != rrank) reinterpret_cast<uint4*>(xs + r * xsw)[ch] = v[r];
  cluster_sync();
}

// First row tile of cluster `cl` of `ncl` over `rt` row tiles: in 32 bits (the launcher checks
// rt · ncl < 2^32), since a 64-bit division costs every thread ~70 instructions of the prologue.
__device__ __forceinline__ int split_point(int cl, int rt, int ncl) {
  return static_cast<int>(static_cast<unsigned>(cl) * static_cast<unsigned>(rt) / static_cast<unsigned>(ncl));
}

// y's row tile `row` ← the (scaled) 16×8 accumulator tile s of the mma layout
template <class T>
__device__ __forceinline__ void store_y(const GemvParams& p, int row, const float4& s, int lane) {
  T* y = reinterpret_cast<T*>(p.y);
  const T* ya = reinterpret_cast<const T*>(p.y_add);
  auto put = [&](long long i, float v) {  // with y_add: rounded, then added and rounded again (torch's y + r)
    T o = Cvt<T>::from_float(v);
    if (ya) o = Cvt<T>::from_float(Cvt<T>::to_float(o) + Cvt<T>::to_float(ya[i]));
    y[i] = o;
  };
  const int ra = row * 16 + (lane >> 2), rb = ra + 8, n0 = 2 * (lane & 3), n1 = n0 + 1;
  if (n0 < p.m) {
    put(n0 * p.ldy + ra, s.x);
    put(n0 * p.ldy + rb, s.z);
  }
  if (n1 < p.m) {
    put(n1 * p.ldy + ra, s.y);
    put(n1 * p.ldy + rb, s.w);
  }
}

// The cluster's row tiles [j0, j1) of its range (first row tile r0): after one barrier (the CTAs'
// sums are in rank 0's cpart), rank 0 adds them in rank order and writes y; `again`: a barrier
// more, so that the next rounds' sums do not overwrite slots rank 0 is still reading.
template <class T>
__device__ __forceinline__ void flush_cluster(const GemvParams& p, const float4* cpart, int r0, int j0, int j1, int rank,
                                              bool again) {
  cluster_sync();
  if (rank == 0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int j = j0 + warp; j < j1; j += p.nw) {
      const int slot = j - j0;
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int c = 0; c < p.cs; ++c) {
        const float4 v = cpart[(slot * p.cs + c) * 32 + lane];
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
      store_y<T>(p, r0 + j, s, lane);
    }
  }
  if (again) cluster_sync();
}

template <class DA, class DB, class T>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
  using PR = Pair<DA, DB>;
  using L = typename PR::L;
  constexpr int RR = PR::RR, WMAX = PR::WMAX;
  extern __shared__ __align__(16) uint32_t smem[];
  uint32_t* lut = smem;
  uint32_t* xs = smem + L::WORDS;  // x staging, then the reduction buffer [2][RR][NW][32] float4
  float4* red = reinterpret_cast<float4*>(xs);
  const int nw = p.nw, nt = nw * 32;
  const size_t ub = red_bytes(RR, nw) > xs_bytes(p.cgc, p.m) ? red_bytes(RR, nw) : xs_bytes(p.cgc, p.m);
  float4* cpart = reinterpret_cast<float4*>(reinterpret_cast<char*>(xs) + ub);  // [fr·RR][CS][32]
  float* rot = reinterpret_cast<float*>(reinterpret_cast<char*>(cpart) + cpart_bytes(RR, p.cs, p.fr));  // [n]

  pdl_launch_dependents();
  // K split: "this CTA has started", waited for before the first write into rank 0's shared memory
  if (p.cs > 1) cluster_arrive_relaxed();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rank = p.cs > 1 ? cluster_rank() : 0;
  const int cl = blockIdx.x / p.cs;
  const int r0 = split_point(cl, p.rt, p.ncl), r1 = split_point(cl + 1, p.rt, p.ncl);
  const int nrows = r1 - r0;
  const int gtot = p.seg[0].cg + p.seg[1].cg;
  const int gend = min((rank + 1) * p.cgc, gtot);

  // this warp's groups: segment, first block (row r0) and row stride, in uint4
  const uint4* gp[NG];
  uint32_t gstride[NG];  // in uint4; 32 bits (one register a group less): launch_gemv checks the size
  bool gv[NG], gb[NG];
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    const int gg = rank * p.cgc + warp * NG + g;
    gv[g] = gg < gend;
    gb[g] = PR::TWO && gg >= p.seg[0].cg;
    const int blk4 = 8 * (gb[g] ? DB::WPG : DA::WPG);
    gstride[g] = static_cast<uint32_t>(gb[g] ? p.seg[1].cg : p.seg[0].cg) * blk4;
    gp[g] = (gb[g] ? p.seg[1].codes : p.seg[0].codes) + static_cast<size_t>(r0) * gstride[g] +
            static_cast<size_t>(gg - (gb[g] ? p.seg[0].cg : 0)) * blk4;
  }
  uint32_t code[RR][NG][WMAX];
  if constexpr (PR::TWO)  // the first half's groups skip the predicated word: defined
#pragma unroll
    for (int i = 0; i < RR * NG; ++i) code[i / NG][i % NG][DA::WPG] = 0u;
  auto load_item = [&](uint32_t (&c)[NG][WMAX], int it) {
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      if (!gv[g]) {  // past the K end: zero codes (one decoder decodes them against zero activations)
        if (!PR::TWO)
#pragma unroll
          for (int q = 0; q < WMAX; ++q) c[g][q] = 0u;
        continue;
      }
      const uint4* blk = gp[g] + static_cast<size_t>(static_cast<uint32_t>(it) * gstride[g]);
      if constexpr (PR::TWO) load_group_either<DA::WPG>(c[g], blk, lane, gb[g]);
      else load_group<DA::WPG>(c[g], blk, lane);
    }
  };
  // 1. the codes of the first items, then the table, while they are in flight
#pragma unroll
  for (int s = 0; s < RR - 1; ++s)
    if (s < nrows) load_item(code[s], s);
  fill_table<L>(lut, p.lut, nt);
  // 2. x may be written by the previous kernel: wait for it (no-op without PDL)
  const HkRows hk = rotation_factor_rows<PR::MIX_MMA>(p, rank);
  pdl_wait();
  if (p.signs) {
    if constexpr (PR::SHARE_ROTATION) {
      const int rrank = p.rs > 1 ? cluster_rank() : 0;
      stage_x_rotated<T, true, PR::FORMS_INPUT, PR::MIX_MMA>(p, xs, rot, rank, hk, rrank);
      if (p.rs > 1) share_rotated_rows(p, xs, rrank);
    } else {
      stage_x_rotated<T, false, PR::FORMS_INPUT, PR::MIX_MMA>(p, xs, rot, rank, hk, 0);
    }
  } else {
    stage_x<T>(p, xs, rank);
  }
  __syncthreads();
  uint32_t bx[NG * 8][2];
  {
    const int gq = lane >> 2;
    const bool xv = gq < p.m;
    const uint32_t* xr = xs + (xv ? gq : 0) * (p.cgc * 64 + 4) + warp * NG * 64 + (lane & 3);
#pragma unroll
    for (int t = 0; t < NG * 8; ++t) {
      const bool ok = xv && gv[t / 8];
      bx[t][0] = ok ? xr[8 * t] : 0u;
      bx[t][1] = ok ? xr[8 * t + 4] : 0u;
    }
  }
  __syncthreads();  // the x buffer becomes the reduction buffer

  const uint32_t lanebits = L::lane_offset(lane);
  const int nrounds = (nrows + RR - 1) / RR;
  const bool reducer = warp < RR;
  const int gq = lane >> 2;
  int buf = 0;
  for (int rd = 0; rd < nrounds; ++rd) {
    const int rl = rd * RR + warp, row = r0 + rl;
    const bool doit = reducer && row < r1;
    unsigned short sa_bits = 0, sb_bits = 0;  // this round's row scales, fetched now, used after the items
    if (doit) {
      sa_bits = ld_stream_u16(p.row_scale + row * 16 + gq);
      sb_bits = ld_stream_u16(p.row_scale + row * 16 + gq + 8);
    }
    if (!reducer && rd >= 2) asm volatile("bar.sync %0, %1;\n" ::"r"(3 + buf), "r"(nt) : "memory");
#pragma unroll
    for (int rr = 0; rr < RR; ++rr) {
      const int it = rd * RR + rr;
      if (it + RR - 1 < nrows) load_item(code[(rr + RR - 1) % RR], it + RR - 1);
      if (it < nrows) {
        float a0[4] = {0.f, 0.f, 0.f, 0.f}, a1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int g = 0; g < NG; ++g) {
          if (PR::TWO) {  // half-TCQ: a branch a group (without, its wide halves spill registers)
            if (!gv[g]) continue;
            if (gb[g]) group_mma<DB, T>(code[rr][g], lane, lut, lanebits, bx + 8 * g, a0, a1);
            else group_mma<DA, T>(code[rr][g], lane, lut, lanebits, bx + 8 * g, a0, a1);
          } else {  // every group, valid or not (zero codes against zero activations): one
                    // straight-line block whose groups the scheduler can interleave
            group_mma<DA, T>(code[rr][g], lane, lut, lanebits, bx + 8 * g, a0, a1);
          }
        }
        red[((buf * RR + rr) * nw + warp) * 32 + lane] =
            make_float4(a0[0] + a1[0], a0[1] + a1[1], a0[2] + a1[2], a0[3] + a1[3]);
      }
    }
    // the scales are converted only after the items (this empty asm orders it after their loads): a
    // conversion next to the load, where the compiler put it, stalled the reducers for its latency
    // at every round's start (ncu: 6% of a gate/up call's stall samples)
    asm volatile("" : "+h"(sa_bits), "+h"(sb_bits));
    const float sa = __half2float(__ushort_as_half(sa_bits)), sb = __half2float(__ushort_as_half(sb_bits));
    if (reducer) asm volatile("bar.sync %0, %1;\n" ::"r"(1 + buf), "r"(nt) : "memory");
    else asm volatile("bar.arrive %0, %1;\n" ::"r"(1 + buf), "r"(nt) : "memory");
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (doit) {  // row tile rd·RR + warp, summed over the warps in a fixed order
      const float4* rp = red + ((buf * RR + warp) * nw) * 32 + lane;
#pragma unroll
      for (int w2 = 0; w2 < MAX_WARPS; ++w2) {  // unrolled: the loads in flight together
        if (w2 < nw) {
          const float4 v = rp[w2 * 32];
          s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
      }
      s.x *= sa; s.y *= sa; s.z *= sb; s.w *= sb;
    }
    // this buffer is free again (the bar.sync of round rd + 2)
    if (reducer && rd + 2 < nrounds) asm volatile("bar.arrive %0, %1;\n" ::"r"(3 + buf), "r"(nt) : "memory");
    if (p.cs == 1) {
      if (doit) store_y<T>(p, row, s, lane);
    } else {
      if (rd == 0) cluster_wait();  // every CTA of the cluster has started (the arrive at the kernel's start)
      if (doit) cluster_peer(cpart, 0)[((rl % (p.fr * RR)) * p.cs + rank) * 32 + lane] = s;
      if ((rd + 1) % p.fr == 0 || rd + 1 == nrounds) flush_cluster<T>(p, cpart, r0, rd / p.fr * p.fr * RR,
                                                                        min(nrows, (rd + 1) * RR), rank, rd + 1 < nrounds);
    }
    buf ^= 1;
  }
}

// One slot of an expert launch: this CTA's row range of y row v from member j's matrix, or zeros
// when the slot's expert is not one of this launch's members (j < 0). The members and x rows are
// written by earlier kernels (the router), so they are read after griddepcontrol.wait; the body's
// own wait is then a no-op.
template <class DA, class DB, class T>
__device__ __forceinline__ void gemv_expert_slot(const GemvParams& p) {
  pdl_wait();
  const int v = blockIdx.y;
  const long long j = p.members[v];
  GemvParams q = p;
  q.y = p.y + static_cast<size_t>(v) * p.ldy * sizeof(T);
  if (j < 0) {
    if (p.cs > 1 && cluster_rank() != 0) return;
    const int cl = blockIdx.x / p.cs;
    const int r0 = split_point(cl, p.rt, p.ncl) * 16, r1 = split_point(cl + 1, p.rt, p.ncl) * 16;
    T* y = reinterpret_cast<T*>(q.y);
    for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) y[r] = Cvt<T>::from_float(0.f);
    return;
  }
  const long long* e = p.experts + 4 * j;
  q.seg[0].codes = reinterpret_cast<const uint4*>(e[0]);
  q.seg[1].codes = e[1] ? reinterpret_cast<const uint4*>(e[1]) : q.seg[0].codes;
  q.row_scale = reinterpret_cast<const __half*>(e[2]);
  q.signs = p.signs ? reinterpret_cast<const uint8_t*>(e[3]) : nullptr;
  q.x = p.x + static_cast<size_t>(p.x_rows[v]) * p.ldx * sizeof(T);
  q.m = 1;
  gemv_body<DA, DB, T>(q);
}

template <class DA, class DB, class T>
__global__ void __launch_bounds__(MAX_WARPS * 32, 1) gemv_kernel(const GemvParams p) {
  if (p.members) gemv_expert_slot<DA, DB, T>(p);
  else gemv_body<DA, DB, T>(p);
}

// ---- dequantize: one warp a block (grid-stride), W_r = decode ⊙ row_scale in dtype ----------------

struct DequantParams {
  Segment seg[2];
  const __half* row_scale;
  const uint32_t* lut;
  char* w;
  int rt, cols;
};

template <class D, class T, bool SECOND = false>  // SECOND: half-TCQ's second half (load_group_second)
__device__ __forceinline__ void dequant_group(const DequantParams& p, const Segment& s, int i, int g,
                                              const uint32_t* lut, int lane) {
  uint32_t c[D::WPG], nb[D::HALO ? D::HALO * D::WPG : 1];
  const uint4* blk = s.codes + (static_cast<size_t>(i) * s.cg + g) * 8 * D::WPG;
  if constexpr (SECOND) load_group_second<D::WPG - 1>(c, blk, lane);
  else load_group<D::WPG>(c, blk, lane);
  halo<D>(c, nb, lane);
  const uint32_t lanebits = D::L::lane_offset(lane);
  const int gq = lane >> 2, cq = lane & 3;
  const float sa = __half2float(p.row_scale[i * 16 + gq]), sb = __half2float(p.row_scale[i * 16 + gq + 8]);
  T* out = reinterpret_cast<T*>(p.w);
  auto one = [&](auto u_const) {
    constexpr int U = decltype(u_const)::value;
    const int lt = g * 8 + U;
    if (lt >= s.ct) return;
    uint32_t a[4];
    D::template tile<U>(c, nb, lut, lanebits, a);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int rr = i * 16 + gq + 8 * (k & 1);
      const int cc = s.col0 + lt * 16 + 2 * cq + 8 * (k >> 1);
      const float sc = k & 1 ? sb : sa;
      const T* in = reinterpret_cast<const T*>(&a[k]);
      T v[2] = {Cvt<T>::from_float(Cvt<T>::to_float(in[0]) * sc), Cvt<T>::from_float(Cvt<T>::to_float(in[1]) * sc)};
      *reinterpret_cast<uint32_t*>(out + static_cast<long long>(rr) * p.cols + cc) = *reinterpret_cast<uint32_t*>(v);
    }
  };
  one(std::integral_constant<int, 0>{}); one(std::integral_constant<int, 1>{});
  one(std::integral_constant<int, 2>{}); one(std::integral_constant<int, 3>{});
  one(std::integral_constant<int, 4>{}); one(std::integral_constant<int, 5>{});
  one(std::integral_constant<int, 6>{}); one(std::integral_constant<int, 7>{});
}

template <class DA, class DB, class T>
__global__ void __launch_bounds__(256) dequant_kernel(const DequantParams p) {
  using L = typename Pair<DA, DB>::L;
  extern __shared__ __align__(16) uint32_t smem[];
  fill_table_any<L>(smem, p.lut);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int gtot = p.seg[0].cg + p.seg[1].cg;
  const long long total = static_cast<long long>(p.rt) * gtot;
  const long long nwarps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
  for (long long b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < total; b += nwarps) {
    const int i = static_cast<int>(b / gtot), gg = static_cast<int>(b - static_cast<long long>(i) * gtot);
    if (Pair<DA, DB>::TWO && gg >= p.seg[0].cg) dequant_group<DB, T, true>(p, p.seg[1], i, gg - p.seg[0].cg, smem, lane);
    else dequant_group<DA, T>(p, p.seg[0], i, gg, smem, lane);
  }
}

// ---- host launchers ------------------------------------------------------------------------------

inline void segments(const Codes& c, Segment (&seg)[2]) {
  seg[0] = {static_cast<const uint4*>(c.a), c.groups_a, c.tiles_a, 0};
  seg[1] = {static_cast<const uint4*>(c.b ? c.b : c.a), c.b ? c.groups_b : 0, c.b ? c.tiles_b : 0,
            c.tiles_a * 16};
}

// Co-resident CTAs (cs = 1) or clusters (cs > 1) of this kernel configuration, cached: the query
// costs more than a launch.
template <class K>
int resident(K kern, const cudaLaunchConfig_t& cfg, int cs, int num_sms, int dev, int& out) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, unsigned, size_t>, int> cache;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kern), dev, cs, cfg.blockDim.x, cfg.dynamicSmemBytes);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int n = 0;
    cudaError_t e;
    if (cs > 1) {
      e = cudaOccupancyMaxActiveClusters(&n, kern, &cfg);
    } else {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, cfg.blockDim.x, cfg.dynamicSmemBytes);
    }
    if (e != cudaSuccess) return e;
    it = cache.emplace(key, n).first;
  }
  // per SM for single CTAs; clusters: at most num_sms / cs of them, at least one if any fits (num_sms
  // may vary); 0: this configuration cannot be placed at all
  out = cs > 1 ? std::min(it->second, std::max(1, num_sms / cs)) : it->second * num_sms;
  return cudaSuccess;
}

template <class DA, class DB, class T>
int launch_gemv(const GemvArgs& a) {
  using PR = Pair<DA, DB>;
  using L = typename PR::L;
  auto kern = gemv_kernel<DA, DB, T>;
  DeviceInfo dev;
  if (int e = current_device(dev)) return e;
  GemvParams p{};
  segments(a.codes, p.seg);
  const int gtot = p.seg[0].cg + p.seg[1].cg;
  p.rt = a.rows / 16;
  const int nslot = a.members ? a.slots : 1;
  if (p.rt == 0 || a.m == 0 || nslot == 0) return OK;
  for (const Segment& s : p.seg)  // gemv_body's row offsets are 32-bit, in 16 bytes: < 64 GB of codes a segment
    if (static_cast<long long>(p.rt) * s.cg * 8 * PR::WMAX >= (1ll << 32)) return UNSUPPORTED;
  if (a.members && a.m != 1) return UNSUPPORTED;
  // the smallest K split (1 CTA, or clusters of 2, 4, 8 on Hopper) whose warps and shared memory fit
  int cs = 0, nw = 0, cgc = 0, fr = 1;
  size_t smem = 0;
  const bool rotate = a.signs != nullptr;
  const int p2 = rotate ? a.cols / a.rot_k : 0;
  const bool norm = a.norm_w != nullptr;
  if (a.gated && (!rotate || a.members || !PR::FORMS_INPUT || norm)) return UNSUPPORTED;
  if (norm && (!rotate || a.rot_k != 1 || a.members || !PR::FORMS_INPUT)) return UNSUPPORTED;
  if ((a.x_add != nullptr) != (a.h_out != nullptr) || (a.x_add && !norm) || (a.y_add && a.members)) return UNSUPPORTED;
  if (rotate && (p2 * a.rot_k != a.cols || a.rot_k > 64 || p2 < 8 || p2 > 4096 || (p2 & (p2 - 1)) != 0 || gtot * 128 != a.cols ||
                 (a.rot_k > 1) != (a.hk_neg != nullptr)))
    return UNSUPPORTED;
  for (int c = 1; c <= (dev.major >= 9 ? 8 : 1); c *= 2) {
    // at least RR warps: round r's row tiles are reduced by warps 0..RR-1, so a CTA with fewer
    // warps would skip rows whenever it owns more than one row tile (narrow inputs, or expert
    // launches whose slots share the SMs)
    const int g = (gtot + c - 1) / c, w = std::max((g + NG - 1) / NG, static_cast<int>(PR::RR));
    if (rotate && (g * c != gtot || (g * 128) % p2 != 0)) continue;  // every CTA: whole segments
    if (rotate && a.rot_k > 1 && c > 4) continue;  // the signed row staged in z: 2·cols ≤ 8·cols/c bytes
    if (norm && c > 1) break;  // the norm's sum of squares: the whole row in one CTA
    for (int f = c > 1 ? MAX_FLUSH_ROUNDS : 1; f >= 1 && cs == 0; f /= 2) {
      const size_t s = gemv_smem<L>(PR::RR, w, g, c, f, a.m, rotate ? g * 128 : 0);
      if (w <= MAX_WARPS && s <= static_cast<size_t>(dev.smem_optin)) cs = c, nw = w, cgc = g, fr = f, smem = s;
    }
    if (cs) break;
  }
  if (cs == 0) return UNSUPPORTED;
  // batch > 1 with the rotation fused, K = 1 and no K split: a cluster of the next power of two ≥ m
  // CTAs (≤ 8) splits the rows' transforms (share_rotated_rows)
  int rs = 1;
  if (PR::SHARE_ROTATION && rotate && a.rot_k == 1 && cs == 1 && a.m > 1 && !a.members && !norm && dev.major >= 9)
    while (rs < a.m && rs < MAX_ROTATION_CLUSTER) rs *= 2;
  static bool attr_set[64];
  if (!attr_set[dev.index]) {
    if (cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, dev.smem_optin)) return e;
    attr_set[dev.index] = true;
  }
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(nw * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(a.stream);
  cfg.attrs = attrs;
  int slots = 0;
  for (;;) {  // a rotation cluster that cannot be placed: one CTA a cluster, transforming every row
    const int cdim = cs > 1 ? cs : rs;  // the launch's cluster size
    cfg.numAttrs = 0;
    if (cdim > 1) attrs[cfg.numAttrs++] = cluster_attribute(cdim);
    cfg.gridDim = dim3(cdim);  // the occupancy query wants a whole cluster
    if (int e = resident(kern, cfg, cdim, a.num_sms, dev.index, slots)) {
      if (rs == 1) return e;
      cudaGetLastError();  // a rotation cluster the query refuses: as one that cannot be placed
      slots = 0;
    }
    if (slots > 0 || rs == 1) break;
    rs = 1;
  }
  if (slots == 0) return UNSUPPORTED;  // the op then dequantizes
  const int per_slot = slots / nslot > 0 ? slots / nslot : 1;  // an expert launch shares the SMs among its slots
  p.ncl = p.rt < per_slot ? p.rt : per_slot;
  if (rs > 1) p.ncl = std::max(rs, (std::min(p.rt, slots * rs) / rs) * rs);  // whole clusters of CTAs (some may own no rows)
  if (static_cast<long long>(p.rt) * (p.ncl + 1) >= (1ll << 32)) return UNSUPPORTED;  // split_point's 32 bits
  p.cs = cs;
  p.fr = fr;
  p.cgc = cgc;
  p.nw = nw;
  p.rs = rs;
  p.x = static_cast<const char*>(a.x);
  p.ldx = a.ldx;
  p.y = static_cast<char*>(a.y);
  p.ldy = a.ldy;
  p.row_scale = static_cast<const __half*>(a.row_scale);
  p.lut = static_cast<const uint32_t*>(a.lut);
  p.m = a.m;
  p.signs = static_cast<const uint8_t*>(a.signs);
  p.hk_neg = static_cast<const unsigned long long*>(a.hk_neg);
  p.rot_k = a.rot_k;
  p.gated = a.gated;
  p.norm_w = static_cast<const char*>(a.norm_w);
  p.norm_eps = a.norm_eps;
  p.x_add = static_cast<const char*>(a.x_add);
  p.h_out = static_cast<char*>(a.h_out);
  p.y_add = static_cast<const char*>(a.y_add);
  p.log2p2 = rotate ? __builtin_ctz(p2) : 0;
  p.rot_scale = rotate ? 1.0f / sqrtf(static_cast<float>(a.cols)) : 1.0f;
  p.experts = static_cast<const long long*>(a.experts);
  p.members = static_cast<const long long*>(a.members);
  p.x_rows = static_cast<const long long*>(a.x_rows);
  cfg.gridDim = dim3(p.ncl * cs, nslot);
  if (a.pdl && dev.major >= 9) attrs[cfg.numAttrs++] = pdl_attribute();
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, kern, p)) return e;
  return cudaGetLastError();
}

template <class DA, class DB, class T>
int launch_dequant(const DequantArgs& a) {
  using L = typename Pair<DA, DB>::L;
  auto kern = dequant_kernel<DA, DB, T>;
  constexpr size_t smem = size_t(L::WORDS) * 4;
  DeviceInfo dev;
  if (int e = current_device(dev)) return e;
  static bool attr_set[64];
  if (!attr_set[dev.index]) {
    if (cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) return e;
    attr_set[dev.index] = true;
  }
  DequantParams p{};
  segments(a.codes, p.seg);
  p.row_scale = static_cast<const __half*>(a.row_scale);
  p.lut = static_cast<const uint32_t*>(a.lut);
  p.w = static_cast<char*>(a.w);
  p.rt = a.rows / 16;
  p.cols = a.cols;
  const long long blocks = static_cast<long long>(p.rt) * (p.seg[0].cg + p.seg[1].cg);
  if (blocks == 0) return OK;
  long long grid = (blocks + 8 * 8 - 1) / (8 * 8);  // ≥ 8 blocks a warp
  if (grid > a.num_sms) grid = a.num_sms;
  kern<<<static_cast<int>(grid), 256, smem, static_cast<cudaStream_t>(a.stream)>>>(p);
  return cudaGetLastError();
}

}  // namespace qp
