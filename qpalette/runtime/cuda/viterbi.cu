// Tail-biting Viterbi of the TCQ bitshift trellis (qpalette/quant/trellis.py is the reference):
// the encoder's hot loop, run by `qpalette compress` for every 16×16 tile of a TCQ layer.
//
// The PyTorch reference keeps all 2^16 path costs of a tile in global memory and makes four passes
// over them a step (matmul, min, add, copy): memory bound, ~1 MB of traffic per tile and step. Here
// one CTA owns a tile at a time and only the 2^(16−KV) per-step minima B_t[l] live between steps, in
// shared memory (two buffers of 64 KB at KV = 2): the cost of state s = h·2^(16−KV) + l at step t is
// C_t[s] = B_{t−1}[s >> KV] + |v(s) − x_t|², the distance read from a per-step table of the hybrid
// table's 2^(q+1) signed entries at s's hashed key (both in shared memory), and
// B_t[l] = min_h C_t[s] with its argmin h kept as the back-pointer (global scratch, one slot per
// CTA, KV bits stored in a byte or two). Pass 1 runs on the tile rolled by 64
// steps and traces back to the state aligned with step 0, whose top 16−KV bits tie the ends of pass
// 2; pass 2's path is written out. A persistent grid loops over the tiles.
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include <type_traits>

#include "qpalette_kernels.h"

