// Standalone prototype benchmark: new fused TCQ dequant+GEMV vs a straightforward reference and
// vs cuBLAS fp16, on the Llama-3.1-8B shapes, batch 1 and 8, KV = 4, 6, 8 (tcq-2.0/3.0/4.0).
// nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o bench bench.cu -lcublas
// ./bench [--quick] [--only N K]
#ifndef NO_CUBLAS
#include <cublas_v2.h>
#endif
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tcq_common.cuh"
#include "tcq_gemv.cuh"

using namespace kv2;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
              __LINE__, #x);                                                             \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
#ifndef NO_CUBLAS
#define CB(x)                                                                       \
  do {                                                                              \
    cublasStatus_t s_ = (x);                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                              \
      fprintf(stderr, "cuBLAS error %d at %s:%d\n", (int)s_, __FILE__, __LINE__);   \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)
#endif

static inline uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static inline float urand(uint64_t seed, uint64_t i) {  // [0, 1)
  return static_cast<float>(mix(seed * 0x100000001B3ull + i) >> 40) / 16777216.0f;
}
static inline uint16_t f2h(float f) {
  __half h = __float2half_rn(f);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

// ---------------- reference (today's format, straightforward) ------------------------------
__global__ void ref_decode(const uint32_t* codes, const uint32_t* T, const __half* scale, float* W,
                           int RT, int CT, int kv) {
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long total = static_cast<long long>(RT) * CT * 128;
  if (idx >= total) return;
  const long long tile = idx / 128;
  const int t = static_cast<int>(idx % 128);
  const int i = static_cast<int>(tile / CT), j = static_cast<int>(tile % CT);
  const uint32_t v = ref_value(ref_state(codes + tile * 4 * kv, kv, t), T);
  const int K = CT * 16;
  for (int e = 0; e < 2; ++e) {
    int r, c;
    frag_pos(2 * t + e, r, c);
    const uint16_t hb = static_cast<uint16_t>(e ? v >> 16 : v & 0xFFFFu);
    const float val = __half2float(__ushort_as_half(hb));
    W[static_cast<size_t>(16 * i + r) * K + 16 * j + c] = val * __half2float(scale[16 * i + r]);
  }
}
// y[n][r] = sum_k x[n][k] * W[r][k], one warp a row, fp64 accumulation
__global__ void ref_matmul(const float* W, const __half* x, float* y, int N, int K, int m) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (r >= N) return;
  for (int n = 0; n < m; ++n) {
    double s = 0;
    for (int k = lane; k < K; k += 32)
      s += static_cast<double>(W[static_cast<size_t>(r) * K + k]) * __half2float(x[static_cast<size_t>(n) * K + k]);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) y[static_cast<size_t>(n) * N + r] = static_cast<float>(s);
  }
}

// ---------------- host: codes in today's format, repack to the new layout -----------------
static void gen_codes(std::vector<uint32_t>& c, size_t words, uint64_t seed) {
  c.resize(words);
  for (size_t i = 0; i < words; ++i) c[i] = static_cast<uint32_t>(mix(seed ^ (i * 0x2545F4914F6CDD1Dull)));
}
static void repack(const std::vector<uint32_t>& today, std::vector<uint32_t>& out, int RT, int CT, int kv) {
  const int CG = CT / 8, tw = 4 * kv;
  out.assign(today.size(), 0u);
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < CG; ++j) {
      uint32_t* blk = out.data() + (static_cast<size_t>(i) * CG + j) * 32 * kv;
      const uint32_t* tiles = today.data() + (static_cast<size_t>(i) * CT + 8 * j) * tw;
      for (int l = 0; l < 32; ++l) {
        uint32_t own[8], w[8];
        for (int u = 0; u < 8; ++u) own[u] = own_bits(tiles + u * tw, kv, l);
        pack_lane(kv, own, w);
        for (int q = 0; q < kv; ++q) blk[block_word(kv, l, q)] = w[q];
      }
    }
}

