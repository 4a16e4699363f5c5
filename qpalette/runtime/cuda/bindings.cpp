// PyTorch binding of the qpalette kernels (built by qpalette/runtime/kernel_build.py through
// torch.utils.cpp_extension). The torch.library custom ops that torch.compile and CUDA graphs see
// are defined in Python (qpalette/runtime/ops.py) on top of these functions.
//
// Only torch/extension.h: the caller (Python) passes the current CUDA stream and the device's
// multiprocessor count and makes x's device current, so no CUDA headers of PyTorch are needed.
#include <torch/extension.h>

#include "qpalette_kernels.h"

namespace {

int dtype_code(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "qpalette kernels take float16 or bfloat16 activations, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? qp::BF16 : qp::F16;
}

void check(int rc, const char* what) {
  TORCH_CHECK(rc != qp::NOT_BUILT, what, ": no kernel is built for these parameters");
  TORCH_CHECK(rc != qp::UNSUPPORTED, what, ": shape not supported");
  TORCH_CHECK(rc == 0, what, " failed: ", qp::error_string(rc));
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The lane-major code tensors (lanes.py) of a rows × cols matrix, checked.
qp::Codes codes_of(const at::Tensor& a, const c10::optional<at::Tensor>& b, int64_t family, int64_t rows,
                   int64_t cols) {
  const bool half = family == qp::HALF_TCQ;
  check_cuda(a, "codes");
  TORCH_CHECK(a.scalar_type() == at::kInt && a.dim() == 3 && a.size(0) == rows / 16 && rows % 16 == 0,
              "codes must be lane-major int32 (rows/16, groups, words)");
  TORCH_CHECK(half == b.has_value(), half ? "half-TCQ needs codes_b" : "only half-TCQ takes codes_b");
  qp::Codes c{};
  const int64_t tiles = half ? cols / 32 : cols / 16;
  TORCH_CHECK(cols % (half ? 32 : 16) == 0 && a.size(1) == (tiles + 7) / 8, "codes do not match the input features");
  c.a = a.data_ptr();
  c.groups_a = static_cast<int>(a.size(1));
  c.tiles_a = static_cast<int>(tiles);
  if (half) {
    check_cuda(*b, "codes_b");
    TORCH_CHECK(b->dim() == 3 && b->size(0) == rows / 16 && b->size(1) == (tiles + 7) / 8, "codes_b shape");
    c.b = b->data_ptr();
    c.groups_b = static_cast<int>(b->size(1));
    c.tiles_b = static_cast<int>(tiles);
  }
  return c;
}

// What the GEMV may form its input from and add to its output: RMSNorm weight (with an optional
// residual x_add added first, the sum written to h_out) and y_add, each checked against x and y.
struct InputOutputExtras {
  const c10::optional<at::Tensor>* norm_w = nullptr;
  double norm_eps = 0.0;
  const c10::optional<at::Tensor>* x_add = nullptr;
  const c10::optional<at::Tensor>* h_out = nullptr;
  const c10::optional<at::Tensor>* y_add = nullptr;

  static const void* ptr(const c10::optional<at::Tensor>* t, const at::Tensor& like, int64_t m, int64_t n,
                         const char* what) {
    if (!t || !t->has_value()) return nullptr;
    const at::Tensor& v = **t;
    check_cuda(v, what);
    TORCH_CHECK(v.scalar_type() == like.scalar_type() && v.is_contiguous() && v.dim() == (m ? 2 : 1) &&
                    (m ? v.size(0) == m && v.size(1) == n : v.size(0) == n),
                what, ": contiguous, the activations' dtype and shape");
    return v.data_ptr();
  }

  void fill(qp::GemvArgs& a, const at::Tensor& x, int64_t cols, int64_t rows) const {
    a.norm_w = ptr(norm_w, x, 0, cols, "norm_weight");
    a.norm_eps = static_cast<float>(norm_eps);
    a.x_add = ptr(x_add, x, x.size(0), cols, "x_add");
    a.h_out = const_cast<void*>(ptr(h_out, x, x.size(0), cols, "h_out"));
    a.y_add = ptr(y_add, x, x.size(0), rows, "y_add");
    TORCH_CHECK(!a.x_add == !a.h_out && (!a.x_add || a.norm_w), "x_add needs h_out and norm_weight");
  }
};

// The launch behind gemv and gemv_experts, into `y`; with the expert tensors, x is the first token
// row of gemv_experts' x (its stride is the row stride) and y holds every slot.
at::Tensor launch_gemv(const at::Tensor& x, const at::Tensor& codes_a, const c10::optional<at::Tensor>& codes_b,
                       const at::Tensor& row_scale, const at::Tensor& lut, int64_t family, int64_t p0, int64_t p1,
                       int64_t rows, int64_t stream, int64_t num_sms, bool pdl,
                       const c10::optional<at::Tensor>& signs, const c10::optional<at::Tensor>& hk_neg,
                       int64_t rot_k, bool gated, at::Tensor y, const at::Tensor* experts,
                       const at::Tensor* members, const at::Tensor* x_rows, const InputOutputExtras& extras = {}) {
  check_cuda(row_scale, "row_scale");
  check_cuda(lut, "lut");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8, "x must be (m ≤ 8, in)");
  TORCH_CHECK(row_scale.scalar_type() == at::kHalf && row_scale.numel() == rows, "row_scale: fp16 (rows,)");
  qp::GemvArgs a{};
  if (experts) {
    a.experts = experts->data_ptr();
    a.members = members->data_ptr();
    a.x_rows = x_rows->data_ptr();
    a.slots = static_cast<int>(members->size(0));
  }
  TORCH_CHECK(!gated || (signs.has_value() && x.size(1) % 2 == 0), "gated input: [gate | up] rows and signs");
  const int64_t cols = gated ? x.size(1) / 2 : x.size(1);
  a.gated = gated ? 1 : 0;
  a.codes = codes_of(codes_a, codes_b, family, rows, cols);
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  if (signs.has_value()) {
    check_cuda(*signs, "signs");
    TORCH_CHECK(signs->scalar_type() == at::kByte && signs->numel() * 8 == cols, "signs must be uint8 (in/8,)");
    a.signs = signs->data_ptr<uint8_t>();
    TORCH_CHECK(rot_k >= 1 && (rot_k == 1 || (hk_neg.has_value() && hk_neg->scalar_type() == at::kLong &&
                                              hk_neg->numel() == rot_k)), "H_K row masks missing");
    if (rot_k > 1) check_cuda(*hk_neg, "hk_neg");
    a.hk_neg = rot_k > 1 ? hk_neg->data_ptr() : nullptr;
    a.rot_k = static_cast<int>(rot_k);
  }
  extras.fill(a, x, cols, rows);
  a.y = y.data_ptr();
  a.ldy = rows;
  a.row_scale = row_scale.data_ptr();
  a.lut = lut.data_ptr();
  a.m = static_cast<int>(x.size(0));
  a.rows = static_cast<int>(rows);
  a.cols = static_cast<int>(cols);
  a.dtype = dtype_code(x);
  a.num_sms = static_cast<int>(num_sms);
  a.pdl = pdl ? 1 : 0;
  a.stream = reinterpret_cast<void*>(stream);
  const int rc = qp::gemv(a, static_cast<int>(family), static_cast<int>(p0), static_cast<int>(p1));
  if (rc == qp::UNSUPPORTED) return at::Tensor();
  check(rc, "qpalette quantized GEMV");
  return y;
}

// y (m, rows) = x (m, cols) · W_rᵀ, m ≤ 8 (with `signs`: x rotated first, H(s ⊙ x), H = H_K ⊗
// H_{cols/K}, `hk_neg` = H_K's rows as 64-bit masks of its −1 entries, rot_k = K); returns an
// undefined tensor when the GEMV cannot take this shape (the caller then rotates / dequantizes).
// `gated`: x is (m, 2·in) = [gate | up] and the matmul's input is silu(gate) ⊙ up (signs required).
// `norm_weight` (signs, K = 1): the input is rmsnorm(x [+ x_add]) ⊙ norm_weight, with x + x_add
// written to h_out; `y_add` is added to y (both: the decoder block's residual stream).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& codes_a, const c10::optional<at::Tensor>& codes_b,
                const at::Tensor& row_scale, const at::Tensor& lut, int64_t family, int64_t p0, int64_t p1,
                int64_t rows, int64_t stream, int64_t num_sms, bool pdl,
                const c10::optional<at::Tensor>& signs, const c10::optional<at::Tensor>& hk_neg, int64_t rot_k,
                bool gated, const c10::optional<at::Tensor>& norm_weight, double norm_eps,
                const c10::optional<at::Tensor>& x_add, const c10::optional<at::Tensor>& h_out,
                const c10::optional<at::Tensor>& y_add) {
  check_cuda(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) == x.size(1), "x must be contiguous (m, in)");
  const InputOutputExtras extras{&norm_weight, norm_eps, &x_add, &h_out, &y_add};
  return launch_gemv(x, codes_a, codes_b, row_scale, lut, family, p0, p1, rows, stream, num_sms, pdl, signs,
                     hk_neg, rot_k, gated, at::empty({x.size(0), rows}, x.options()), nullptr, nullptr, nullptr,
                     extras);
}

