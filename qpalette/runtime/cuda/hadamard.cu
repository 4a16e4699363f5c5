// Online Hadamard transform y = H(s ⊙ x), H = (H_K ⊗ H_{2^m})/√n (qpalette/hadamard.py), over
// each row of x; y[a·2^m + b] holds segment a, point b.
//
// hadamard_rows_kernel (2^m = 8..4096, K ≤ 64): one block per (segment a', row). Its threads first
// mix the K segments' chunk t (elements 8t..8t+7), the K terms split over slices of threads:
// w = Σ_a H_K[a', a] (s ⊙ x)[a·2^m + 8t + ·] (the K factor applied first: the two Kronecker
// factors commute), then the 2^m-point transform of w runs in
// registers, shuffles and one shared-memory transpose (qpalette_fwht.cuh) and writes segment a'.
// K = 1 is the power-of-two case. Each block reads the row (L2), so a decode row is spread over K
// blocks instead of one block redoing all butterflies. It can also form its input as it loads it
// (RotationInput): silu(gate) ⊙ up, or a residual add + RMSNorm (K = 1), so that at batch > 1 a
// decoder block needs no elementwise kernel before its rotations (runtime/modules.py).
//
// hadamard_gated_mma_kernel (silu(gate) ⊙ up with K ≤ 32 where the mix fits the tensor cores): one
// block per (group of output segments, row) forms the whole row's input once and mixes it by mma.
//
// hadamard_segments_kernel (the other shapes, up to n = 32768): one block per (row, slice): the
// row, sign-flipped, goes to shared memory in fp32; the 2^m-point butterflies run on each of the K segments; then
// each block writes its slice of the K outputs of every column b.
//
// All three read x only after `griddepcontrol.wait` and let the next kernel start its prologue at once
// (programmatic dependent launch on Hopper): the GEMV that consumes y fetches its table and first
// codes while the rotation runs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "qpalette_fwht.cuh"
#include "qpalette_hopper.cuh"
#include "qpalette_kernels.h"

