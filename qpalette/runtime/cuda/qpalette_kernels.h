// Host interface of the qpalette CUDA kernels: plain C++ (no CUDA or PyTorch types), so that the
// PyTorch binding (bindings.cpp) and the kernel translation units agree without sharing headers.
#pragma once

#include <stdint.h>

namespace qp {

enum Family : int { PAIR = 0, SCALAR = 1, TCQ = 2, HALF_TCQ = 3 };
enum DType : int { F16 = 0, BF16 = 1 };
enum Status : int { OK = 0, NOT_BUILT = -1, UNSUPPORTED = -2 };

// Lane-major code tensors (qpalette/runtime/lanes.py): (rows/16, groups, 32·words) int32 each;
// half-TCQ has two, over the first and second half of the input columns.
struct Codes {
  const void* a;
  const void* b;    // half-TCQ only, else nullptr
  int groups_a, tiles_a;  // groups and real (unpadded) 16-column tiles a row tile
  int groups_b, tiles_b;
};

// y[m, rows] = x[m, cols] · (decode(codes) ⊙ row_scale)ᵀ for 1 ≤ m ≤ 8; with `signs`,
// x ← H(s ⊙ x)/√cols first, H = H_K ⊗ H_{cols/K} (the online rotation fused: cols/K a power of
// two 8..4096, every CTA of a K split holding whole segments of cols/K, else UNSUPPORTED).
struct GemvArgs {
  Codes codes;
  const void* x;          // activations (m, ldx) in dtype
  const uint8_t* signs;   // bit-packed rotation signs (cols/8 bytes, MSB first, set = −1) or nullptr
  const void* hk_neg;     // the rotation's factor H_K as K 64-bit row masks (bit a set ⇔ H_K[j, a] = −1),
                          // nullptr when K = 1
  int rot_k;              // K ≤ 64
  int gated;              // x rows hold [gate | up] (2·cols values): the input is silu(gate) ⊙ up (needs signs)
  // add + RMSNorm in the prologue (needs signs, K = 1, the row in one CTA, else UNSUPPORTED): the
  // input is rmsnorm(x + x_add) ⊙ norm_w (LlamaRMSNorm's rounding), x + x_add written to h_out;
  // x_add, h_out: (m, cols) contiguous or both nullptr; norm_w (cols,) in dtype or nullptr
  const void* norm_w;
  float norm_eps;
  const void* x_add;
  void* h_out;
  const void* y_add;      // (m, ldy) in dtype added to y (a residual after the matmul), or nullptr
  long long ldx;
  void* y;                // output (m, ldy) in dtype
  long long ldy;
  const void* row_scale;  // fp16 (rows,)
  const void* lut;        // the codebook: 32-bit entries, value pairs in dtype (scalar: low half)
  int m, rows, cols;
  int dtype;
  int num_sms;
  int pdl;                // launch as a programmatic dependent launch (Hopper)
  void* stream;           // cudaStream_t
  // MoE experts in one launch (m = 1, x: (tokens, ldx), y: (slots, ldy)): y row v = x row x_rows[v] ·
  // W_jᵀ for j = members[v] ≥ 0, zeros for j < 0. Member j's matrix (same shape and entry as `codes`,
  // `row_scale`, `signs`, which describe member 0) is at the device addresses experts[4j .. 4j+3]:
  // codes a, codes b (0 unless half-TCQ), row_scale, signs. All int64 device arrays; nullptr: one matrix.
  const void* experts;
  const void* members;
  const void* x_rows;
  int slots;
};

// W_r = decode(codes) ⊙ row_scale as a dense (rows, cols) matrix in dtype.
struct DequantArgs {
  Codes codes;
  const void* row_scale;
  const void* lut;
  void* w;
  int rows, cols;
  int dtype;
  int num_sms;
  void* stream;
};

// p0, p1: family parameters — PAIR: code bits per pair; SCALAR: bits; TCQ: KV, Q;
// HALF_TCQ: KV of the first half (the second is KV + 1), Q. Return OK, a cudaError_t value,
// NOT_BUILT for parameters no kernel is built for, UNSUPPORTED for a shape the GEMV cannot split.
int gemv(const GemvArgs& a, int family, int p0, int p1);
int dequant(const DequantArgs& a, int family, int p0, int p1);

// What the rotation forms from x first: x itself; silu(gate) ⊙ up (`gated`: x rows are [gate | up],
// 2n wide, the product rounded to the dtype once); or rmsnorm(x + x_add) ⊙ norm_w (`norm_w`: K = 1
// only; x_add and h_out, (rows, n), both or neither: h_out ← x + x_add).
struct RotationInput {
  int gated = 0;
  const void* norm_w = nullptr;
  float norm_eps = 0.f;
  const void* x_add = nullptr;
  void* h_out = nullptr;
};

// y = H(s ⊙ x) row by row: x, y (rows, n) in dtype; signs bit-packed (n/8); hk the ±1 int8
// factor H_K (K·K, row-major; nullptr when K = 1); n = K·p2, p2 a power of two; pdl: launch as a
// programmatic dependent launch (Hopper only). UNSUPPORTED for a formed input (`in`) the kernel
// does not take: 2^m > 4096, K > 64, or a norm with K > 1.
int hadamard(const void* x, void* y, const uint8_t* signs, const int8_t* hk, int rows, int n, int k,
             int p2, int dtype, int num_sms, int pdl, void* stream, const RotationInput& in = RotationInput{});

// Tail-biting Viterbi of the TCQ trellis (qpalette/quant/trellis.py): x (n_tiles, 128, 2) float32
// tile pairs, table (2^q, 2) float32 hybrid table, paths (n_tiles, 128) int64 states out; scratch:
// the back-pointers, `viterbi_plan`'s bytes for its grid. KV = 2..10, q ≤ 11; UNSUPPORTED where the
// GPU's shared memory per block is too small (then the caller runs the reference).
struct ViterbiArgs {
  const void* x;
  const void* table;
  void* paths;
  void* scratch;
  int n_tiles, kv, q, grid;
  void* stream;  // cudaStream_t
};
int viterbi_plan(int kv, int q, int num_sms, int n_tiles, int* grid, long long* scratch_bytes);
int viterbi(const ViterbiArgs& a);

// Decode attention, one query token (decode_attention.cu): out (B, H, D) = softmax(scale · q Kᵀ + mask) V
// per head, query head h reading KV head h / (H / KV). q (B, H, D); k, v (B, KV, length, D)
// contiguous, 16-byte aligned; mask (B or 1, length): none, bool (false: not seen) or additive in
// dtype, rows mask_batch_stride elements apart (0: one row for the batch, also an expanded one).
// D = 64 or 128, H / KV ≤ 8, else UNSUPPORTED.
// `partial`: float32 scratch of B·KV·splits·(H/KV)·(D+2), splits = decode_attention_splits(…), where
// the splits merge through global memory (not decode_attention_clustered(…)).
enum MaskKind : int { MASK_NONE = 0, MASK_BOOL = 1, MASK_ADDITIVE = 2 };
constexpr int DECODE_ATTENTION_MIN_CHUNK = 128;  // fewest keys a CTA takes when the length is split (a block a warp)
constexpr int DECODE_ATTENTION_MAX_CLUSTER = 8;   // most splits merged inside one cluster (the portable cluster size)
struct DecodeAttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* mask;
  int mask_kind;
  long long mask_batch_stride;
  void* out;
  float* partial;
  int batch, heads, kv_heads, length, head_dim;
  long long q_stride;  // elements between batch rows of q
  // The new token (rope_cache_attention; plain decode attention when cos is null): q, k_new and
  // v_new are its projections before rope (k_new and v_new rows new_stride elements apart), cos and
  // sin (B or 1, D) its rope factors (cos_stride 0: one row for the batch). The kernel applies
  // rope to q and to the new key and writes the key and value to slot *slot of k and v (the caches).
  const void* k_new;
  const void* v_new;
  long long new_stride;
  const void* cos;
  const void* sin;
  long long cos_stride;
  const long long* slot;
  float scale;
  int dtype;
  int num_sms;
  int pdl;       // launched with programmatic dependent launch, so it may start during the kernel before;
                 // only on Hopper, which the caller decides (as for hadamard: ops._pdl_on)
  void* stream;  // cudaStream_t
};
int decode_attention_splits(int batch, int kv_heads, int length, int num_sms);
// the splits merge in one cluster: this GPU has clusters, 2–8 splits, batch·kv_heads·splits ≤ num_sms
bool decode_attention_clustered(int batch, int kv_heads, int splits, int num_sms);
int decode_attention(const DecodeAttentionArgs& a);

// cudaGetErrorString of a return code above.
const char* error_string(int rc);

}  // namespace qp
