// Fused dequantize + matmul (batch 1..8) and the dequantize kernel (batch > 8: then cuBLAS).
//
// Work split ("stream-K"): the tiles of one code tensor, in storage order (row tile i, column
// tile j), are one contiguous stream of T = RT·CT tiles. Warp w of NW takes tiles
// [w·T/NW, (w+1)·T/NW): a contiguous range of words that it streams through shared memory with
// cp.async (S stages of ST tiles). Each lane decodes its 8 weights of a tile into A registers,
// the activations (batch ≤ 8 rows) are the B operand of one mma.m16n8k16 per tile (n = 8), and
// the fp32 accumulators of a row tile are flushed when the warp leaves it. A row tile touched
// by one warp is written directly; otherwise partial sums go to an fp32 workspace by atomics and
// the last warp to arrive (counter per row tile) scales, converts and writes the 16 rows, then
// puts workspace and counter back to zero — one launch, no memset, replayable in CUDA graphs.
// half-TCQ runs its two halves as blockIdx.y = 0, 1 of the same launch into the same workspace.
#pragma once

#include <cuda_runtime.h>

#include "qpalette_decode.cuh"
#include "qpalette_kernels.h"

namespace qp {

// Warps a block and pipeline depth, by the widest tile (words). Measured on H100: 12 warps a
// block (80 registers, 24 warps an SM) ran no faster than 8 (96 registers, 16 warps an SM) on
// 14336x4096 and slower on small layers, so 8 for every width.
template <int WMAX>
struct Cfg {
  static constexpr int NWB = 8;
  static constexpr int STAGES = 4;
};
constexpr int ST = 8;    // tiles a stage
constexpr int MIN_TILES_PER_WARP = 8;

struct QmmKParams {
  const uint32_t* codes[2];
  const char* x;  // bytes
  long long ldx;  // elements
  char* y;
  long long ldy;
  const __half* row_scale;
  const uint32_t* lut;
  float* ws;
  int* cnt;
  int m;
  int rt, ct;     // row tiles, column tiles of one half
  long long t;    // rt·ct
  int nw;         // working warps of one half
  int halves;
};

// Replicate the E-entry table C times into shared memory. Phase 1 puts the E entries (≤ 4096
// words) in `raw` with all loads in flight at once; phase 2 spreads them with 16-byte stores.
// Ends with __syncthreads.
template <class G>
__device__ __forceinline__ void fill_lut(uint32_t* lut, uint32_t* raw, const uint32_t* src) {
  constexpr int PER = (G::E + 255) / 256;
  uint32_t v[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int e = threadIdx.x + k * 256;
    v[k] = (e < G::E && threadIdx.x < 256) ? __ldg(src + e) : 0u;
  }
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int e = threadIdx.x + k * 256;
    if (e < G::E && threadIdx.x < 256) raw[e] = v[k];
  }
  __syncthreads();
  if constexpr (G::C >= 4) {
    uint4* l4 = reinterpret_cast<uint4*>(lut);
    for (int i = threadIdx.x; i < G::WORDS / 4; i += blockDim.x) {
      const uint32_t e = raw[(4 * i) >> G::LOGC];
      l4[i] = make_uint4(e, e, e, e);
    }
  } else {
    for (int i = threadIdx.x; i < G::WORDS; i += blockDim.x) lut[i] = raw[i >> G::LOGC];
  }
  __syncthreads();
}

__device__ __forceinline__ int warp_of_tile(long long t, long long total, int nw) {
  return static_cast<int>(((t + 1) * nw - 1) / total);
}

template <class T>
__device__ __forceinline__ void store_out(char* y, long long ldy, int n, int r, float v) {
  reinterpret_cast<T*>(y)[n * ldy + r] = Act<T>::from_float(v);
}