// ---------------- launching the new kernel -------------------------------------------------
struct Cfg {
  int KT, NW, CS;
};
static Cfg pick_cfg(int N, int K) {
  if (K == 14336) return {16, 14, 4};
  return {16, 16, 1};  // K = 4096; for N < 132*16 this leaves SMs idle (measured faster than CS = 2)
}
static bool cfg_ok(const Cfg& c, int K) {
  return (c.CS == 1 && c.KT == 16 && c.NW == 16 && K / 16 == 256) || (c.CS == 2 && c.KT == 8 && c.NW == 16 && K / 16 == 256) ||
         (c.CS == 4 && c.KT == 16 && c.NW == 14 && K / 16 == 896) || (c.CS == 8 && c.KT == 8 && c.NW == 14 && K / 16 == 896);
}
static int g_rr = 0;        // 0: rr_pick's default rounds/ring depth
// rounds of row tiles between reductions = depth of the code prefetch ring (items), from the sweep
// in results (dev6): 3 for KV 4 and 6, 2 for KV 8; 2 when a CTA has at most 3 row tiles
template <int KV>
constexpr int rr_of() {
  return KV == 8 ? 2 : 3;
}
static int rr_pick(int kv, int rows_per_cta) {
  if (g_rr) return g_rr;
  return rows_per_cta <= 3 ? 2 : (kv == 8 ? 2 : 3);
}

struct KInfo {
  int regs, lmem;
  size_t smem;
  int ncl;
};

template <int KV, int KT, int NW, int CS, int RR>
static KInfo prep(GemvParams& p, int num_sms) {
  auto kern = tcq_gemv<KV, KT, NW, RR, CS>;
  const size_t smem = gemv_smem_bytes<NW, RR, CS>(p.K);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  if (CS > 1) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, kern));
  int ncl = num_sms;
  if (CS > 1) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CS;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(CS * 64);
    cfg.blockDim = dim3(NW * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaOccupancyMaxActiveClusters(&ncl, kern, &cfg));
  }
  ncl = std::min(ncl, p.RT);
  p.ncl = ncl;
  if ((p.RT + ncl - 1) / ncl > MAX_ROWS || 8 * (p.K / CS / 8) > 8 * NW * 32) {
    fprintf(stderr, "config limits exceeded\n");
    exit(1);
  }
  return {fa.numRegs, static_cast<int>(fa.localSizeBytes), smem, ncl};
}