// MoE experts in one launch: y (slots, rows), row v = x[x_rows[v]] · W_{members[v]}ᵀ (zeros where
// members[v] < 0), member j's tensors at the addresses experts[j] = (codes_a, codes_b, row_scale,
// signs); codes_a … signs are member 0's (shapes and entry, checked like gemv's). Undefined result:
// shape not supported.
at::Tensor gemv_experts(const at::Tensor& x, const at::Tensor& x_rows, const at::Tensor& members,
                        const at::Tensor& experts, const at::Tensor& codes_a,
                        const c10::optional<at::Tensor>& codes_b, const at::Tensor& row_scale,
                        const at::Tensor& lut, int64_t family, int64_t p0, int64_t p1, int64_t rows,
                        int64_t stream, int64_t num_sms, bool pdl, const c10::optional<at::Tensor>& signs,
                        const c10::optional<at::Tensor>& hk_neg, int64_t rot_k) {
  for (const auto* t : {&x_rows, &members, &experts}) {
    check_cuda(*t, "expert index");
    TORCH_CHECK(t->scalar_type() == at::kLong, "expert indices and addresses must be int64");
  }
  TORCH_CHECK(x_rows.dim() == 1 && members.sizes() == x_rows.sizes(), "x_rows and members: (slots,)");
  TORCH_CHECK(experts.dim() == 2 && experts.size(1) == 4 && experts.size(0) >= 1, "experts: (members, 4)");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(0) >= 1 && x.stride(1) == 1, "x must be a CUDA (tokens, in) tensor with unit column stride");
  const int64_t slots = members.size(0);
  auto y = at::empty({slots, rows}, x.options());
  if (slots == 0) return y;
  auto one = launch_gemv(x.narrow(0, 0, 1), codes_a, codes_b, row_scale, lut, family, p0, p1, rows, stream,
                         num_sms, pdl, signs, hk_neg, rot_k, false, y, &experts, &members, &x_rows);
  return one.defined() ? y : one;
}