// Flush the accumulators of row tile `row` (lane holds rows g, g+8 × batch columns 2c, 2c+1).
// Not inlined: it runs once a row tile, and inlining it into the unrolled tile loop bloats it.
template <class T>
__device__ __noinline__ void flush(const QmmKParams& p, int row, float a0, float a1, float a2,
                                   float a3, int lane) {
  const float acc[4] = {a0, a1, a2, a3};
  const int g = lane >> 2, c = lane & 3;
  const int r0 = row * 16 + g, r1 = r0 + 8;
  const int n0 = 2 * c, n1 = 2 * c + 1;
  const long long first = static_cast<long long>(row) * p.ct;
  const int expected =
      (warp_of_tile(first + p.ct - 1, p.t, p.nw) - warp_of_tile(first, p.t, p.nw) + 1) * p.halves;
  if (expected == 1) {
    const float s0 = __half2float(p.row_scale[r0]), s1 = __half2float(p.row_scale[r1]);
    if (n0 < p.m) {
      store_out<T>(p.y, p.ldy, n0, r0, acc[0] * s0);
      store_out<T>(p.y, p.ldy, n0, r1, acc[2] * s1);
    }
    if (n1 < p.m) {
      store_out<T>(p.y, p.ldy, n1, r0, acc[1] * s0);
      store_out<T>(p.y, p.ldy, n1, r1, acc[3] * s1);
    }
    return;
  }
  float* w0 = p.ws + r0 * 8;
  float* w1 = p.ws + r1 * 8;
  if (n0 < p.m) {
    atomicAdd(w0 + n0, acc[0]);
    atomicAdd(w1 + n0, acc[2]);
  }
  if (n1 < p.m) {
    atomicAdd(w0 + n1, acc[1]);
    atomicAdd(w1 + n1, acc[3]);
  }
  __syncwarp();
  int old = 0;
  if (lane == 0) {
    __threadfence();  // cumulative: orders the whole warp's adds (syncwarp above) before the count
    old = atomicAdd(p.cnt + row, 1);
  }
  old = __shfl_sync(0xffffffffu, old, 0);
  if (old != expected - 1) return;
  __threadfence();
  const float s0 = __half2float(p.row_scale[r0]), s1 = __half2float(p.row_scale[r1]);
  if (n0 < p.m) {
    store_out<T>(p.y, p.ldy, n0, r0, __ldcg(w0 + n0) * s0);
    store_out<T>(p.y, p.ldy, n0, r1, __ldcg(w1 + n0) * s1);
    __stcg(w0 + n0, 0.f);
    __stcg(w1 + n0, 0.f);
  }
  if (n1 < p.m) {
    store_out<T>(p.y, p.ldy, n1, r0, __ldcg(w0 + n1) * s0);
    store_out<T>(p.y, p.ldy, n1, r1, __ldcg(w1 + n1) * s1);
    __stcg(w0 + n1, 0.f);
    __stcg(w1 + n1, 0.f);
  }
  if (lane == 0) atomicExch(p.cnt + row, 0);
}

