// Decode attention (one query token) for grouped-query heads, split over the key/value length
// ("flash decoding"): out[b, h] = softmax(scale · q[b, h] · K[b, h/G]ᵀ + mask[b]) · V[b, h/G].
//
// Why our own: SDPA's kernels are built for prefill. At decode transformers either copies the
// cache to every query head (repeat_kv) or, packed, gives cuDNN 8 (b, kv) pairs of 4 query rows:
// at batch 1 both take 17–81 µs a layer for 1–4k cached keys, 3–14× the time to read the cache
// once (measured on an H100, results/decode_attention_h100/README.md). Here the G query heads of a KV head
// share every key and value load, and the length is split over enough CTAs to fill the GPU.
//
// decode_attention_kernel: grid (splits, B·KV), 4 warps. Warp w takes keys in blocks of 32: the
// block's value rows start copying to shared memory (cp.async) while its key rows load into
// registers; scores and values then run on the tensor cores (block_scores, block_values: Q·Kᵀ and
// P·V as mma.m16n8k16 with the G queries as rows), with the mask and an online softmax per query
// between. At 80 keys that is ~1.4k instructions a warp, where the per-lane form (a key a lane, fp32
// dot products, probabilities by shuffle) issued ~2.8k (H200, results/kernels_h200/v24/).
// The 4 warps' (max, sum, acc) merge in shared memory; with one split that is the output. With 2–8
// splits in one wave (a CTA an SM) on a GPU with thread-block clusters (Hopper), the splits of one
// (b, kv) form a cluster: each CTA leaves its partial (acc, max, sum) in its shared memory and the
// CTAs merge them through distributed shared memory, each writing a share of the output, so the
// kernel is the last of the layer's attention and lets the next one start early. Else (more splits
// or CTAs than SMs, or no clusters) a partial per (b, kv, split, g) goes to global memory and
// decode_attention_combine merges the splits. H100, 8B heads, batch 1: 9.6 → 9.1 µs at 132 keys,
// 12.2 → 10.6 µs at 1024 (results/decode_attention_h100/). Fully masked: 0.
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
#include "qpalette_mma.cuh"

namespace qp {
namespace {

constexpr int WARPS = 4;
constexpr unsigned FULL = 0xffffffffu;

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

// The weight of a partial whose max is m when partials merge under their largest max mx (a partial
// that saw no key: 0). The cluster merge, the warps' merge and the combine kernel share it.
__device__ __forceinline__ float partial_weight(float m, float mx) { return m == -INFINITY ? 0.f : __expf(m - mx); }

// The cluster's partials merged: of the (b, kv) pair's G·D outputs, thread x of CTA r writes
// r·blockDim + x, then that plus splits·blockDim, …, reading every CTA's `mine` through distributed
// shared memory. The second barrier keeps each CTA's shared memory alive until every peer has read it.
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
      const float wt = partial_weight(part[D], mx);
      sum += part[D + 1] * wt;
      out += part[d] * wt;
    }
    T* o = static_cast<T*>(a.out) + (static_cast<long long>(b) * a.heads + kvh * G + g) * D;
    o[d] = Cvt<T>::from_float(sum > 0.f ? out / sum : 0.f);
  }
  cluster_sync();
}