at::Tensor dequant(const at::Tensor& codes_a, const c10::optional<at::Tensor>& codes_b,
                   const at::Tensor& row_scale, const at::Tensor& lut, int64_t family, int64_t p0,
                   int64_t p1, int64_t rows, int64_t cols, at::ScalarType dtype, int64_t stream,
                   int64_t num_sms) {
  check_cuda(row_scale, "row_scale");
  check_cuda(lut, "lut");
  auto w = at::empty({rows, cols}, codes_a.options().dtype(dtype));
  qp::DequantArgs a{};
  a.codes = codes_of(codes_a, codes_b, family, rows, cols);
  a.row_scale = row_scale.data_ptr();
  a.lut = lut.data_ptr();
  a.w = w.data_ptr();
  a.rows = static_cast<int>(rows);
  a.cols = static_cast<int>(cols);
  a.dtype = dtype_code(w);
  a.num_sms = static_cast<int>(num_sms);
  a.stream = reinterpret_cast<void*>(stream);
  check(qp::dequant(a, static_cast<int>(family), static_cast<int>(p0), static_cast<int>(p1)), "qpalette dequantize");
  return w;
}

// The rotation's arguments for x (rows, ·; its shape checked first) rotated over n columns: signs
// bit-packed (n/8,), H_K for K > 1.
void check_rotation(const at::Tensor& x, const at::Tensor& signs, const c10::optional<at::Tensor>& hk, int64_t k,
                    int64_t n) {
  check_cuda(x, "x");
  check_cuda(signs, "signs");
  TORCH_CHECK(signs.scalar_type() == at::kByte && signs.numel() * 8 == n, "signs must be uint8 (n/8,)");
  TORCH_CHECK(k == 1 || (hk.has_value() && hk->numel() == k * k), "H_K missing");
}

