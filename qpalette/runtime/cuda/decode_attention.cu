// Decode attention (one query token) for grouped-query heads, split over the key/value length
// ("flash decoding"): out[b, h] = softmax(scale · q[b, h] · K[b, h/G]ᵀ + mask[b]) · V[b, h/G].
//
// Why our own: SDPA's kernels are built for prefill. At decode transformers either copies the
// cache to every query head (repeat_kv) or, packed, gives cuDNN 8 (b, kv) pairs of 4 query rows:
// at batch 1 both take 17–81 µs a layer for 1–4k cached keys, 3–14× the time to read the cache
// once (measured on an H100, results/decode_attention_h100/README.md). Here the G query heads of a KV head
// share every key and value load, and the length is split over enough CTAs to fill the GPU.
//
// decode_attention_kernel: grid (splits, B·KV), 4 warps. Warp w takes keys in blocks of 32, one key
// a lane: the block's value rows start copying to shared memory (cp.async) while each lane loads its
// whole key row and takes its dot products with the G queries (held in shared memory, pre-scaled),
// the mask, an online softmax per query over the warp; then the values: lane ℓ owns dims ℓ·D/32..,
// the 32 probabilities come by shuffle. The 4 warps' (max, sum, acc) merge in shared memory; with one
// split that is the output. With 2–8 splits in one wave (a CTA an SM) on a GPU with thread-block
// clusters (Hopper), the splits of one (b, kv) form a cluster: each CTA leaves its partial (acc, max,
// sum) in its shared memory and the CTAs merge them through distributed shared memory, each writing
// a share of the output, so the kernel is the last of the layer's attention and lets the next one
// start early. Else (more splits or CTAs than SMs, or no clusters) a partial per (b, kv, split, g)
// goes to global memory and decode_attention_combine merges the splits. H100, 8B heads, batch 1:
// 9.6 → 9.1 µs at 132 keys, 12.2 → 10.6 µs at 1024 (results/decode_attention_h100/). Fully masked: 0.
// rope_cache_attention (a.cos set): q, k_new, v_new are the new token's projections before rope. Each
// CTA ropes its G queries; the CTA whose keys hold the new token's slot ropes the new key, writes it
// and the new value to the caches and uses them from shared memory and from v_new (its own loads of
// that row are replaced, so no CTA reads a row this kernel writes), which removes transformers'
// rope and cache-update kernels between the q/k/v GEMV and the attention.
// The last kernel of the two lets the next one start at once (programmatic dependent launch): the
// next is usually o_proj's GEMV, whose table fill and first code loads then overlap the attention;
// it reads the attention's output only after griddepcontrol.wait. The attention itself is launched
// the same way after the q/k/v projection (a.pdl): 2-bit Llama-3.1-8B decode +0.7% on an H100
// (results/kernels_h100/v13/).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "qpalette_fwht.cuh"  // Cvt: fp16/bf16 ↔ float
#include "qpalette_hopper.cuh"
#include "qpalette_kernels.h"