// The warps' partials merged: the weights of each query's warps first (threads 0..G−1), then every
// output a weighted sum. With one split that is the output; clustered, this split's partial for
// merge_cluster; else a partial in global memory for decode_attention_combine. (m, l, o): the warp's
// running max, sum and P·V of query g = lane / 4, whose dims 8n + 2t, 2t + 1 lane 4g + t holds.
template <class T, int D, int G>
__device__ __forceinline__ void merge_warps(const DecodeAttentionArgs& a, unsigned char* pool, float (*red_m)[G],
                                            float (*red_l)[G], float (*red_w)[G], float (*stat)[2],
                                            float (*mine)[D + 2], float m, float l, const float (&o)[D / 8][4],
                                            int b, int bk, int kvh, int splits, bool clustered) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  __syncthreads();  // the staging bytes become the partial sums
  float(*red_acc)[G][D] = reinterpret_cast<float(*)[G][D]>(pool);
  if (g < G) {
    if (t == 0) red_m[warp][g] = m, red_l[warp][g] = l;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(&red_acc[warp][g][8 * n + 2 * t]) = make_float2(o[n][0], o[n][1]);
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int qg = threadIdx.x;
    float mx = -INFINITY, sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, red_m[w][qg]);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = partial_weight(red_m[w][qg], mx);
      red_w[w][qg] = wt;
      sum += red_l[w][qg] * wt;
    }
    if (splits == 1) {  // the output itself: weights normalized (a query that sees no key: zeros)
#pragma unroll
      for (int w = 0; w < WARPS; ++w) red_w[w][qg] = sum > 0.f ? red_w[w][qg] / sum : 0.f;
    }
    stat[qg][0] = mx, stat[qg][1] = sum;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int qg = idx / D, d = idx % D;
    float out = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) out += red_acc[w][qg][d] * red_w[w][qg];
    if (splits == 1) {
      static_cast<T*>(a.out)[(static_cast<long long>(b) * a.heads + kvh * G + qg) * D + d] = Cvt<T>::from_float(out);
    } else if (clustered) {
      mine[qg][d] = out;
      if (d == 0) mine[qg][D] = stat[qg][0], mine[qg][D + 1] = stat[qg][1];
    } else {
      float* part = a.partial + ((static_cast<long long>(bk) * splits + blockIdx.x) * G + qg) * (D + 2);
      part[d] = out;
      if (d == 0) part[D] = stat[qg][0], part[D + 1] = stat[qg][1];
    }
  }
  if (clustered) merge_cluster<T, D, G>(a, mine, b, kvh, splits);
}

// A warp's block of 32 keys on the tensor cores (mma.m16n8k16, qpalette_mma.cuh), queries as the
// 16 rows (G used): scores S = Q·Kᵀ in four 8-key tiles, then O += P·V in 16-key steps. The scores'
// accumulator layout is the A fragment of P (lane 4·g + t: query g, keys 2t, 2t + 1 of each tile), so
// P never leaves the registers. The dot products may take the dims in any order that Q and K share:
// lane t holds dims [t·D/4, (t+1)·D/4) of a key (its own 16-byte loads) and of query g, and k-step s
// uses its words 2s and 2s + 1. V's B fragments come transposed from the staged rows (ldmatrix),
// which are stored with their 16-byte pieces swizzled by the row (swizzled_piece) so that the 8 rows
// of a matrix fall in different banks. P is rounded to T for the mma, as flash
// attention does (fp32 softmax and accumulators).
// Q·Kᵀ of a warp's 32-key block: s[j][e] = scale · q_g · key(8j + 2t + e) + bias[j][e] (lane 4g + t;
// s[j][2..3] are the unused rows g + 8). qa: query g's quarter of the dims; kq[j]: key 8j + g's.
template <class T, int STEPS, int QUARTER>
__device__ __forceinline__ void block_scores(float (&s)[4][4], const uint32_t (&qa)[2 * STEPS],
                                             const uint4 (&kq)[4][QUARTER], const float (&bias)[4][2], float scale) {
#pragma unroll
  for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const uint32_t af[4] = {qa[2 * st], 0u, qa[2 * st + 1], 0u};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&kq[j][0]);
      mma_16816<T>(s[j], af, w[2 * st], w[2 * st + 1]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) s[j][e] = s[j][e] * scale + bias[j][e];
}

// The online softmax of query g over a block: its running max m (the same in its 4 lanes), this
// lane's share l of the sum and O rescaled; the keys' weights as P's A fragments (k-steps of 16 keys:
// tile 2u gives keys 2t, 2t + 1, tile 2u + 1 keys 2t + 8, 2t + 9).
template <class T, int TILES>
__device__ __forceinline__ void block_softmax(const float (&s)[4][4], float& m, float& l, float (&o)[TILES][4],
                                              uint32_t (&pa)[2][4]) {
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < 4; ++j) mx = fmaxf(mx, fmaxf(s[j][0], s[j][1]));
  mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float alpha = m_new == -INFINITY ? 1.f : __expf(m - m_new);
  m = m_new;
  float p[4][2];
  l *= alpha;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      p[j][e] = m_new == -INFINITY ? 0.f : __expf(s[j][e] - m_new);
      l += p[j][e];
    }