at::Tensor hadamard(const at::Tensor& x, const at::Tensor& signs, const c10::optional<at::Tensor>& hk,
                    int64_t k, int64_t p2, int64_t stream, int64_t num_sms, bool pdl,
                    const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(x.dim() == 2, "x must be (rows, n)");
  check_rotation(x, signs, hk, k, x.size(1));
  const int n = static_cast<int>(x.size(1));
  auto y = out.has_value() ? *out : at::empty_like(x);
  TORCH_CHECK(y.is_contiguous() && y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(),
              "out must be a contiguous tensor like x");
  const int rc = qp::hadamard(x.data_ptr(), y.data_ptr(), signs.data_ptr<uint8_t>(),
                              k > 1 ? hk->data_ptr<int8_t>() : nullptr, static_cast<int>(x.size(0)), n,
                              static_cast<int>(k), static_cast<int>(p2), dtype_code(x),
                              static_cast<int>(num_sms), pdl ? 1 : 0,
                              reinterpret_cast<void*>(stream));
  check(rc, "qpalette Hadamard transform");
  return y;
}

// H(s ⊙ input) (rows, n) where the input is formed from x by the rotation kernel itself: silu(gate) ⊙ up
// (`gated`: x is (rows, 2n) = [gate | up]) or rmsnorm(x + x_add) ⊙ norm_weight (`norm_weight`; x_add
// and h_out, both or neither, h_out ← x + x_add). None where the kernel does not take the shape
// (the caller forms the input in torch).
c10::optional<at::Tensor> hadamard_formed(const at::Tensor& x, const at::Tensor& signs,
                                          const c10::optional<at::Tensor>& hk, int64_t k, int64_t p2, int64_t stream,
                                          int64_t num_sms, bool pdl, bool gated,
                                          const c10::optional<at::Tensor>& norm_weight, double norm_eps,
                                          const c10::optional<at::Tensor>& x_add,
                                          const c10::optional<at::Tensor>& h_out) {
  TORCH_CHECK(x.dim() == 2 && (!gated || x.size(1) % 2 == 0), "x must be (rows, n), or (rows, 2n) gated");
  TORCH_CHECK(!gated || !norm_weight.has_value(), "gated or normed, not both");
  const int64_t n = gated ? x.size(1) / 2 : x.size(1);
  check_rotation(x, signs, hk, k, n);
  using Extras = InputOutputExtras;
  qp::RotationInput in{};
  in.gated = gated ? 1 : 0;
  in.norm_w = Extras::ptr(&norm_weight, x, 0, n, "norm_weight");
  in.norm_eps = static_cast<float>(norm_eps);
  in.x_add = Extras::ptr(&x_add, x, x.size(0), n, "x_add");
  in.h_out = const_cast<void*>(Extras::ptr(&h_out, x, x.size(0), n, "h_out"));
  TORCH_CHECK(!in.x_add == !in.h_out && (!in.x_add || in.norm_w), "x_add needs h_out and norm_weight");
  auto y = at::empty({x.size(0), n}, x.options());
  const int rc = qp::hadamard(x.data_ptr(), y.data_ptr(), signs.data_ptr<uint8_t>(),
                              k > 1 ? hk->data_ptr<int8_t>() : nullptr, static_cast<int>(x.size(0)),
                              static_cast<int>(n), static_cast<int>(k), static_cast<int>(p2), dtype_code(x),
                              static_cast<int>(num_sms), pdl ? 1 : 0, reinterpret_cast<void*>(stream), in);
  if (rc == qp::UNSUPPORTED) return c10::nullopt;
  check(rc, "qpalette Hadamard transform");
  return y;
}

// Tail-biting TCQ Viterbi paths (n, 128) int64 of tiles x (n, 128, 2) float32 against the hybrid
// table (2^q, 2) float32, KV bits a step (trellis.quantize_tiles' kernel); undefined result where
// this GPU's shared memory cannot hold the trellis (the caller then runs the reference).
at::Tensor viterbi(const at::Tensor& x, const at::Tensor& table, int64_t kv, int64_t q, int64_t stream,
                   int64_t num_sms) {
  check_cuda(x, "x");
  check_cuda(table, "table");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(1) == 128 && x.size(2) == 2,
              "x must be float32 (tiles, 128, 2)");
  TORCH_CHECK(q >= 1 && q <= 11 && table.scalar_type() == at::kFloat && table.dim() == 2 &&
                  table.size(0) == (int64_t{1} << q) && table.size(1) == 2, "table must be float32 (2^q, 2), q ≤ 11");
  TORCH_CHECK(table.device() == x.device(), "table and x must be on one device");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31), "too many tiles for one call");
  auto paths = at::empty({x.size(0), 128}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return paths;
  qp::ViterbiArgs a{};
  long long bytes = 0;
  const int rc = qp::viterbi_plan(static_cast<int>(kv), static_cast<int>(q), static_cast<int>(num_sms),
                                  static_cast<int>(x.size(0)), &a.grid, &bytes);
  if (rc == qp::UNSUPPORTED) return at::Tensor();  // too little shared memory on this GPU
  check(rc, "qpalette Viterbi");
  auto scratch = at::empty({bytes}, x.options().dtype(at::kByte));
  a.x = x.data_ptr();
  a.table = table.data_ptr();
  a.paths = paths.data_ptr();
  a.scratch = scratch.data_ptr();
  a.n_tiles = static_cast<int>(x.size(0));
  a.kv = static_cast<int>(kv);
  a.q = static_cast<int>(q);
  a.stream = reinterpret_cast<void*>(stream);
  check(qp::viterbi(a), "qpalette Viterbi");
  return paths;
}

