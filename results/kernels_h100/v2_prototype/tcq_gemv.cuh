// Fused TCQ dequantize + GEMV/small-GEMM (batch 1..8), persistent, lane-major code layout.
//
// Grid: one CTA per SM (persistent), optionally grouped in clusters of CS CTAs that split K.
// Cluster q owns row tiles [q*RT/ncl, (q+1)*RT/ncl); CTA rank r of the cluster owns K tiles
// [r*CT/CS, (r+1)*CT/CS); warp w of the CTA owns KT consecutive K tiles of that range for the whole
// kernel and keeps their activation B fragments (2 registers a tile) in registers.
// Each warp walks the CTA's row tiles; an "item" = (row tile, the warp's KT K tiles) = KT/8 layout
// blocks, read with coalesced 16-byte loads straight into registers, RR-1 items ahead (ring of RR).
// Decode per lane per tile: windows from own words + halo words of lane+1 (one shuffle a word),
// then per step h = w*w + w (IMAD), offset = (h << 1 & 0x1FF80) | lane << 2, one LDS from the
// 32-copy sign-folded table (128 KB, conflict-free), then one mma.m16n8k16 per tile.
// After every RR row tiles (a "round") each warp stores its 16x8 fp32 partials to shared memory,
// one __syncthreads, warps 0..RR-1 sum the NW partials in a fixed order (deterministic), scale by
// row_scale and store fp16 y; with CS > 1 the CTA partials go to rank 0 through distributed
// shared memory and rank 0 finishes after a cluster barrier. No global atomics, no workspace.
#pragma once
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tcq_common.cuh"