#pragma unroll
  for (int n = 0; n < TILES; ++n) o[n][0] *= alpha, o[n][1] *= alpha;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    pa[u][0] = pack2<T>(p[2 * u][0], p[2 * u][1]);
    pa[u][1] = 0u;
    pa[u][2] = pack2<T>(p[2 * u + 1][0], p[2 * u + 1][1]);
    pa[u][3] = 0u;
  }
}

// O += P·V over the warp's 32 staged value rows: V's B fragments by ldmatrix (transposed). Matrix i of a
// load holds keys 16u + 8·(i mod 2) + 0..7 and the dims of tile n + i / 2; lane 8i + r gives the
// address of its row r.
template <class T, int D>
__device__ __forceinline__ void block_values(float (&o)[D / 8][4], const uint32_t (&pa)[2][4], const T* staged,
                                             int lane) {
  const int i = lane / 8;
#pragma unroll
  for (int n = 0; n < D / 8; n += 2)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, staged + swizzled_piece(16 * u + 8 * (i & 1) + lane % 8, n + (i >> 1), D / 8) * 8);
      mma_16816<T>(o[n], pa[u], bv[0], bv[1]);
      mma_16816<T>(o[n + 1], pa[u], bv[2], bv[3]);
    }
}

template <class T, int D, int G>
__global__ void __launch_bounds__(WARPS * 32) decode_attention_kernel(DecodeAttentionArgs a, int chunk, int splits,
                                                                     bool clustered) {
  static_assert(G <= 8 && (D == 64 || D == 128), "queries are the mma's rows g < 8; D/4 dims a lane");
  if (splits == 1 || clustered) pdl_launch_dependents();
  constexpr int ROW_CHUNKS = D / 8;   // 16-byte pieces of a key or value row
  constexpr int QUARTER = D / 32;     // 16-byte pieces of a lane's quarter of a row
  constexpr int STEPS = D / 16;       // k-steps of Q·Kᵀ
  constexpr int TILES = D / 8;        // 8-dim tiles of O
  // a warp's 32 value rows, staged while its scores are computed; after the loop the same bytes
  // hold the warps' partial sums
  constexpr int STAGE_BYTES = WARPS * 32 * D * static_cast<int>(sizeof(T));
  constexpr int SUM_BYTES = WARPS * G * D * static_cast<int>(sizeof(float));
  __shared__ __align__(16) unsigned char pool[STAGE_BYTES > SUM_BYTES ? STAGE_BYTES : SUM_BYTES];
  __shared__ __align__(16) T qs[G][D];
  __shared__ float red_m[WARPS][G], red_l[WARPS][G], red_w[WARPS][G], red_stat[G][2];
  __shared__ __align__(16) T knew[D];  // rope: the new token's roped key
  __shared__ float mine[G][D + 2];      // clustered: this split's partial (acc, max, sum), read by the cluster
  const int bk = blockIdx.y, b = bk / a.kv_heads, kvh = bk % a.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
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
  // a block's value rows start copying to shared memory, rows past the end are zeroed (their weight
  // is 0, and 0 · NaN would not be); `cached_only`: not the new token's row, whose value v_new the
  // previous kernel writes
  auto stage_values = [&](int base, bool cached_only) {
    for (int c = lane; c < 32 * ROW_CHUNKS; c += 32) {
      const int r = c / ROW_CHUNKS, piece = c % ROW_CHUNKS;
      const long long row = base + r;
      T* dst = staged + swizzled_piece(r, piece, D / 8) * 8;
      if (row >= end) *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      else if (row != slot) cp_async16(dst, values + row * D + piece * 8);
      else if (!cached_only) cp_async16(dst, vnew + piece * 8);
    }
  };
  uint4 kq[4][QUARTER];  // key tile j: row base + 8j + g, lane t's quarter
  float bias[4][2];       // mask terms of the keys whose scores this lane holds: base + 8j + 2t + e
  // the new token's key comes from knew (once staged: `fresh`), not from the row being written
  auto load_keys = [&](int base, bool fresh) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int key = base + 8 * j + g;
      if (key < end) {
        const uint4* row = reinterpret_cast<const uint4*>(keys + static_cast<long long>(key) * D) + t * QUARTER;
        if (key != slot) {
#pragma unroll
          for (int c = 0; c < QUARTER; ++c) kq[j][c] = __ldg(row + c);
        } else if (fresh) {
#pragma unroll
          for (int c = 0; c < QUARTER; ++c) kq[j][c] = reinterpret_cast<const uint4*>(knew)[t * QUARTER + c];
        }
      } else {  // past the end: zeros, so that its score is −∞ (bias) and not NaN from stale registers
#pragma unroll
        for (int c = 0; c < QUARTER; ++c) kq[j][c] = make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int k2 = base + 8 * j + 2 * t + e;
        bias[j][e] = k2 < end ? mask_term<T>(a, b, k2) : -INFINITY;
      }
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
      for (int c = lane; c < ROW_CHUNKS; c += 32)
        cp_async16(staged + swizzled_piece(static_cast<int>(slot - base), c, D / 8) * 8, vnew + c * 8);
    const T* cs = static_cast<const T*>(a.cos) + b * a.cos_stride;
    const T* sn = static_cast<const T*>(a.sin) + b * a.cos_stride;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
      qs[i / D][i % D] = roped<T, D>(q + (i / D) * D, cs, sn, i % D);
    if (slot >= begin && slot < end) {  // this CTA's keys hold the new token
      const T* k_new = static_cast<const T*>(a.k_new) + b * a.new_stride + kvh * D;
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        knew[d] = roped<T, D>(k_new, cs, sn, d);
        const_cast<T*>(keys)[slot * D + d] = knew[d];
        const_cast<T*>(values)[slot * D + d] = vnew[d];
      }
    }
  } else {
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) qs[i / D][i % D] = q[i];
  }
  __syncthreads();
  if (base < end && slot >= base && slot < base + 32 && (slot - base) % 8 == g) load_keys(base, true);
  uint32_t qa[2 * STEPS];  // query g's quarter (lane t), words 2s, 2s + 1 of k-step s; rows ≥ G are 0