namespace qp {
namespace {

constexpr int WARPS = 4;
constexpr unsigned FULL = 0xffffffffu;

template <class T>
__device__ __forceinline__ float2 pair_to_float2(unsigned w);
template <>
__device__ __forceinline__ float2 pair_to_float2<__half>(unsigned w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <>
__device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(unsigned w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// The additive mask term of key j in batch row b: 0, −∞ (bool mask false) or the mask's value.
template <class T>
__device__ __forceinline__ float mask_term(const DecodeAttentionArgs& a, int b, int j) {
  if (a.mask_kind == MASK_NONE) return 0.f;
  const long long at = static_cast<long long>(b) * a.mask_batch_stride + j;
  if (a.mask_kind == MASK_BOOL) return static_cast<const uint8_t*>(a.mask)[at] ? 0.f : -INFINITY;
  return Cvt<T>::to_float(static_cast<const T*>(a.mask)[at]);
}

// x[d]·cos[d] + rotate_half(x)[d]·sin[d] in fp32, rounded to T (transformers' apply_rotary_pos_emb)
template <class T, int D>
__device__ __forceinline__ T roped(const T* x, const T* cs, const T* sn, int d) {
  const float r = d < D / 2 ? -Cvt<T>::to_float(x[d + D / 2]) : Cvt<T>::to_float(x[d - D / 2]);
  return Cvt<T>::from_float(Cvt<T>::to_float(x[d]) * Cvt<T>::to_float(cs[d]) + r * Cvt<T>::to_float(sn[d]));
}

// The cluster's partials merged: CTA r writes outputs r, r + splits·blockDim, … of the (b, kv) pair's
// G·D, reading every CTA's `mine` through distributed shared memory. The second barrier keeps each
// CTA's shared memory alive until every peer has read it.
template <class T, int D, int G>
__device__ __forceinline__ void merge_cluster(const DecodeAttentionArgs& a, float (*mine)[D + 2], int b, int kvh,
                                              int splits) {
  cluster_sync();  // every split's partial written (the barrier orders the shared-memory writes)
  const int rank = cluster_rank();
  for (int idx = rank * blockDim.x + threadIdx.x; idx < G * D; idx += splits * blockDim.x) {
    const int g = idx / D, d = idx % D;
    float mx = -INFINITY, sum = 0.f, out = 0.f;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, cluster_peer(&mine[g][0], s)[D]);
    for (int s = 0; s < splits; ++s) {
      const float* part = cluster_peer(&mine[g][0], s);
      const float wt = part[D] == -INFINITY ? 0.f : __expf(part[D] - mx);
      sum += part[D + 1] * wt;
      out += part[d] * wt;
    }
    T* o = static_cast<T*>(a.out) + (static_cast<long long>(b) * a.heads + kvh * G + g) * D;
    o[d] = Cvt<T>::from_float(sum > 0.f ? out / sum : 0.f);
  }
  cluster_sync();
}

template <class T, int D, int G>
__global__ void __launch_bounds__(WARPS * 32) decode_attention_kernel(DecodeAttentionArgs a, int chunk, int splits,
                                                                     bool clustered) {
  if (splits == 1 || clustered) pdl_launch_dependents();
  constexpr int PER_LANE = D / 32;  // value dims a lane owns
  constexpr int ROW_CHUNKS = D / 8;  // 16-byte pieces of a key or value row
  // a warp's 32 value rows, staged while its scores are computed; after the loop the same bytes
  // hold the warps' partial sums
  constexpr int STAGE_BYTES = WARPS * 32 * D * static_cast<int>(sizeof(T));
  constexpr int SUM_BYTES = WARPS * G * D * static_cast<int>(sizeof(float));
  __shared__ __align__(16) unsigned char pool[STAGE_BYTES > SUM_BYTES ? STAGE_BYTES : SUM_BYTES];
  __shared__ __align__(16) float qs[G][D];
  __shared__ float red_m[WARPS][G], red_l[WARPS][G];
  __shared__ __align__(16) T knew[D];  // rope: the new token's roped key
  __shared__ float mine[G][D + 2];      // clustered: this split's partial (acc, max, sum), read by the cluster
  const int bk = blockIdx.y, b = bk / a.kv_heads, kvh = bk % a.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* staged = reinterpret_cast<T*>(pool) + warp * 32 * D;
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride + kvh * G * D;
  const long long head = static_cast<long long>(bk) * a.length * D;
  const T* keys = static_cast<const T*>(a.k) + head;
  const T* values = static_cast<const T*>(a.v) + head;
  const int begin = blockIdx.x * chunk;
  const int end = min(begin + chunk, a.length);
  const bool rope = a.cos != nullptr;
  const long long slot = rope ? *a.slot : -1;  // the new token's row (rope), else none
  const T* vnew = rope ? static_cast<const T*>(a.v_new) + b * a.new_stride + kvh * D : nullptr;
  // a block's value rows start copying to shared memory, its key rows and mask terms to registers
  // (`cached_only`: not the new token's row, whose value v_new the previous kernel writes)
  auto stage_values = [&](int base, bool cached_only) {
    const int n = min(32, end - base);
    for (int c = lane; c < n * ROW_CHUNKS; c += 32) {
      const long long row = base + c / ROW_CHUNKS;
      const int piece = (c % ROW_CHUNKS) * 8;
      if (row != slot) cp_async16(staged + c * 8, values + row * D + piece);
      else if (!cached_only) cp_async16(staged + c * 8, vnew + piece);
    }
  };
  uint4 u[ROW_CHUNKS];
  float bias = 0.f;
  // the new token's key comes from knew (once staged: `fresh`), not from the row being written
  auto load_keys = [&](int base, bool fresh) {
    const int j = base + lane;
    if (j < end) {
      const uint4* row = reinterpret_cast<const uint4*>(keys + static_cast<long long>(j) * D);
      if (j != slot) {
#pragma unroll
        for (int c = 0; c < ROW_CHUNKS; ++c) u[c] = __ldg(row + c);
      } else if (fresh) {
#pragma unroll
        for (int c = 0; c < ROW_CHUNKS; ++c) u[c] = reinterpret_cast<const uint4*>(knew)[c];
      }
      bias = mask_term<T>(a, b, j);
    }
  };
  int base = begin + warp * 32;
  // With programmatic dependent launch this kernel may start while the previous one (the q/k/v
  // projection) still runs. With rope the cached rows it reads first were written by earlier
  // steps (this kernel writes the new token's), so their loads go before the wait; without rope
  // the caches' newest row comes from the kernel before, so everything waits.
  if (!rope) pdl_wait();
  if (base < end) {  // the first block's loads in flight while the queries are staged
    stage_values(base, true);
    load_keys(base, false);
  }
  if (rope) {
    pdl_wait();  // q, k_new and v_new are the previous kernel's output
    if (slot >= base && slot < min(base + 32, end))  // the new token's value row, in the first block
      for (int c = lane; c < ROW_CHUNKS; c += 32) cp_async16(staged + ((slot - base) * ROW_CHUNKS + c) * 8, vnew + c * 8);
    const T* cs = static_cast<const T*>(a.cos) + b * a.cos_stride;
    const T* sn = static_cast<const T*>(a.sin) + b * a.cos_stride;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
      qs[i / D][i % D] = Cvt<T>::to_float(roped<T, D>(q + (i / D) * D, cs, sn, i % D)) * a.scale;
    if (slot >= begin && slot < end) {  // this CTA's keys hold the new token
      const T* k_new = static_cast<const T*>(a.k_new) + b * a.new_stride + kvh * D;
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        knew[d] = roped<T, D>(k_new, cs, sn, d);
        const_cast<T*>(keys)[slot * D + d] = knew[d];
        const_cast<T*>(values)[slot * D + d] = vnew[d];
      }
    }
  } else {
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) qs[i / D][i % D] = Cvt<T>::to_float(q[i]) * a.scale;
  }
  __syncthreads();
  if (base < end && base + lane == slot) load_keys(base, true);
  float m[G], l[G], acc[G][PER_LANE];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[g][i] = 0.f;
  }
  for (; base < end; base += WARPS * 32) {
    const int n = min(32, end - base);
    float s[G];
    if (base + lane < end) {
      float s2[G];  // two partial sums a query: half the dependent chain
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = 0.f, s2[g] = 0.f;
#pragma unroll
      for (int c = 0; c < ROW_CHUNKS; ++c) {
        const float2 f0 = pair_to_float2<T>(u[c].x), f1 = pair_to_float2<T>(u[c].y);
        const float2 f2 = pair_to_float2<T>(u[c].z), f3 = pair_to_float2<T>(u[c].w);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(&qs[g][c * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&qs[g][c * 8 + 4]);
          float& t = c & 1 ? s2[g] : s[g];
          t += qa.x * f0.x + qa.y * f0.y + qa.z * f1.x + qa.w * f1.y + qb.x * f2.x + qb.y * f2.y + qb.z * f3.x +
               qb.w * f3.y;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] += s2[g] + bias;
    } else {
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = -INFINITY;
    }
    if (base + WARPS * 32 < end) load_keys(base + WARPS * 32, true);  // the next block's keys during this one's values
#pragma unroll
    for (int g = 0; g < G; ++g) {  // online softmax; s[g] becomes this key's weight
      const float m_new = fmaxf(m[g], warp_max(s[g]));
      const float alpha = m_new == -INFINITY ? 1.f : __expf(m[g] - m_new);
      s[g] = m_new == -INFINITY ? 0.f : __expf(s[g] - m_new);
      l[g] = l[g] * alpha + warp_sum(s[g]);
      m[g] = m_new;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) acc[g][i] *= alpha;
    }
    cp_async_wait_all();
    __syncwarp();
#pragma unroll 8
    for (int kk = 0; kk < n; ++kk) {
      const T* vrow = staged + kk * D + lane * PER_LANE;
      float v[PER_LANE];
      if constexpr (PER_LANE == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(vrow);
        const float2 v0 = pair_to_float2<T>(w.x), v1 = pair_to_float2<T>(w.y);
        v[0] = v0.x, v[1] = v0.y, v[2] = v1.x, v[3] = v1.y;
      } else {
        const float2 v0 = pair_to_float2<T>(*reinterpret_cast<const unsigned*>(vrow));
        v[0] = v0.x, v[1] = v0.y;
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = __shfl_sync(FULL, s[g], kk);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[g][i] += p * v[i];
      }
    }
    __syncwarp();  // every lane done with the staged rows before the next block's copies
    if (base + WARPS * 32 < end) stage_values(base + WARPS * 32, false);
  }
  __syncthreads();  // the staging bytes become the partial sums
  float(*red_acc)[G][D] = reinterpret_cast<float(*)[G][D]>(pool);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) red_m[warp][g] = m[g], red_l[warp][g] = l[g];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) red_acc[warp][g][lane * PER_LANE + i] = acc[g][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float mx = -INFINITY, sum = 0.f, out = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, red_m[w][g]);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = red_m[w][g] == -INFINITY ? 0.f : __expf(red_m[w][g] - mx);
      sum += red_l[w][g] * wt;
      out += red_acc[w][g][d] * wt;
    }
    if (splits == 1) {
      T* o = static_cast<T*>(a.out) + (static_cast<long long>(b) * a.heads + kvh * G + g) * D;
      o[d] = Cvt<T>::from_float(sum > 0.f ? out / sum : 0.f);
    } else if (clustered) {
      mine[g][d] = out;
      if (d == 0) mine[g][D] = mx, mine[g][D + 1] = sum;
    } else {
      float* part = a.partial + ((static_cast<long long>(bk) * splits + blockIdx.x) * G + g) * (D + 2);
      part[d] = out;
      if (d == 0) part[D] = mx, part[D + 1] = sum;
    }
  }
  if (clustered) merge_cluster<T, D, G>(a, mine, b, kvh, splits);
}