// The arguments both decode-attention bindings share: caches k and v (B, KV, L, D), the mask
// (B or 1, L) bool or in the dtype (additive) or none, and the output's batch, heads and dims.
qp::DecodeAttentionArgs attention_args(const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                                       int64_t batch, int64_t heads, int64_t head_dim, const at::Tensor& like) {
  check_cuda(k, "k");
  check_cuda(v, "v");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "k and v must be (B, KV, L, D)");
  TORCH_CHECK(k.size(0) == batch && k.size(3) == head_dim, "q, k and v disagree on batch or head dim");
  TORCH_CHECK(k.scalar_type() == like.scalar_type() && v.scalar_type() == like.scalar_type(), "q, k and v: one dtype");
  TORCH_CHECK(k.device() == like.device() && v.device() == like.device() && (!mask.has_value() || mask->device() == like.device()),
              "q, k, v and mask must be on one device");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "k and v must be 16-byte aligned");
  qp::DecodeAttentionArgs a{};
  a.batch = static_cast<int>(batch);
  a.heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(head_dim);
  a.kv_heads = static_cast<int>(k.size(1));
  a.length = static_cast<int>(k.size(2));
  if (mask.has_value()) {
    // a batch stride of its own: transformers' sdpa_mask expands one mask row over the batch
    // (stride 0), which the kernel reads as it is instead of a copy a layer
    TORCH_CHECK(mask->is_cuda(), "mask must be a CUDA tensor");
    TORCH_CHECK(mask->dim() == 2 && (mask->size(0) == 1 || mask->size(0) == batch) && mask->size(1) == k.size(2),
                "mask must be (B or 1, L)");
    TORCH_CHECK(mask->stride(1) == 1 || mask->size(1) == 1, "mask rows must be contiguous");
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == like.scalar_type(),
                "mask must be bool or q's dtype");
    a.mask = mask->data_ptr();
    a.mask_kind = mask->scalar_type() == at::kBool ? qp::MASK_BOOL : qp::MASK_ADDITIVE;
    a.mask_batch_stride = mask->size(0) == 1 ? 0 : mask->stride(0);
  }
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.dtype = dtype_code(like);
  return a;
}

// Runs the kernel(s) of `a` into a new (B, H, D) output (the split partials allocated here).
at::Tensor run_attention(qp::DecodeAttentionArgs& a, const at::Tensor& like, int64_t stream, int64_t num_sms, bool pdl) {
  auto out = at::empty({a.batch, a.heads, a.head_dim}, like.options());
  const int splits = qp::decode_attention_splits(a.batch, a.kv_heads, a.length, static_cast<int>(num_sms));
  at::Tensor partial;
  if (splits > 1 && !qp::decode_attention_clustered(a.batch, a.kv_heads, splits, static_cast<int>(num_sms))) {
    partial = at::empty({static_cast<int64_t>(a.batch) * a.heads * splits * (a.head_dim + 2)}, like.options().dtype(at::kFloat));
    a.partial = partial.data_ptr<float>();
  }
  a.out = out.data_ptr();
  a.num_sms = static_cast<int>(num_sms);
  a.pdl = pdl;
  a.stream = reinterpret_cast<void*>(stream);
  check(qp::decode_attention(a), "qpalette decode attention");
  return out;
}