template <class D, class T, int NW_WORDS_MAX>
__device__ __forceinline__ void qmm_half(const QmmKParams& p, int half, uint32_t* lut, uint32_t* raw,
                                         const uint32_t* lut_src, uint32_t* stage_base) {
  constexpr int NWB = Cfg<NW_WORDS_MAX>::NWB;
  constexpr int STAGES = Cfg<NW_WORDS_MAX>::STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gw = blockIdx.x * NWB + warp;
  const bool active = gw < p.nw;
  const long long start = active ? gw * p.t / p.nw : 0;
  const long long end = active ? (gw + 1) * p.t / p.nw : 0;
  const int ntiles = static_cast<int>(end - start);
  const int nst = (ntiles + ST - 1) / ST;
  uint32_t* buf = stage_base + warp * (STAGES * ST * NW_WORDS_MAX);
  const uint32_t* src = p.codes[half] + start * D::W;

  auto issue = [&](int s) {
    const uint32_t* g = src + static_cast<long long>(s) * ST * D::W + 4 * lane;
    uint32_t* d = buf + (s % STAGES) * ST * D::W + 4 * lane;
    constexpr int CHUNKS = ST * D::W / 4;  // 16-byte pieces of a full stage
    if ((s + 1) * ST <= ntiles) {          // full stage: compile-time trip count
#pragma unroll
      for (int k = 0; k < (CHUNKS + 31) / 32; ++k)
        if (CHUNKS % 32 == 0 || lane + 32 * k < CHUNKS) cp_async16(d + 128 * k, g + 128 * k);
    } else {
      const int chunks = (ntiles - s * ST) * D::W / 4;
      for (int ch = lane, k = 0; ch < chunks; ch += 32, ++k) cp_async16(d + 128 * k, g + 128 * k);
    }
  };
  // start streaming before the table fill so the loads overlap it
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nst) issue(s);
    cp_async_commit();
  }
  fill_lut<typename D::G>(lut, raw, lut_src);
  if (!active) return;

  const LaneGeom<D> geo(lane);
  const int g = lane >> 2, c = lane & 3;
  const bool xv = g < p.m;
  const T* xrow = reinterpret_cast<const T*>(p.x) + (xv ? g : 0) * p.ldx +
                  (half ? p.ct * 16 : 0) + 2 * c;
  int row = static_cast<int>(start / p.ct);
  int j = static_cast<int>(start - static_cast<long long>(row) * p.ct);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float acc2[4] = {0.f, 0.f, 0.f, 0.f};  // second chain of products: half the mma latency chain
  bool dirty = false;

  for (int it = 0; it < nst; ++it) {
    if (it + STAGES - 1 < nst) issue(it + STAGES - 1);
    cp_async_commit();
    const int nt = min(ST, ntiles - it * ST);
    const bool fast = nt == ST && j + ST < p.ct;  // a full stage inside one row tile
    // activations of this stage's tiles (B fragments), loaded before waiting on the codes
    uint32_t bx[ST][2];
    if (fast) {
      const uint32_t* xp = reinterpret_cast<const uint32_t*>(xrow + j * 16);
#pragma unroll
      for (int u = 0; u < ST; ++u) {
        bx[u][0] = xv ? __ldg(xp + 8 * u) : 0u;
        bx[u][1] = xv ? __ldg(xp + 8 * u + 4) : 0u;
      }
    } else {
#pragma unroll
      for (int u = 0; u < ST; ++u) {
        int ju = j + u;  // a stage may cross row tiles (several when CT < ST)
        ju = p.ct >= ST ? (ju >= p.ct ? ju - p.ct : ju) : ju % p.ct;
        if (xv && u < nt) {
          const uint32_t* xp = reinterpret_cast<const uint32_t*>(xrow + ju * 16);
          bx[u][0] = __ldg(xp);
          bx[u][1] = __ldg(xp + 4);
        } else {
          bx[u][0] = 0u;
          bx[u][1] = 0u;
        }
      }
    }
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const uint32_t* sb = buf + (it % STAGES) * ST * D::W;
    if (fast) {
      // common case, a full stage inside one row tile: decode all tiles, then the products
      // (branch-free, so the scheduler can overlap the tiles' table loads)
      uint32_t r[ST][4];
#pragma unroll
      for (int u = 0; u < ST; ++u) {
        uint32_t w[LaneGeom<D>::NWORDS];
#pragma unroll
        for (int i = 0; i < LaneGeom<D>::NWORDS; ++i) w[i] = sb[u * D::W + geo.off[i]];
        uint32_t a, b;
        geo.align(w, a, b);
        D::decode(a, b, lut, geo.lanebits, r[u]);
      }
#pragma unroll
      for (int u = 0; u < ST; u += 2) {
        Act<T>::mma(acc, r[u], bx[u][0], bx[u][1]);
        Act<T>::mma(acc2, r[u + 1], bx[u + 1][0], bx[u + 1][1]);
      }
      j += ST;
      dirty = true;
    } else {
#pragma unroll
      for (int u = 0; u < ST; ++u) {
        if (u < nt) {
          uint32_t w[LaneGeom<D>::NWORDS];
#pragma unroll
          for (int i = 0; i < LaneGeom<D>::NWORDS; ++i) w[i] = sb[u * D::W + geo.off[i]];
          uint32_t a, b, r[4];
          geo.align(w, a, b);
          D::decode(a, b, lut, geo.lanebits, r);
          Act<T>::mma(acc, r, bx[u][0], bx[u][1]);
          dirty = true;
          if (++j == p.ct) {
            flush<T>(p, row, acc[0] + acc2[0], acc[1] + acc2[1], acc[2] + acc2[2], acc[3] + acc2[3], lane);
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
            acc2[0] = acc2[1] = acc2[2] = acc2[3] = 0.f;
            dirty = false;
            ++row;
            j = 0;
          }
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  if (dirty) flush<T>(p, row, acc[0] + acc2[0], acc[1] + acc2[1], acc[2] + acc2[2], acc[3] + acc2[3], lane);
}

template <class DA, class DB, class T>
__global__ void __launch_bounds__(Cfg<(DA::W > DB::W ? DA::W : DB::W)>::NWB * 32, 2) qmm_kernel(QmmKParams p) {
  extern __shared__ __align__(16) uint32_t smem[];
  using G = typename DA::G;
  constexpr int WMAX = DA::W > DB::W ? DA::W : DB::W;
  uint32_t* raw = smem + G::WORDS;
  uint32_t* stage = raw + G::E;
  if (blockIdx.y == 0)
    qmm_half<DA, T, WMAX>(p, 0, smem, raw, p.lut, stage);
  else
    qmm_half<DB, T, WMAX>(p, 1, smem, raw, p.lut, stage);
}

// ---- dequantize: one warp a tile (grid-stride), writes scaled W_r in dtype --------------------
struct DqKParams {
  const uint32_t* codes[2];
  const __half* row_scale;
  const uint32_t* lut;
  char* w;
  int rt, ct;  // of one half
  int cols;
};

template <class D, class T>
__device__ __forceinline__ void dequant_half(const DqKParams& p, int half, const uint32_t* lut) {
  const int lane = threadIdx.x & 31;
  const long long nwarps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
  const long long total = static_cast<long long>(p.rt) * p.ct;
  const LaneGeom<D> geo(lane);
  const int g = lane >> 2, c = lane & 3;
  T* out = reinterpret_cast<T*>(p.w);
  for (long long t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < total; t += nwarps) {
    const uint32_t* tw = p.codes[half] + t * D::W;
    uint32_t w[LaneGeom<D>::NWORDS];
#pragma unroll
    for (int i = 0; i < LaneGeom<D>::NWORDS; ++i) w[i] = __ldg(tw + geo.off[i]);
    uint32_t a, b, r[4];
    geo.align(w, a, b);
    D::decode(a, b, lut, geo.lanebits, r);
    const int i = static_cast<int>(t / p.ct), jt = static_cast<int>(t - static_cast<long long>(i) * p.ct);
    const int col0 = (half ? p.ct * 16 : 0) + jt * 16 + 2 * c;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int rr = i * 16 + g + 8 * (k & 1);
      const int cc = col0 + 8 * (k >> 1);
      const float s = __half2float(p.row_scale[rr]);
      T v[2];
      const T* in = reinterpret_cast<const T*>(&r[k]);
      v[0] = Act<T>::from_float(Act<T>::to_float(in[0]) * s);
      v[1] = Act<T>::from_float(Act<T>::to_float(in[1]) * s);
      *reinterpret_cast<uint32_t*>(out + static_cast<long long>(rr) * p.cols + cc) =
          *reinterpret_cast<const uint32_t*>(v);
    }
  }
}

template <class DA, class DB, class T>
__global__ void __launch_bounds__(256) dequant_kernel(DqKParams p) {
  extern __shared__ __align__(16) uint32_t smem[];
  using G = typename DA::G;
  fill_lut<G>(smem, smem + G::WORDS, p.lut);
  if (blockIdx.y == 0)
    dequant_half<DA, T>(p, 0, smem);
  else
    dequant_half<DB, T>(p, 1, smem);
}

// ---- host launchers --------------------------------------------------------------------------

template <class DA, class DB, class T>
int launch_qmm(const QmmArgs& a, int halves) {
  using G = typename DA::G;
  static_assert(DA::LOG2E == DB::LOG2E, "the two halves share one table");
  constexpr int WMAX = DA::W > DB::W ? DA::W : DB::W;
  constexpr int NWB = Cfg<WMAX>::NWB;
  constexpr size_t smem = (G::WORDS + G::E + NWB * Cfg<WMAX>::STAGES * ST * WMAX) * sizeof(uint32_t);
  auto kern = qmm_kernel<DA, DB, T>;
  static int blocks_per_sm[64];  // per device, 0 = not yet queried
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return -1;
  if (blocks_per_sm[dev] == 0) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    int n = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, NWB * 32, smem);
    if (e != cudaSuccess) return e;
    blocks_per_sm[dev] = n > 0 ? n : 1;
  }
  QmmKParams p;
  p.codes[0] = static_cast<const uint32_t*>(a.codes_a);
  p.codes[1] = static_cast<const uint32_t*>(halves == 2 ? a.codes_b : a.codes_a);
  p.x = static_cast<const char*>(a.x);
  p.ldx = a.ldx;
  p.y = static_cast<char*>(a.y);
  p.ldy = a.ldy;
  p.row_scale = static_cast<const __half*>(a.row_scale);
  p.lut = static_cast<const uint32_t*>(a.lut);
  p.ws = a.ws;
  p.cnt = a.cnt;
  p.m = a.m;
  p.rt = a.rows / 16;
  p.ct = a.cols / 16 / halves;
  p.t = static_cast<long long>(p.rt) * p.ct;
  if (p.t == 0) return 0;
  long long want = (p.t + NWB * MIN_TILES_PER_WARP - 1) / (NWB * MIN_TILES_PER_WARP);
  long long cap = static_cast<long long>(blocks_per_sm[dev]) * a.num_sms;
  if (halves == 2) cap = (cap + 1) / 2;
  const int blocks = static_cast<int>(want < cap ? want : cap);
  p.nw = static_cast<int>(static_cast<long long>(blocks) * NWB < p.t ? blocks * NWB : p.t);
  p.halves = halves;
  kern<<<dim3(blocks, halves), NWB * 32, smem, static_cast<cudaStream_t>(a.stream)>>>(p);
  return cudaGetLastError();
}