namespace qp {
namespace {

template <class T>
__device__ __forceinline__ float ld(const T* p, long long i);
template <>
__device__ __forceinline__ float ld<__half>(const __half* p, long long i) { return __half2float(p[i]); }
template <>
__device__ __forceinline__ float ld<__nv_bfloat16>(const __nv_bfloat16* p, long long i) {
  return __bfloat162float(p[i]);
}
template <class T>
__device__ __forceinline__ void st(T* p, long long i, float v);
template <>
__device__ __forceinline__ void st<__half>(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
template <>
__device__ __forceinline__ void st<__nv_bfloat16>(__nv_bfloat16* p, long long i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

template <class T>
__global__ void __launch_bounds__(512) hadamard_segments_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                       const uint8_t* __restrict__ signs,
                                                       const int8_t* __restrict__ hk, int n, int k,
                                                       int p2, float scale) {
  extern __shared__ float z[];
  pdl_launch_dependents();
  pdl_wait();
  const long long row = blockIdx.x;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  // signs: bit 7 − (i mod 8) of byte i/8 set ⇔ s_i = −1. Eight elements (16 bytes of x, one
  // byte of signs) a thread and step, up to four steps' loads in flight before the first use.
  const int n8 = n >> 3;
  for (int base = 0; base < n8; base += 4 * blockDim.x) {
    uint4 v[4];
    uint32_t sg[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i8 = base + u * blockDim.x + threadIdx.x;
      if (i8 < n8) {
        v[u] = __ldg(reinterpret_cast<const uint4*>(xr) + i8);
        sg[u] = __ldg(signs + i8);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i8 = base + u * blockDim.x + threadIdx.x;
      if (i8 < n8) {
        const T* e = reinterpret_cast<const T*>(&v[u]);
        float f[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float a = ld(e, q);
          f[q] = ((sg[u] >> (7 - q)) & 1) ? -a : a;
        }
        reinterpret_cast<float4*>(z)[2 * i8] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4*>(z)[2 * i8 + 1] = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
  }
  __syncthreads();
  // butterflies of stride h < p2 over the whole row never cross a segment of length p2; up to
  // three stages (h, 2h, 4h) a pass in registers: one barrier for three stages
  for (int h = 1; h < p2;) {
    const int left = __ffs(p2) - 1 - (__ffs(h) - 1);  // stages still to do
    const int r = left >= 3 ? 3 : left;
    const int span = h << r;
    const int groups = n >> r;
    for (int q = threadIdx.x; q < groups; q += blockDim.x) {
      const int base = (q / h) * span + (q % h);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < (1 << r)) v[i] = z[base + i * h];
#pragma unroll
      for (int st = 1; st < 8; st <<= 1) {
        if (st < (1 << r)) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (!(i & st) && i < (1 << r)) {
              const float a = v[i], b = v[i + st];
              v[i] = a + b;
              v[i + st] = a - b;
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < (1 << r)) z[base + i * h] = v[i];
    }
    __syncthreads();
    h = span;
  }
  if (k == 1) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) st(yr, i, z[i] * scale);
    return;
  }
  // this block's output rows a' of H_K
  const int a_lo = static_cast<int>(static_cast<long long>(blockIdx.y) * k / gridDim.y);
  const int a_hi = static_cast<int>(static_cast<long long>(blockIdx.y + 1) * k / gridDim.y);
  const int cnt = (a_hi - a_lo) * p2;
  for (int idx = threadIdx.x; idx < cnt; idx += blockDim.x) {
    const int ap = a_lo + idx / p2, b = idx % p2;
    const int8_t* hrow = hk + static_cast<long long>(ap) * k;
    float s = 0.f;
#pragma unroll 4
    for (int a = 0; a < k; ++a) s += static_cast<float>(__ldg(hrow + a)) * z[a * p2 + b];
    st(yr, static_cast<long long>(ap) * p2 + b, s * scale);
  }
}

constexpr int ROWS_MAX_P2 = 4096;  // 8 elements a thread, at most 512 threads
constexpr int ROWS_MAX_K = 64;     // segments a thread mixes (a load each)

constexpr int ROWS_THREADS = 512;
// the rows kernel's static shared memory: z and part (checked in the kernel)
constexpr int ROWS_STATIC_SMEM = ROWS_MAX_P2 * sizeof(float) + 2 * ROWS_THREADS * sizeof(float4);

// K = 1, one slice: chunk t of this row of rmsnorm(x + x_add) ⊙ norm_w, signs applied, into v;
// x + x_add written to h_out. Every thread calls it (block_sum: one barrier, `part` its scratch).
template <class T>
__device__ __forceinline__ void normed_row(float (&v)[8], const T* xr, const uint8_t* signs, const RotationInput& in,
                                           long long row, int n, int t, bool active, float* part) {
  uint4 h = make_uint4(0, 0, 0, 0), wn = h;
  uint32_t sb = 0;
  if (active) {  // every load in flight at once
    h = __ldg(reinterpret_cast<const uint4*>(xr) + t);
    sb = __ldg(signs + t);
    wn = __ldg(reinterpret_cast<const uint4*>(in.norm_w) + t);
    if (in.x_add) {
      h = add_chunks<T>(h, __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(in.x_add) + row * n) + t));
      reinterpret_cast<uint4*>(static_cast<T*>(in.h_out) + row * n)[t] = h;
    }
  }
  const uint4 normed = rms_normed_chunk<T>(h, wn, active, n, in.norm_eps, part);
  if (active) signed_chunk<T>(normed, sb, v);
}

// What the rows kernel forms from x before rotating it (RotationInput): x itself, silu(gate) ⊙ up
// (x rows are [gate | up]), or rmsnorm(x + x_add) ⊙ norm_w (K = 1: the block holds the whole row)
enum Form { PLAIN = 0, GATED = 1, NORMED = 2 };

// Block = S slices × C threads (C = max(32, 2^m/8)): thread (s, t) sums segments a ≡ s (mod S) of
// chunk t, so a thread has few loads in flight even for K = 28; slice 0 adds the S partial sums
// in a fixed order (deterministic) and runs the 2^m-point transform. GATED forms each chunk as it
// loads it (every block of a row forms the chunks it mixes); NORMED (one slice) adds x_add, writes
// the sum to h_out and scales by the row's RMS (one barrier) first: LlamaRMSNorm's arithmetic as the
// GEMV's staging does it (qpalette_gemv.cuh normed_chunk), so batch 1 and batch > 1 agree.
template <class T, int FORM>
__global__ void __launch_bounds__(ROWS_THREADS) hadamard_rows_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                    const uint8_t* __restrict__ signs,
                                                                    const int8_t* __restrict__ hk, int n, int k,
                                                                    int log2p2, int chunk_threads, float scale,
                                                                    RotationInput in) {
  __shared__ __align__(16) float z[ROWS_MAX_P2];
  __shared__ __align__(16) float4 part[2 * ROWS_THREADS];
  static_assert(sizeof(z) + sizeof(part) == ROWS_STATIC_SMEM, "ROWS_STATIC_SMEM");
  pdl_launch_dependents();
  const int seg = blockIdx.x, p2 = 1 << log2p2, slices = blockDim.x / chunk_threads;
  const int s = threadIdx.x / chunk_threads, t = threadIdx.x - s * chunk_threads;
  const long long row = blockIdx.y;
  const T* xr = x + row * (FORM == GATED ? 2 * n : n);
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  pdl_wait();
  if constexpr (FORM == NORMED) {
    normed_row<T>(v, xr, signs, in, row, n, t, t < p2 / 8, reinterpret_cast<float*>(part));
  } else {
    if (t < p2 / 8) mix_segments<T, FORM == GATED>(v, xr, signs, hk, k, log2p2, seg, t, s, slices);
    if (slices > 1) {
      part[2 * threadIdx.x] = make_float4(v[0], v[1], v[2], v[3]);
      part[2 * threadIdx.x + 1] = make_float4(v[4], v[5], v[6], v[7]);
      __syncthreads();
      if (s == 0)
        for (int q = 1; q < slices; ++q) {
          const float4 lo = part[2 * (q * chunk_threads + t)], hi = part[2 * (q * chunk_threads + t) + 1];
          v[0] += lo.x; v[1] += lo.y; v[2] += lo.z; v[3] += lo.w;
          v[4] += hi.x; v[5] += hi.y; v[6] += hi.z; v[7] += hi.w;
        }
    }
  }
  fwht_row<T>(v, log2p2, scale, z, y + row * n + static_cast<long long>(seg) * p2, threadIdx.x, s == 0 && t < p2 / 8);
}

// H_K's row `row` (int8 ±1, k ≤ 64 entries) as −1 bits
__device__ __forceinline__ uint64_t neg_bits(const int8_t* row, int k) {
  uint64_t bits = 0;
  for (int a = 0; a < k; ++a) bits |= static_cast<uint64_t>(__ldg(row + a) < 0) << a;
  return bits;
}
// GATED with K > 1 where the mix fits the tensor cores (gated_mma_config): one block per (group of
// consecutive output segments, row). The block forms silu(gate) ⊙ up of the whole row once into shared
// memory, signed and swizzled, mixes its segments on the tensor cores (mix_segments_mma) and runs their
// 2^m-point transforms side by side. The rows kernel's block per segment formed every chunk it mixed:
// the row's silu K times over (28 for down), each block reading the whole row from L2.
template <class T>
__global__ void __launch_bounds__(ROWS_THREADS) hadamard_gated_mma_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                         const uint8_t* __restrict__ signs,
                                                                         const int8_t* __restrict__ hk, int n, int k,
                                                                         int log2p2, int group, float scale) {
  extern __shared__ __align__(16) float zg[];  // the staged row (2n bytes), then the sums and transforms
  pdl_launch_dependents();
  const int first = blockIdx.x * group, segs = min(group, k - first), g = (threadIdx.x & 31) >> 2;
  const uint64_t hka = g < segs ? neg_bits(hk + (first + g) * k, k) : 0ull;  // the lane's A rows, before the wait
  const uint64_t hkb = g + 8 < segs ? neg_bits(hk + (first + g + 8) * k, k) : 0ull;
  const long long row = blockIdx.y;
  const int jj = threadIdx.x >> (log2p2 - 3), t = threadIdx.x - (jj << (log2p2 - 3));
  const bool active = jj < segs;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  pdl_wait();
  stage_signed_row<T, 4, true>(x + row * 2 * n, signs, n / 8, reinterpret_cast<T*>(zg), log2p2 - 3);
  __syncthreads();
  mix_segments_mma<T>(zg, hka, hkb, k, segs, log2p2, v, active, jj, t);
  __syncthreads();  // the transforms' z holds other threads' sums
  fwht_row<T>(v, log2p2, scale, zg + (jj << log2p2), y + row * n + (static_cast<long long>(first + jj) << log2p2), t,
              active);
}
// The gated tensor-core mix's launch: blocks a row, H_K rows a block (≤ 16, 2^m / 8 threads each, ≤ 512
// threads in all), threads a block and shared memory; false where mix_segments_mma does not fit.
struct GatedMma {
  int blocks, group, threads;
  size_t smem;
};
inline bool gated_mma_config(int k, int p2, GatedMma& c) {
  const int seg_threads = p2 / 8;
  if (k < 2 || p2 < 64 || seg_threads > ROWS_THREADS) return false;
  const int most = ROWS_THREADS / seg_threads < 16 ? ROWS_THREADS / seg_threads : 16;
  c.blocks = (k + most - 1) / most;
  c.group = (k + c.blocks - 1) / c.blocks;
  c.threads = (c.group * seg_threads + 31) / 32 * 32;
  const size_t row = size_t(2) * k * p2, sums = size_t(c.group) * (p2 + 8) * sizeof(float);
  c.smem = row > sums ? row : sums;
  return mix_fits_tensor_cores(k, c.group, __builtin_ctz(p2), c.threads / 32) && c.smem <= 48 * 1024;
}
// launch with programmatic stream serialization where asked for (Hopper)
template <class K, class... Args>
int launch_pdl(K kern, dim3 grid, dim3 block, size_t smem, void* stream, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1] = {pdl_attribute()};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  if (pdl) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, kern, args...)) return e;
  return cudaGetLastError();
}