static bool g_pdl = false;  // programmatic dependent launch on the timed launches
static int g_stagger = 0;
template <int KV, int KT, int NW, int CS, int RR>
static void launch(const GemvParams& p, cudaStream_t st) {
  auto kern = tcq_gemv<KV, KT, NW, RR, CS>;
  const size_t smem = gemv_smem_bytes<NW, RR, CS>(p.K);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at[2];
  int na = 0;
  if (CS > 1) {
    at[na].id = cudaLaunchAttributeClusterDimension;
    at[na].val.clusterDim.x = CS;
    at[na].val.clusterDim.y = 1;
    at[na].val.clusterDim.z = 1;
    ++na;
  }
  if (g_pdl) {
    at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.gridDim = dim3(p.ncl * CS);
  cfg.blockDim = dim3(NW * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = at;
  cfg.numAttrs = na;
  GemvParams q = p;
  q.pdl = g_pdl ? 1 : 0;
  q.stagger = g_stagger;
  CK(cudaLaunchKernelEx(&cfg, kern, q));
}

template <int KV>
static KInfo prep_any(const Cfg& c, GemvParams& p, int sms) {
  constexpr int R = rr_of<KV>();
  if (c.CS == 1) {
    const int ncl = std::min(sms, p.RT), rr = rr_pick(KV, (p.RT + ncl - 1) / ncl);
    if (rr == 2) return prep<KV, 16, 16, 1, 2>(p, sms);
    if (rr == 4) return prep<KV, 16, 16, 1, 4>(p, sms);
    return prep<KV, 16, 16, 1, 3>(p, sms);
  }
  if (c.CS == 2) return prep<KV, 8, 16, 2, R>(p, sms);
  return prep<KV, 16, 14, 4, R>(p, sms);
}
template <int KV>
static void launch_any(const Cfg& c, const GemvParams& p, cudaStream_t st) {
  constexpr int R = rr_of<KV>();
  if (c.CS == 1) {
    const int rr = rr_pick(KV, (p.RT + p.ncl - 1) / p.ncl);
    if (rr == 2) return launch<KV, 16, 16, 1, 2>(p, st);
    if (rr == 4) return launch<KV, 16, 16, 1, 4>(p, st);
    return launch<KV, 16, 16, 1, 3>(p, st);
  }
  if (c.CS == 2) return launch<KV, 8, 16, 2, R>(p, st);
  return launch<KV, 16, 14, 4, R>(p, st);
}
static KInfo prep_kv(int kv, const Cfg& c, GemvParams& p, int sms) {
  return kv == 4 ? prep_any<4>(c, p, sms) : kv == 6 ? prep_any<6>(c, p, sms) : prep_any<8>(c, p, sms);
}
static void launch_kv(int kv, const Cfg& c, const GemvParams& p, cudaStream_t st) {
  if (kv == 4) launch_any<4>(c, p, st);
  else if (kv == 6) launch_any<6>(c, p, st);
  else launch_any<8>(c, p, st);
}

// ---------------- timing: CUDA graph of ncap launches cycling the weight copies -------------
static double time_graph(const std::function<void(cudaStream_t, int)>& fn, int ncopies, cudaStream_t st,
                         int reps = 7) {
  const int ncap = std::max(ncopies, 100);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < ncap; ++i) fn(st, i % ncopies);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, st));
  CK(cudaGraphLaunch(ge, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> v;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    v.push_back(1000.0 * ms / ncap);
  }
  std::sort(v.begin(), v.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return v[v.size() / 2];  // median µs per call
}

static int copies_for(size_t bytes) {
  const size_t target = 256ull << 20;  // >> 50 MB L2
  return static_cast<int>(std::max<size_t>(2, (target + bytes - 1) / bytes));
}

// ---------------- diagnostics --------------------------------------------------------------
__global__ void empty_kernel(int) {}
// the same bytes as the codes+scales of a layer, read once with 16-byte coalesced loads by a
// persistent grid (132 x 512 threads, 4 loads in flight a thread): the copy-bandwidth floor
__global__ void __launch_bounds__(512) stream_kernel(const uint4* a, size_t n4, uint32_t* out) {
  uint32_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n4; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = ldg_stream4(a + i + k * stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n4; i += stride) {
    const uint4 v = ldg_stream4(a + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

struct Row {
  int N, K, kv, m;
  double us, us_pdl, floor_us, frac, cublas_us;
  double err;
  std::string cfg;
};

int main(int argc, char** argv) {
  bool quick = false, ncu = false;
  int onlyN = 0, onlyK = 0, onlyKV = 0, onlyM = 0;
  Cfg force = {0, 0, 0};
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--only") && i + 2 < argc) {
      onlyN = atoi(argv[i + 1]);
      onlyK = atoi(argv[i + 2]);
      i += 2;
    } else if (!strcmp(argv[i], "--ncu") && i + 4 < argc) {  // one config, 3 launches, no timing
      ncu = true;
      onlyN = atoi(argv[i + 1]);
      onlyK = atoi(argv[i + 2]);
      onlyKV = atoi(argv[i + 3]);
      onlyM = atoi(argv[i + 4]);
      i += 4;
    } else if (!strcmp(argv[i], "--rr") && i + 1 < argc) {
      g_rr = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--stagger")) {
      g_stagger = 1;
    } else if (!strcmp(argv[i], "--cfg") && i + 3 < argc) {
      force = {atoi(argv[i + 1]), atoi(argv[i + 2]), atoi(argv[i + 3])};
      i += 3;
    }
  }
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int sm_clock_khz = 0;
  cudaDeviceGetAttribute(&sm_clock_khz, cudaDevAttrClockRate, dev);
  printf("stagger=%d rr=%d (0 = default: 2 for KV 8 or <= 3 row tiles a CTA, else 3)\n", g_stagger, g_rr);
  printf("device: %s, %d SMs, max SM clock %.0f MHz, L2 %d MB\n", prop.name, prop.multiProcessorCount,
         sm_clock_khz / 1000.0, prop.l2CacheSize >> 20);
  const int sms = prop.multiProcessorCount;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
#ifndef NO_CUBLAS
  cublasHandle_t hb;
  CB(cublasCreate(&hb));
  CB(cublasSetStream(hb, st));
  void* cublas_ws;
  CK(cudaMalloc(&cublas_ws, 32 << 20));
  CB(cublasSetWorkspace(hb, cublas_ws, 32 << 20));
#endif
  uint32_t* dsink;
  CK(cudaMalloc(&dsink, 64));
  if (!ncu) {
    auto fn = [&](cudaStream_t s, int) { empty_kernel<<<sms, 512, 0, s>>>(0); };
    printf("empty kernel (%d x 512 threads) in the same graph harness: %.2f us per launch\n", sms,
           time_graph(fn, 1, st));
  }

  const int shapes[6][2] = {{14336, 4096}, {4096, 4096}, {1024, 4096}, {4096, 14336}, {28672, 4096}, {6144, 4096}};
  const int kvs[3] = {4, 6, 8};
  const int batches[2] = {1, 8};
  std::vector<Row> rows;
  bool all_ok = true;

  const int MAXK = 14336, MAXN = 28672;
  std::vector<uint16_t> hx(8 * MAXK);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = f2h(2.f * urand(7, i) - 1.f);
  __half* dx;
  CK(cudaMalloc(&dx, hx.size() * 2));
  CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  __half* dy;
  CK(cudaMalloc(&dy, 8 * MAXN * 2));
  float* dyref;
  CK(cudaMalloc(&dyref, 8 * MAXN * 4));
  std::vector<uint32_t> hT(512);
  for (int i = 0; i < 512; ++i) {
    float a = 0, b = 0;  // roughly N(0,1)-like entries (sum of uniforms), both halves fp16
    for (int k = 0; k < 4; ++k) {
      a += urand(11, 8 * i + k) - 0.5f;
      b += urand(12, 8 * i + k) - 0.5f;
    }
    hT[i] = f2h(1.7f * a) | (static_cast<uint32_t>(f2h(1.7f * b)) << 16);
  }
  uint32_t* dT;
  CK(cudaMalloc(&dT, 512 * 4));
  CK(cudaMemcpy(dT, hT.data(), 2048, cudaMemcpyHostToDevice));

  for (auto& sh : shapes) {
    const int N = sh[0], K = sh[1];
    if (onlyN && (N != onlyN || K != onlyK)) continue;
    const int RT = N / 16, CT = K / 16;
    double cub[2] = {0, 0};
#ifndef NO_CUBLAS
    if (!ncu) {
      const size_t wbytes = static_cast<size_t>(N) * K * 2;
      const int nc = copies_for(wbytes);
      __half* dW;
      CK(cudaMalloc(&dW, wbytes * nc));
      CK(cudaMemset(dW, 0x3c, wbytes * nc));  // values do not matter for timing
      const float alpha = 1.f, beta = 0.f;
      for (int bi = 0; bi < 2; ++bi) {
        const int m = batches[bi];
        auto fn = [&](cudaStream_t, int c) {
          CB(cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, N, m, K, &alpha, dW + static_cast<size_t>(c) * N * K,
                          CUDA_R_16F, K, dx, CUDA_R_16F, K, &beta, dy, CUDA_R_16F, N, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT));
        };
        cub[bi] = time_graph(fn, nc, st);
      }
      CK(cudaFree(dW));
    }
#endif
    for (int kv : kvs) {
      if (quick && kv == 6) continue;
      if (onlyKV && kv != onlyKV) continue;
      const size_t words = static_cast<size_t>(RT) * CT * 4 * kv;
      std::vector<uint32_t> today, packed;
      gen_codes(today, words, 1000 + N + K + kv);
      repack(today, packed, RT, CT, kv);
      std::vector<uint16_t> hs(N);
      for (int r = 0; r < N; ++r) hs[r] = f2h(0.01f + 0.01f * urand(5 + kv, r));
      const size_t cbytes = words * 4, sbytes = static_cast<size_t>(N) * 2;
      const int nc = ncu ? 1 : copies_for(cbytes + sbytes);
      uint32_t *dtoday, *dcodes;
      __half* dscale;
      CK(cudaMalloc(&dtoday, cbytes));
      CK(cudaMemcpy(dtoday, today.data(), cbytes, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&dcodes, cbytes * nc));
      CK(cudaMalloc(&dscale, sbytes * nc));
      CK(cudaMemcpy(dcodes, packed.data(), cbytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dscale, hs.data(), sbytes, cudaMemcpyHostToDevice));
      for (int c = 1; c < nc; ++c) {
        CK(cudaMemcpyAsync(reinterpret_cast<char*>(dcodes) + c * cbytes, dcodes, cbytes, cudaMemcpyDeviceToDevice, st));
        CK(cudaMemcpyAsync(reinterpret_cast<char*>(dscale) + c * sbytes, dscale, sbytes, cudaMemcpyDeviceToDevice, st));
      }
      float* dW = nullptr;
      if (!ncu) {  // reference W (fp32, scaled) from TODAY's format
        CK(cudaMalloc(&dW, static_cast<size_t>(N) * K * 4));
        const long long tot = static_cast<long long>(RT) * CT * 128;
        ref_decode<<<static_cast<unsigned>((tot + 255) / 256), 256, 0, st>>>(dtoday, dT, dscale, dW, RT, CT, kv);
        CK(cudaGetLastError());
      }
      std::vector<Cfg> cfgs = {pick_cfg(N, K)};
      if (force.KT && cfg_ok(force, K)) cfgs = {force};
      if (!ncu && !force.KT && N == 1024) cfgs.push_back({8, 16, 2});   // alternative: 64 clusters of 2

      double floor_us = 0;
      if (!ncu) {
        auto fn = [&](cudaStream_t s, int c) {
          stream_kernel<<<sms, 512, 0, s>>>(reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(dcodes) + c * cbytes),
                                           cbytes / 16, dsink);
        };
        floor_us = time_graph(fn, nc, st);
      }
      for (size_t ci = 0; ci < cfgs.size(); ++ci) {
        const Cfg cfg = cfgs[ci];
        GemvParams p{};
        p.codes = reinterpret_cast<const uint4*>(dcodes);
        p.row_scale = dscale;
        p.T = dT;
        p.x = dx;
        p.y = dy;
        p.N = N;
        p.K = K;
        p.RT = RT;
        p.CT = CT;
        p.CG = CT / 8;
        const KInfo ki = prep_kv(kv, cfg, p, sms);
        char cfgs_txt[160];
        snprintf(cfgs_txt, sizeof cfgs_txt, "KT=%d NW=%d CS=%d RR=%d regs=%d lmem=%d smem=%zu grid=%dx%d", cfg.KT, cfg.NW,
                 cfg.CS, cfg.CS == 1 ? rr_pick(kv, (RT + ki.ncl - 1) / ki.ncl) : (kv == 8 ? 2 : 3), ki.regs, ki.lmem, ki.smem, ki.ncl, cfg.CS);
        for (int bi = 0; bi < 2; ++bi) {
          const int m = batches[bi];
          if (onlyM && m != onlyM) continue;
          p.m = m;
          if (ncu) {
            for (int r = 0; r < 3; ++r) launch_kv(kv, cfg, p, st);
            CK(cudaStreamSynchronize(st));
            printf("ncu mode: N=%d K=%d kv=%d m=%d %s\n", N, K, kv, m, cfgs_txt);
            continue;
          }
          ref_matmul<<<(N + 7) / 8, 256, 0, st>>>(dW, dx, dyref, N, K, m);
          CK(cudaGetLastError());
          double err = 0;
          bool nonfinite = false;
          for (int pdl = 0; pdl < 2; ++pdl) {  // check the output of both launch modes
            g_pdl = pdl;
            CK(cudaMemsetAsync(dy, 0xFF, static_cast<size_t>(8) * N * 2, st));  // NaN poison
            launch_kv(kv, cfg, p, st);
            CK(cudaStreamSynchronize(st));
            std::vector<uint16_t> hy(static_cast<size_t>(m) * N);
            std::vector<float> hr(static_cast<size_t>(m) * N);
            CK(cudaMemcpy(hy.data(), dy, hy.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hr.data(), dyref, hr.size() * 4, cudaMemcpyDeviceToHost));
            double maxref = 0, maxdiff = 0;
            for (size_t i = 0; i < hr.size(); ++i) {
              __half h;
              memcpy(&h, &hy[i], 2);
              const float v = __half2float(h);
              if (!std::isfinite(v)) nonfinite = true;
              maxref = std::max(maxref, static_cast<double>(fabsf(hr[i])));
              maxdiff = std::max(maxdiff, static_cast<double>(fabsf(v - hr[i])));
            }
            err = std::max(err, nonfinite ? INFINITY : maxdiff / maxref);
          }
          if (!(err < 2e-3)) all_ok = false;
          double us[2];
          for (int pdl = 0; pdl < 2; ++pdl) {
            g_pdl = pdl;
            auto fn = [&](cudaStream_t s, int c) {
              GemvParams q = p;
              q.codes = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(dcodes) + c * cbytes);
              q.row_scale = reinterpret_cast<const __half*>(reinterpret_cast<const char*>(dscale) + c * sbytes);
              launch_kv(kv, cfg, q, s);
            };
            us[pdl] = time_graph(fn, nc, st);
          }
          g_pdl = false;
          const double roof = (cbytes + sbytes) / 3.0e12 * 1e6;
          if (ci == 0) rows.push_back({N, K, kv, m, us[0], us[1], floor_us, roof / us[0], cub[bi], err, cfgs_txt});
          printf("N=%5d K=%5d tcq-%.1f b%d  ours %6.2f us  ours+PDL %6.2f us  roofline %5.2f us (%3.0f%%)  copy-floor %5.2f us  "
                 "cuBLAS %6.2f us  err %.2e%s  [%s copies=%d]%s\n",
                 N, K, kv / 2.0, m, us[0], us[1], roof, 100 * roof / us[0], floor_us, cub[bi], err,
                 nonfinite ? " NONFINITE" : "", cfgs_txt, nc, ci ? "  (alternative config)" : "");
          fflush(stdout);
        }
      }
      if (dW) CK(cudaFree(dW));
      CK(cudaFree(dtoday));
      CK(cudaFree(dcodes));
      CK(cudaFree(dscale));
    }
  }
  if (ncu) return 0;
  printf("\n| N x K | entry | b1 ours | b1 ours+PDL | b1 frac of roofline (ours) | b1 cuBLAS | b8 ours | b8 ours+PDL | b8 cuBLAS | b8/b1 (ours, PDL) | copy floor | max err b1, b8 |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i + 1 < rows.size(); i += 2) {
    const Row &a = rows[i], &b = rows[i + 1];
    printf("| %dx%d | tcq-%.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f, %.2f | %.2f | %.1e, %.1e |\n", a.N,
           a.K, a.kv / 2.0, a.us, a.us_pdl, a.frac, a.cublas_us, b.us, b.us_pdl, b.cublas_us, b.us / a.us,
           b.us_pdl / a.us_pdl, a.floor_us, a.err, b.err);
  }
  printf(all_ok ? "\nCORRECTNESS: all configurations within 2e-3 (max |y-yref| / max |yref|), both launch modes\n"
                : "\nCORRECTNESS: FAILURES above\n");
  return all_ok ? 0 : 1;
}