namespace qp {
namespace {

constexpr int kStates = 1 << 16;
constexpr int kSteps = 128;
constexpr int kThreads = 512;

template <int KV>
struct Trellis {
  static constexpr int LO = 1 << (16 - KV);  // per-step minima: states sharing their low 16−KV bits
  static constexpr int HI = 1 << KV;         // predecessors of a state
  static constexpr bool WIDE = LO >= kThreads;   // a thread owns whole minima
  static constexpr int PER = WIDE ? LO / kThreads : 1;            // minima a thread owns
  static constexpr int GROUP = WIDE ? 1 : kThreads / LO;          // threads sharing one minimum
  static constexpr int HSPAN = HI / GROUP;                        // predecessors a thread scans
  using Back = typename std::conditional<(KV <= 8), uint8_t, uint16_t>::type;
};

// The hash of state s picks a hybrid table entry and its first value's sign (trellis.state_values):
// key = bits 15−q..15 of the hash, entry = key mod 2^q, sign = key >> q.
__device__ __forceinline__ uint32_t key_of(uint32_t s, int q) { return ((s * (s + 1)) & 0xFFFFu) >> (15 - q); }

// dist[key] = |v(key) − x|² of every (entry, sign) for step pair x: one table a step, so a state's
// distance is one shared-memory load at its hashed key.
__device__ __forceinline__ void fill_dist(float* dist, const float2* tab, int q, float x0, float x1) {
  for (int key = threadIdx.x; key < (2 << q); key += blockDim.x) {
    const float2 t = tab[key & ((1 << q) - 1)];
    const float a = ((key >> q) ? -t.x : t.x) - x0, b = t.y - x1;
    dist[key] = fmaf(a, a, b * b);
  }
}

// Block-wide argmin of (cost, state): the smallest state among equal costs.
__device__ __forceinline__ uint32_t block_argmin(float c, uint32_t s, float* red_c, uint32_t* red_s) {
  for (int o = 16; o; o >>= 1) {
    const float oc = __shfl_xor_sync(0xFFFFFFFFu, c, o);
    const uint32_t os = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if (oc < c || (oc == c && os < s)) c = oc, s = os;
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) red_c[warp] = c, red_s[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (red_c[w] < c || (red_c[w] == c && red_s[w] < s)) c = red_c[w], s = red_s[w];
    red_s[0] = s;
  }
  __syncthreads();
  const uint32_t best = red_s[0];
  __syncthreads();
  return best;
}

// One forward pass over the tile; x(t) is step t's pair. tie < 0: free ends; else the start state's
// top 16−KV bits and the end state's low 16−KV bits must equal tie. Returns the best end state.
// B_t is written to bufs[t & 1] while B_{t−1} is read from the other buffer; the distance tables
// alternate the same way (step t + 1's is filled during step t).
template <int KV>
__device__ uint32_t forward(const float* xs, int roll, int tie, const float2* tab, int q, float* bufs,
                            float* dists, typename Trellis<KV>::Back* back, float* red_c, uint32_t* red_s) {
  using T = Trellis<KV>;
  const int tid = threadIdx.x;
  const int nd = 2 << q;
  fill_dist(dists, tab, q, xs[2 * (roll & (kSteps - 1))], xs[2 * (roll & (kSteps - 1)) + 1]);
  __syncthreads();
  for (int t = 0; t < kSteps; ++t) {
    const float* prev = bufs + ((t + 1) & 1) * T::LO;
    float* next = bufs + (t & 1) * T::LO;
    const float* dist = dists + (t & 1) * nd;
    if (t == kSteps - 1) {  // the end: one argmin over every state
      float c = CUDART_INF_F;
      uint32_t arg = 0;
      for (int i = 0; i < kStates / kThreads; ++i) {
        const uint32_t s = tid + i * kThreads;
        if (tie >= 0 && static_cast<int>(s & (T::LO - 1)) != tie) continue;
        const float v = prev[s >> KV] + dist[key_of(s, q)];
        if (v < c) c = v, arg = s;
      }
      return block_argmin(c, arg, red_c, red_s);
    }
    const int at = (t + 1 + roll) & (kSteps - 1);
    fill_dist(dists + ((t + 1) & 1) * nd, tab, q, xs[2 * at], xs[2 * at + 1]);
    auto* back_t = back + static_cast<long long>(t) * T::LO;
#pragma unroll 2
    for (int m = 0; m < T::PER; ++m) {
      const uint32_t l = T::WIDE ? tid + m * kThreads : (tid & (T::LO - 1));
      const uint32_t h0 = T::WIDE ? 0 : tid / T::LO;
      float c = CUDART_INF_F;
      uint32_t a = 0;
#pragma unroll 4
      for (int j = 0; j < T::HSPAN; ++j) {
        const uint32_t h = h0 + j * T::GROUP;
        const uint32_t s = h * T::LO + l;
        float v;
        if (t == 0) v = (tie < 0 || static_cast<int>(s >> KV) == tie) ? dist[key_of(s, q)] : CUDART_INF_F;
        else v = prev[s >> KV] + dist[key_of(s, q)];
        if (v < c) c = v, a = h;
      }
      if constexpr (T::WIDE) {
        next[l] = c;
        back_t[l] = static_cast<typename T::Back>(a);
      } else {
        red_c[tid] = c;
        red_s[tid] = a;
      }
    }
    if constexpr (!T::WIDE) {  // GROUP threads hold partial minima of one l: combine them
      __syncthreads();
      if (tid < T::LO) {
        float c = red_c[tid];
        uint32_t a = red_s[tid];
        for (int g = 1; g < T::GROUP; ++g) {
          const float o = red_c[tid + g * T::LO];
          const uint32_t oa = red_s[tid + g * T::LO];
          if (o < c || (o == c && oa < a)) c = o, a = oa;
        }
        next[tid] = c;
        back_t[tid] = static_cast<typename T::Back>(a);
      }
    }
    __syncthreads();  // B_t and step t + 1's distances complete
  }
  return 0;  // not reached
}

// The state at step `stop` of the path ending in `end` at step 127 (back-pointers of this pass).
template <int KV>
__device__ uint32_t trace(uint32_t end, int stop, const typename Trellis<KV>::Back* back, int* path) {
  using T = Trellis<KV>;
  uint32_t s = end;
  if (path) path[kSteps - 1] = static_cast<int>(s);
  for (int t = kSteps - 2; t >= stop; --t) {
    const uint32_t top = s >> KV;  // = l of step t's minimum
    s = (static_cast<uint32_t>(back[static_cast<long long>(t) * T::LO + top]) << (16 - KV)) | top;
    if (path) path[t] = static_cast<int>(s);
  }
  return s;
}

template <int KV>
__global__ void __launch_bounds__(kThreads) viterbi_kernel(const float* __restrict__ x,
                                                          const float2* __restrict__ table, int q,
                                                          int64_t* __restrict__ paths, void* scratch,
                                                          int n_tiles) {
  using T = Trellis<KV>;
  extern __shared__ float smem[];
  float* best = smem;                                        // 2 × LO: B_{t−1} and B_t
  float2* tab = reinterpret_cast<float2*>(best + 2 * T::LO);  // 2^q
  float* dists = reinterpret_cast<float*>(tab + (1 << q));   // 2 × 2^(q+1)
  float* xs = dists + (4 << q);                              // 256
  float* red_c = xs + 2 * kSteps;                            // kThreads
  uint32_t* red_s = reinterpret_cast<uint32_t*>(red_c + kThreads);  // kThreads
  int* path = reinterpret_cast<int*>(red_s + kThreads);      // 128
  __shared__ int tie_box;
  auto* back = reinterpret_cast<typename T::Back*>(scratch) +
               static_cast<long long>(blockIdx.x) * (kSteps - 1) * T::LO;

  for (int i = threadIdx.x; i < (1 << q); i += kThreads) tab[i] = table[i];
  for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    for (int i = threadIdx.x; i < 2 * kSteps; i += kThreads) xs[i] = x[tile * 2 * kSteps + i];
    __syncthreads();
    // pass 1: the tile rolled by 64 steps; its step 64 is the tile's step 0
    const uint32_t end1 = forward<KV>(xs, kSteps / 2, -1, tab, q, best, dists, back, red_c, red_s);
    if (threadIdx.x == 0) tie_box = static_cast<int>(trace<KV>(end1, kSteps / 2, back, nullptr) >> KV);
    __syncthreads();
    const int tie = tie_box;
    const uint32_t end2 = forward<KV>(xs, 0, tie, tab, q, best, dists, back, red_c, red_s);
    if (threadIdx.x == 0) trace<KV>(end2, 0, back, path);
    __syncthreads();
    for (int i = threadIdx.x; i < kSteps; i += kThreads) paths[tile * kSteps + i] = path[i];
    __syncthreads();  // path, xs and tie_box are rewritten by the next tile
  }
}

template <int KV>
size_t smem_bytes(int q) {
  return sizeof(float) * 2 * Trellis<KV>::LO + sizeof(float2) * (size_t{1} << q) + sizeof(float) * (size_t{4} << q) + sizeof(float) * 2 * kSteps +
         (sizeof(float) + sizeof(uint32_t)) * kThreads + sizeof(int) * kSteps;
}

// Resident CTAs for a persistent grid (at most one per tile) and the back-pointer scratch they need.
template <int KV>
int plan(int q, int num_sms, int n_tiles, int* grid, long long* scratch_bytes) {
  const size_t smem = smem_bytes<KV>(q);
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  if (smem > static_cast<size_t>(optin)) return UNSUPPORTED;  // e.g. KV = 2 on a 99 KB-per-block GPU
  e = cudaFuncSetAttribute(viterbi_kernel<KV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, viterbi_kernel<KV>, kThreads, smem);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return UNSUPPORTED;
  *grid = n_tiles < per_sm * num_sms ? n_tiles : per_sm * num_sms;
  *scratch_bytes = static_cast<long long>(*grid) * (kSteps - 1) * Trellis<KV>::LO * sizeof(typename Trellis<KV>::Back);
  return OK;
}

template <int KV>
int launch(const ViterbiArgs& a) {
  viterbi_kernel<KV><<<a.grid, kThreads, smem_bytes<KV>(a.q), static_cast<cudaStream_t>(a.stream)>>>(
      static_cast<const float*>(a.x), static_cast<const float2*>(a.table), a.q, static_cast<int64_t*>(a.paths),
      a.scratch, a.n_tiles);
  return cudaGetLastError();
}

// f(std::integral_constant<int, KV>) for the KV = 2..10 the kernel is built for.
template <class F>
int with_kv(int kv, F&& f) {
  switch (kv) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 9: return f(std::integral_constant<int, 9>{});
    case 10: return f(std::integral_constant<int, 10>{});
    default: return NOT_BUILT;
  }
}

}  // namespace

int viterbi_plan(int kv, int q, int num_sms, int n_tiles, int* grid, long long* scratch_bytes) {
  if (q < 1 || q > 11 || n_tiles < 1 || num_sms < 1) return UNSUPPORTED;
  return with_kv(kv, [&](auto k) { return plan<decltype(k)::value>(q, num_sms, n_tiles, grid, scratch_bytes); });
}

int viterbi(const ViterbiArgs& a) {
  if (a.n_tiles == 0) return OK;
  if (a.q < 1 || a.q > 11 || a.grid < 1) return UNSUPPORTED;
  return with_kv(a.kv, [&](auto k) { return launch<decltype(k)::value>(a); });
}

}  // namespace qp