// One block per (b, h), one thread per dim: the splits' partials of decode_attention_kernel merged.
template <class T, int D>
__global__ void __launch_bounds__(D) decode_attention_combine(DecodeAttentionArgs a, int groups, int splits) {
  pdl_launch_dependents();
  const int bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads, d = threadIdx.x;
  const long long bk = static_cast<long long>(b) * a.kv_heads + h / groups;
  const float* part = a.partial + (bk * splits * groups + h % groups) * (D + 2);
  const long long step = static_cast<long long>(groups) * (D + 2);
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part[s * step + D]);
  float sum = 0.f, out = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ms = part[s * step + D];
    const float wt = ms == -INFINITY ? 0.f : __expf(ms - mx);
    sum += part[s * step + D + 1] * wt;
    out += part[s * step + d] * wt;
  }
  static_cast<T*>(a.out)[static_cast<long long>(bh) * D + d] = Cvt<T>::from_float(sum > 0.f ? out / sum : 0.f);
}

template <class T, int D, int G>
int launch(const DecodeAttentionArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int splits = decode_attention_splits(a.batch, a.kv_heads, a.length, a.num_sms);
  const int chunk = (a.length + splits - 1) / splits;
  const bool clustered = decode_attention_clustered(a.batch, a.kv_heads, splits, a.num_sms);
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[2];
  cfg.gridDim = dim3(splits, a.batch * a.kv_heads);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.stream = stream;
  cfg.attrs = attr;
  if (clustered) attr[cfg.numAttrs++] = cluster_attribute(splits);
  if (a.pdl) attr[cfg.numAttrs++] = pdl_attribute();
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, decode_attention_kernel<T, D, G>, a, chunk, splits, clustered)) return e;
  if (splits > 1 && !clustered) decode_attention_combine<T, D><<<a.batch * a.heads, D, 0, stream>>>(a, G, splits);
  return cudaGetLastError();
}