#pragma unroll
  for (int c = 0; c < QUARTER; ++c) {
    const uint4* row = reinterpret_cast<const uint4*>(qs[g < G ? g : 0]) + t * QUARTER;
    const uint4 w = g < G ? row[c] : make_uint4(0u, 0u, 0u, 0u);
    qa[4 * c] = w.x, qa[4 * c + 1] = w.y, qa[4 * c + 2] = w.z, qa[4 * c + 3] = w.w;
  }
  float m = -INFINITY, l = 0.f;  // query g's running max, and this lane's share of its sum
  float o[TILES][4];              // O = P·V: query g, dims 8n + 2t, 2t + 1 (o[n][2..3]: rows g + 8, unused)
#pragma unroll
  for (int n = 0; n < TILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  for (; base < end; base += WARPS * 32) {
    const int next = base + WARPS * 32;
    float s[4][4];
    block_scores<T, STEPS, QUARTER>(s, qa, kq, bias, a.scale);
    if (next < end) load_keys(next, true);  // the next block's keys during this one's values
    uint32_t pa[2][4];
    block_softmax<T, TILES>(s, m, l, o, pa);
    cp_async_wait_all();
    __syncwarp();
    block_values<T, D>(o, pa, staged, lane);
    __syncwarp();  // every lane done with the staged rows before the next block's copies
    if (next < end) stage_values(next, false);
  }
  l += __shfl_xor_sync(FULL, l, 1);
  l += __shfl_xor_sync(FULL, l, 2);
  merge_warps<T, D, G>(a, pool, red_m, red_l, red_w, red_stat, mine, m, l, o, b, bk, kvh, splits, clustered);
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
    const float wt = partial_weight(ms, mx);
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
  // at most two CTAs an SM, which the kernel's registers allow (229 at D = 128): rounded up, the
  // count left CTAs for a second wave (batch 8, 1024 keys: 5 splits, 320 CTAs, 26.2 µs against the
  // per-lane kernel's 24.4 at three an SM; results/kernels_h200/v24/)
  int splits = 2 * num_sms / pairs;
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