template <class DA, class DB, class T>
int launch_dequant(const DequantArgs& a, int halves) {
  using G = typename DA::G;
  constexpr size_t smem = (G::WORDS + G::E) * sizeof(uint32_t);
  auto kern = dequant_kernel<DA, DB, T>;
  static bool attr[64];
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return -1;
  if (!attr[dev]) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    attr[dev] = true;
  }
  DqKParams p;
  p.codes[0] = static_cast<const uint32_t*>(a.codes_a);
  p.codes[1] = static_cast<const uint32_t*>(halves == 2 ? a.codes_b : a.codes_a);
  p.row_scale = static_cast<const __half*>(a.row_scale);
  p.lut = static_cast<const uint32_t*>(a.lut);
  p.w = static_cast<char*>(a.w);
  p.rt = a.rows / 16;
  p.ct = a.cols / 16 / halves;
  p.cols = a.cols;
  const long long tiles = static_cast<long long>(p.rt) * p.ct;
  if (tiles == 0) return 0;
  long long blocks = (tiles + 8 * 8 - 1) / (8 * 8);  // ≥ 8 tiles a warp
  const long long cap = 2LL * a.num_sms;
  if (blocks > cap) blocks = cap;
  kern<<<dim3(static_cast<int>(blocks), halves), 256, smem, static_cast<cudaStream_t>(a.stream)>>>(p);
  return cudaGetLastError();
}

}  // namespace qp