template <class T, int D>
int launch_groups(const DecodeAttentionArgs& a, int groups) {
  switch (groups) {
    case 1: return launch<T, D, 1>(a);
    case 2: return launch<T, D, 2>(a);
    case 3: return launch<T, D, 3>(a);
    case 4: return launch<T, D, 4>(a);
    case 5: return launch<T, D, 5>(a);
    case 6: return launch<T, D, 6>(a);
    case 7: return launch<T, D, 7>(a);
    case 8: return launch<T, D, 8>(a);
    default: return UNSUPPORTED;
  }
}

template <class T>
int launch_dims(const DecodeAttentionArgs& a, int groups) {
  if (a.head_dim == 128) return launch_groups<T, 128>(a, groups);
  if (a.head_dim == 64) return launch_groups<T, 64>(a, groups);
  return UNSUPPORTED;
}

}  // namespace

int decode_attention_splits(int batch, int kv_heads, int length, int num_sms) {
  const int pairs = batch * kv_heads;
  int splits = (2 * num_sms + pairs - 1) / pairs;      // about two CTAs an SM
  const int most = (length + DECODE_ATTENTION_MIN_CHUNK - 1) / DECODE_ATTENTION_MIN_CHUNK;
  if (splits > most) splits = most;
  if (splits < 1) return 1;
  const int chunk = (length + splits - 1) / splits;
  return (length + chunk - 1) / chunk;  // no split left without keys
}

// Only in one wave: past it, clusters of 5–8 wait for whole free groups of SMs, and batch 8 at
// 1–2k keys measured 3–10% slower clustered than with the combine kernel (H100).
bool decode_attention_clustered(int batch, int kv_heads, int splits, int num_sms) {
  if (splits < 2 || splits > DECODE_ATTENTION_MAX_CLUSTER || batch * kv_heads * splits > num_sms) return false;
  DeviceInfo dev;
  return current_device(dev) == OK && dev.major >= 9;  // clusters: Hopper on
}

int decode_attention(const DecodeAttentionArgs& a) {
  if (a.heads % a.kv_heads != 0 || a.length < 1 || a.batch < 1 || a.batch * a.kv_heads > 65535) return UNSUPPORTED;
  const int groups = a.heads / a.kv_heads;
  return a.dtype == BF16 ? launch_dims<__nv_bfloat16>(a, groups) : launch_dims<__half>(a, groups);
}

}  // namespace qp