namespace kv2 {

struct GemvParams {
  const uint4* codes;       // new layout
  const __half* row_scale;  // N
  const uint32_t* T;        // 512 fp16 pairs
  const __half* x;          // m x K
  __half* y;                // m x N
  int m, N, K;
  int RT, CT, CG;           // row tiles, column tiles, column groups (CT / 8)
  int ncl;                  // clusters (= CTAs when CS == 1)
  int pdl;                  // launched as a programmatic dependent launch
  int stagger;              // issue the first item's codes before the deeper prefetches
};
constexpr int MAX_ROWS = 64;  // row tiles a cluster at most (row scales staged in shared memory)

constexpr int LUT_WORDS = 32768;  // 1024 entries x 32 copies

// x staging: 8 rows of K/CS halves, row stride K/CS/2 + 4 words (conflict-free B fragment reads)
template <int NW, int RR, int CS>
__host__ __device__ constexpr size_t red_bytes() {
  return size_t(2) * RR * NW * 32 * 16;
}
__host__ __device__ constexpr size_t xs_bytes(int kc) { return size_t(8) * (kc / 2 + 4) * 4; }
template <int NW, int RR, int CS>
size_t gemv_smem_bytes(int K) {
  const size_t u = red_bytes<NW, RR, CS>() > xs_bytes(K / CS) ? red_bytes<NW, RR, CS>() : xs_bytes(K / CS);
  return LUT_WORDS * 4 + u + (CS > 1 ? size_t(2) * CS * RR * 32 * 16 : 0) + MAX_ROWS * 16 * 2;
}

__device__ __forceinline__ uint4 ldg_stream4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg_stream2(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int KV, int NG>
__device__ __forceinline__ void load_item(uint32_t (&c)[NG * KV], const uint4* item, int lane) {
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    const uint4* blk = item + g * (8 * KV);  // a block is 32 lanes x KV words = 8*KV uint4
    if constexpr (KV == 4) {
      const uint4 v = ldg_stream4(blk + lane);
      c[g * 4 + 0] = v.x; c[g * 4 + 1] = v.y; c[g * 4 + 2] = v.z; c[g * 4 + 3] = v.w;
    } else if constexpr (KV == 8) {
      const uint4 v0 = ldg_stream4(blk + lane), v1 = ldg_stream4(blk + 32 + lane);
      c[g * 8 + 0] = v0.x; c[g * 8 + 1] = v0.y; c[g * 8 + 2] = v0.z; c[g * 8 + 3] = v0.w;
      c[g * 8 + 4] = v1.x; c[g * 8 + 5] = v1.y; c[g * 8 + 6] = v1.z; c[g * 8 + 7] = v1.w;
    } else {
      const uint4 v0 = ldg_stream4(blk + lane);
      const uint2 v1 = ldg_stream2(reinterpret_cast<const uint2*>(blk + 32) + lane);
      c[g * 6 + 0] = v0.x; c[g * 6 + 1] = v0.y; c[g * 6 + 2] = v0.z; c[g * 6 + 3] = v0.w;
      c[g * 6 + 4] = v1.x; c[g * 6 + 5] = v1.y;
    }
  }
}

template <int KV, int KT, int NW, int RR, int CS>
__global__ void __launch_bounds__(NW * 32, 1) tcq_gemv(const GemvParams p) {
  static_assert(KT % 8 == 0 && RR >= 2 && RR <= NW, "config");
  constexpr int NG = KT / 8;
  constexpr int WPI = NG * KV;  // code words a lane holds for one item
  constexpr int BLK4 = 8 * KV;  // uint4 a block
  constexpr int NT = NW * 32;
  extern __shared__ __align__(16) uint32_t smem[];
  uint32_t* lut = smem;
  float4* red = reinterpret_cast<float4*>(smem + LUT_WORDS);  // [2][RR][NW][32]
  uint32_t* xs = smem + LUT_WORDS;                            // same region, used before red
  const int kc = p.K / CS;                                    // K columns of this CTA
  const int xsw = kc / 2 + 4;                                 // words a staged x row
  const size_t ubytes = red_bytes<NW, RR, CS>() > xs_bytes(kc) ? red_bytes<NW, RR, CS>() : xs_bytes(kc);
  float4* cpart = reinterpret_cast<float4*>(reinterpret_cast<char*>(red) + ubytes);  // [2][CS][RR][32]
  __half* sc = reinterpret_cast<__half*>(cpart + (CS > 1 ? 2 * CS * RR * 32 : 0));    // [MAX_ROWS*16]

  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // let the next kernel queue up
  __builtin_assume(threadIdx.x < NT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int rank = 0;
  if constexpr (CS > 1) rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
  const int cl = blockIdx.x / CS;
  const int r0 = cl * p.RT / p.ncl;  // 32-bit: RT * ncl < 2^31
  const int r1 = (cl + 1) * p.RT / p.ncl;
  const int nrows = r1 - r0;
  const int kt0 = rank * (p.CT / CS) + warp * KT;  // first K tile of this warp
  const size_t row4 = static_cast<size_t>(p.CG) * BLK4;
  const uint4* cbase = p.codes + static_cast<size_t>(r0) * row4 + static_cast<size_t>(kt0 / 8) * BLK4;

  // 1. codes of the first RR-1 items in flight
  // (p.stagger: only item 0 now, items 1..RR-2 after the table fill, so that every warp's first
  // item comes back from DRAM before the deeper prefetches of the other warps)
  uint32_t code[RR][WPI];
#pragma unroll
  for (int s = 0; s < RR - 1; ++s)
    if (s < nrows && (s == 0 || !p.stagger)) load_item<KV, NG>(code[s], cbase + s * row4, lane);

  // 2. every other global load of the prologue in flight too: table, row scales, x (x only when
  // this is not a programmatic dependent launch: then x may still be written by the previous kernel)
  static_assert(NT % 8 == 0, "NT");
  constexpr int EPT = NT / 8;                 // table entries a pass (8 threads x 4 copies each)
  constexpr int PER = (512 + EPT - 1) / EPT;  // passes over the 512 entries of T
  const int e0 = threadIdx.x >> 3;            // this thread: entries e0 + k*EPT (+512 negated)
  const uint32_t* tsrc = p.T + e0;
  uint32_t tv[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) tv[k] = (e0 + k * EPT < 512) ? __ldg(tsrc + k * EPT) : 0u;
  const bool sc_ld = threadIdx.x < nrows * 2;  // 8 halves a thread
  uint4 scv = make_uint4(0, 0, 0, 0);
  if (sc_ld) scv = __ldg(reinterpret_cast<const uint4*>(p.row_scale + r0 * 16) + threadIdx.x);
  const int n4 = kc / 8;  // uint4 a row of x (<= NT for our configs: one uint4 a thread a row)
  const bool xth = threadIdx.x < n4;
  const uint4* xsrc = reinterpret_cast<const uint4*>(p.x + rank * kc) + threadIdx.x;
  uint4 xv4[8];
  auto load_x = [&]() {
#pragma unroll
    for (int r = 0; r < 8; ++r)
      if (r < p.m && xth) xv4[r] = __ldg(xsrc + static_cast<size_t>(r) * (p.K / 8));
  };
  if (!p.pdl) load_x();
  // 3. the table: word (e, c) at e*32 + c = T[e & 511], x sign flipped for e >= 512
  {
    uint4* l4 = reinterpret_cast<uint4*>(lut) + e0 * 8 + (threadIdx.x & 7);
#pragma unroll
    for (int k = 0; k < PER; ++k)
      if (e0 + k * EPT < 512) {
        const uint32_t v = tv[k], vn = v ^ 0x8000u;
        l4[k * EPT * 8] = make_uint4(v, v, v, v);
        l4[(512 + k * EPT) * 8] = make_uint4(vn, vn, vn, vn);
      }
  }
  if (p.stagger) {
#pragma unroll
    for (int s = 1; s < RR - 1; ++s)
      if (s < nrows) load_item<KV, NG>(code[s], cbase + s * row4, lane);
  }
  // with programmatic dependent launch everything above overlaps the previous kernel's tail
  if (p.pdl) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    load_x();
  }
#pragma unroll
  for (int r = 0; r < 8; ++r)
    if (r < p.m && xth) *reinterpret_cast<uint4*>(xs + r * xsw + 4 * threadIdx.x) = xv4[r];
  if constexpr (CS > 1)
    cooperative_groups::this_cluster().sync();  // also: every CTA of the cluster has started (DSMEM)
  else
    __syncthreads();
  // activation B fragments of the warp's K slice, kept in registers (zeros for rows >= m)
  uint32_t bx[KT][2];
  {
    const int gq = lane >> 2;
    const bool xv = gq < p.m;
    const uint32_t* xr = xs + (xv ? gq : 0) * xsw + warp * KT * 8 + (lane & 3);
#pragma unroll
    for (int t = 0; t < KT; ++t) {
      bx[t][0] = xv ? xr[8 * t] : 0u;
      bx[t][1] = xv ? xr[8 * t + 4] : 0u;
    }
  }
  __syncthreads();  // the x buffer becomes the reduction buffer

  const uint32_t lanebits = static_cast<uint32_t>(lane) << 2;  // this lane's copy of the table
  const char* lut_c = reinterpret_cast<const char*>(lut);
  const int src = (lane + 1) & 31;
  const int nrounds = (nrows + RR - 1) / RR;
  const bool reducer = warp < RR;
  int buf = 0;
  for (int rd = 0; rd < nrounds; ++rd) {
    // CS == 1: producer/consumer named barriers instead of a CTA-wide barrier a round. Warps
    // >= RR never wait for the reduction, only (rarely) for the buffer of round rd - 2 to be read.
    if (CS == 1 && !reducer && rd >= 2) asm volatile("bar.sync %0, %1;\n" ::"r"(3 + buf), "n"(NT) : "memory");
#pragma unroll
    for (int rr = 0; rr < RR; ++rr) {
      const int it = rd * RR + rr;
      if (it + RR - 1 < nrows) load_item<KV, NG>(code[(rr + RR - 1) % RR], cbase + (it + RR - 1) * row4, lane);
      if (it < nrows) {
        float a0[4] = {0.f, 0.f, 0.f, 0.f}, a1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int g = 0; g < NG; ++g) {
          uint32_t nb[KV];
#pragma unroll
          for (int q = 0; q < KV; ++q) nb[q] = __shfl_sync(0xffffffffu, code[rr][g * KV + q], src);
          uint32_t w[8][4];
          Lay<KV>::windows(&code[rr][g * KV], nb, w);
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            uint32_t a[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) a[k] = *reinterpret_cast<const uint32_t*>(lut_c + lut_off(w[u][k], lanebits));
            if (u & 1)
              mma16816(a1, a, bx[g * 8 + u][0], bx[g * 8 + u][1]);
            else
              mma16816(a0, a, bx[g * 8 + u][0], bx[g * 8 + u][1]);
          }
        }
        red[((buf * RR + rr) * NW + warp) * 32 + lane] =
            make_float4(a0[0] + a1[0], a0[1] + a1[1], a0[2] + a1[2], a0[3] + a1[3]);
      }
    }
    if (rd == 0 && sc_ld) reinterpret_cast<uint4*>(sc)[threadIdx.x] = scv;  // row scales (DRAM) off the prologue
    if constexpr (CS == 1) {
      if (reducer)
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + buf), "n"(NT) : "memory");
      else
        asm volatile("bar.arrive %0, %1;\n" ::"r"(1 + buf), "n"(NT) : "memory");
    } else {
      __syncthreads();
    }
    // reduce round rd: warp rr sums row tile rd*RR + rr over the NW warps (fixed order)
    const int rl = rd * RR + warp, row = r0 + rl;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    const bool doit = reducer && row < r1;
    if (doit) {
      const float4* rp = red + ((buf * RR + warp) * NW) * 32 + lane;
#pragma unroll
      for (int w2 = 0; w2 < NW; ++w2) {
        const float4 v = rp[w2 * 32];
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
    }
    if constexpr (CS == 1) {  // this buffer is free again (matched by the bar.sync of round rd + 2)
      if (reducer && rd + 2 < nrounds) asm volatile("bar.arrive %0, %1;\n" ::"r"(3 + buf), "n"(NT) : "memory");
    }
    if constexpr (CS > 1) {
      auto cluster = cooperative_groups::this_cluster();
      if (doit) {
        float4* dst = cluster.map_shared_rank(cpart, 0);
        dst[((buf * CS + rank) * RR + warp) * 32 + lane] = s;
      }
      cluster.sync();
      if (rank == 0 && doit) {
        s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          const float4 v = cpart[((buf * CS + c) * RR + warp) * 32 + lane];
          s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
      }
    }
    if (doit && rank == 0) {
      const int gq = lane >> 2, n0 = 2 * (lane & 3), n1 = n0 + 1;
      const int ra = row * 16 + gq, rb = ra + 8;
      const float sa = __half2float(sc[rl * 16 + gq]), sb = __half2float(sc[rl * 16 + gq + 8]);
      if (n0 < p.m) {
        p.y[static_cast<size_t>(n0) * p.N + ra] = __float2half_rn(s.x * sa);
        p.y[static_cast<size_t>(n0) * p.N + rb] = __float2half_rn(s.z * sb);
      }
      if (n1 < p.m) {
        p.y[static_cast<size_t>(n1) * p.N + ra] = __float2half_rn(s.y * sa);
        p.y[static_cast<size_t>(n1) * p.N + rb] = __float2half_rn(s.w * sb);
      }
    }
    buf ^= 1;
  }
}

}  // namespace kv2