// Under PDL a formed rotation follows a persistent GEMV, whose SMs free one at a time. Launched early,
// the rotation's blocks crowd onto the first freed SMs, 4 a SM, and it runs on a quarter of the GPU
// (results/kernels_h200/v21/ §3). `*bytes` of dynamic shared memory that the kernel does not use cap
// the blocks a SM at what a plain launch spreads them to (1 or 2 where the grid fits; else no cap).
// The device's figures are read once (current_device) and the kernel's limit raised once a device to
// the larger of the two sizes: host time counts on the decode path.
// `fixed`: the kernel's static shared memory; `need`: the dynamic bytes it uses (the result is at least
// that); `attr_set`: the kernel's own flags (the limit is raised once a device)
template <class K>
int spread_blocks(K kern, bool (&attr_set)[64], size_t fixed, size_t need, int blocks, int num_sms, size_t* bytes) {
  *bytes = need;
  const int per_sm = (blocks + num_sms - 1) / num_sms;
  if (per_sm > 2) return OK;
  DeviceInfo dev;
  if (int e = current_device(dev)) return e;
  // a block of the kernel taking `room(c)` more bytes: c of them fit on a SM, c + 1 do not
  auto room = [&](int c) { return static_cast<long long>(dev.smem_per_sm / (c + 1) + 1) - static_cast<long long>(fixed); };
  if (room(per_sm) <= static_cast<long long>(need)) return OK;
  if (!attr_set[dev.index]) {
    if (cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(room(1))))
      return e;
    attr_set[dev.index] = true;
  }
  *bytes = static_cast<size_t>(room(per_sm));
  return OK;
}
template <class T>
int launch(const void* x, void* y, const uint8_t* signs, const int8_t* hk, int rows, int n, int k,
           int p2, int num_sms, bool pdl, void* stream, const RotationInput& in) {
  const int form = in.norm_w ? NORMED : in.gated ? GATED : PLAIN;
  const bool by_rows = p2 >= 8 && p2 <= ROWS_MAX_P2 && k <= ROWS_MAX_K && rows <= 65535;
  if (form != PLAIN && (!by_rows || (form == NORMED && k != 1) || (in.x_add != nullptr) != (in.h_out != nullptr)))
    return UNSUPPORTED;  // formed inputs: the rows kernel only (the caller forms them in torch otherwise)
  if (rows == 0) return 0;
  const float scale = rsqrtf(static_cast<float>(n));
  const T* xt = static_cast<const T*>(x);
  T* yt = static_cast<T*>(y);
  GatedMma gm;
  if (form == GATED && gated_mma_config(k, p2, gm)) {
    static bool attr_set[64];
    size_t smem = gm.smem;
    if (pdl)
      if (int e = spread_blocks(hadamard_gated_mma_kernel<T>, attr_set, 0, gm.smem, gm.blocks * rows, num_sms, &smem))
        return e;
    return launch_pdl(hadamard_gated_mma_kernel<T>, dim3(gm.blocks, rows), dim3(gm.threads), smem, stream, pdl, xt, yt,
                      signs, hk, n, k, __builtin_ctz(p2), gm.group, scale);
  }
  if (by_rows) {
    const int chunk_threads = p2 / 8 < 32 ? 32 : p2 / 8;
    int slices = ROWS_THREADS / chunk_threads;
    if (slices > k) slices = k;
    auto kern = form == NORMED ? hadamard_rows_kernel<T, NORMED>
                : form == GATED ? hadamard_rows_kernel<T, GATED> : hadamard_rows_kernel<T, PLAIN>;
    size_t spread = 0;
    static bool attr_set[3][64];
    if (pdl && form != PLAIN)
      if (int e = spread_blocks(kern, attr_set[form], ROWS_STATIC_SMEM, 0, k * rows, num_sms, &spread)) return e;
    return launch_pdl(kern, dim3(k, rows), dim3(slices * chunk_threads), spread, stream, pdl, xt, yt, signs, hk, n,
                      k, __builtin_ctz(p2), chunk_threads, scale, in);
  }
  const size_t smem = static_cast<size_t>(n) * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(hadamard_segments_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  int slices = 1;
  if (k > 1) {
    slices = (2 * num_sms + rows - 1) / rows;
    if (slices > k) slices = k;
    if (slices < 1) slices = 1;
  }
  int threads = n / 8;
  threads = threads < 128 ? 128 : (threads > 512 ? 512 : threads);
  return launch_pdl(hadamard_segments_kernel<T>, dim3(rows, slices), dim3(threads), smem, stream, pdl, xt, yt, signs, hk,
                    n, k, p2, scale);
}

}  // namespace

int hadamard(const void* x, void* y, const uint8_t* signs, const int8_t* hk, int rows, int n, int k,
             int p2, int dtype, int num_sms, int pdl, void* stream, const RotationInput& in) {
  if (k * p2 != n || (p2 & (p2 - 1)) != 0) return UNSUPPORTED;
  return dtype == BF16 ? launch<__nv_bfloat16>(x, y, signs, hk, rows, n, k, p2, num_sms, pdl != 0, stream, in)
                       : launch<__half>(x, y, signs, hk, rows, n, k, p2, num_sms, pdl != 0, stream, in);
}

}  // namespace qp