// Decode attention out (B, H, D) of one query token: q (B, H, D), k and v (B, KV, L, D), mask
// (B or 1, L) bool or in q's dtype (additive), or none (qpalette_kernels.h, decode_attention.cu).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale, int64_t stream, int64_t num_sms, bool pdl) {
  check_cuda(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be (B, H, D)");
  qp::DecodeAttentionArgs a = attention_args(k, v, mask, q.size(0), q.size(1), q.size(2), q);
  a.q = q.data_ptr();
  a.q_stride = q.size(1) * q.size(2);
  a.scale = static_cast<float>(scale);
  return run_attention(a, q, stream, num_sms, pdl);
}

// The new token's attention with rope and the cache update in the kernel (decode_attention.cu):
// q (B, H·D), k_new and v_new (B, KV·D) rows of its projections (last dim contiguous, k_new and v_new
// one row stride), cos and sin (B or 1, D), caches k and v (B, KV, L, D) written at slot (one
// int64), mask as decode_attention's → (B, H, D).
at::Tensor rope_cache_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& slot, const c10::optional<at::Tensor>& mask,
                                double scale, int64_t stream, int64_t num_sms, bool pdl) {
  const int64_t head_dim = k.size(3), batch = q.size(0);
  TORCH_CHECK(q.dim() == 2 && k_new.dim() == 2 && v_new.sizes() == k_new.sizes() && q.size(1) % head_dim == 0 &&
                  k_new.size(1) == k.size(1) * head_dim && k_new.size(0) == batch,
              "q must be (B, H·D), k_new and v_new (B, KV·D)");
  for (const at::Tensor* t : {&q, &k_new, &v_new, &cos, &sin}) {
    TORCH_CHECK(t->is_cuda() && t->device() == k.device() && t->scalar_type() == k.scalar_type() && t->stride(-1) == 1,
                "q, k_new, v_new, cos and sin: CUDA tensors of the caches' device and dtype, last dim contiguous");
  }
  TORCH_CHECK(k_new.stride(0) == v_new.stride(0), "k_new and v_new must share a row stride");
  TORCH_CHECK((v_new.stride(0) * v_new.element_size()) % 16 == 0 && reinterpret_cast<uintptr_t>(v_new.data_ptr()) % 16 == 0,
              "v_new rows must be 16-byte aligned");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == head_dim &&
                  (cos.size(0) == 1 || cos.size(0) == batch) && sin.stride(0) == cos.stride(0),
              "cos and sin must be (B or 1, D) with one row stride");
  TORCH_CHECK(slot.is_cuda() && slot.device() == k.device() && slot.scalar_type() == at::kLong && slot.numel() == 1,
              "slot must be one int64 on the caches' device");
  qp::DecodeAttentionArgs a = attention_args(k, v, mask, batch, q.size(1) / head_dim, head_dim, q);
  a.q = q.data_ptr();
  a.q_stride = q.stride(0);
  a.k_new = k_new.data_ptr();
  a.v_new = v_new.data_ptr();
  a.new_stride = k_new.stride(0);
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.cos_stride = cos.size(0) == 1 ? 0 : cos.stride(0);
  a.slot = reinterpret_cast<const long long*>(slot.data_ptr<int64_t>());
  a.scale = static_cast<float>(scale);
  return run_attention(a, q, stream, num_sms, pdl);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the family codes of qpalette_kernels.h, by the name Python uses: defined once, here
  pybind11::dict families;
  families["pair"] = static_cast<int>(qp::PAIR);
  families["scalar"] = static_cast<int>(qp::SCALAR);
  families["tcq"] = static_cast<int>(qp::TCQ);
  families["half-tcq"] = static_cast<int>(qp::HALF_TCQ);
  m.attr("FAMILY_CODES") = families;
  m.def("gemv", &gemv, "fused dequantize + matmul, batch ≤ 8 (undefined result: shape not supported)");
  m.def("gemv_experts", &gemv_experts, "MoE experts' GEMVs in one launch (undefined result: shape not supported)");
  m.def("dequant", &dequant, "dequantize to a dense matrix");
  m.def("hadamard", &hadamard, "y = H(s ⊙ x) over rows");
  m.def("hadamard_formed", &hadamard_formed, "H(s ⊙ input), the input formed from x (silu(gate)·up or add + RMSNorm)");
  m.def("decode_attention", &decode_attention, "attention of one query token over a grouped-query cache");
  m.def("rope_cache_attention", &rope_cache_attention,
        "decode attention with the new token's rope and cache update in the kernel");
  m.def("viterbi", &viterbi, "tail-biting TCQ Viterbi paths of 16×16 tiles");
}
