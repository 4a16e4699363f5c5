// PyTorch binding of the qpalette kernels (built by qpalette/kernels.py through
// torch.utils.cpp_extension). The torch.library custom ops that torch.compile and CUDA graphs see
// are defined in Python (qpalette/ops.py) on top of these functions.
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
  TORCH_CHECK(rc != -1, what, ": no kernel is built for these parameters");
  TORCH_CHECK(rc == 0, what, " failed: ", qp::error_string(rc));
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// y (m, rows) = x (m, cols) · W_rᵀ, m ≤ 8; ws/cnt: zeroed fp32 (≥ rows·8) and int32 (≥ rows/16).
at::Tensor qmm(const at::Tensor& x, const at::Tensor& codes_a, const c10::optional<at::Tensor>& codes_b,
               const at::Tensor& row_scale, const at::Tensor& lut, const at::Tensor& ws,
               const at::Tensor& cnt, int64_t family, int64_t p0, int64_t p1, int64_t rows, int64_t stream,
               int64_t num_sms, const c10::optional<at::Tensor>& out) {
  check_cuda(x, "x");
  check_cuda(codes_a, "codes");
  check_cuda(row_scale, "row_scale");
  check_cuda(lut, "lut");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8, "x must be (m ≤ 8, in)");
  TORCH_CHECK(codes_a.scalar_type() == at::kInt && row_scale.scalar_type() == at::kHalf, "codes int32, row_scale fp16");
  TORCH_CHECK(row_scale.numel() == rows && rows % 16 == 0, "row_scale must have out features (multiple of 16)");
  TORCH_CHECK(ws.numel() >= rows * 8 && cnt.numel() >= rows / 16, "workspace too small");
  const int cols = static_cast<int>(x.size(1));
  const bool half = family == qp::HALF_TCQ;
  TORCH_CHECK(codes_a.size(0) == rows / 16 && codes_a.size(1) == (half ? cols / 32 : cols / 16),
              "codes shape does not match the matrix");
  if (half) {
    TORCH_CHECK(codes_b.has_value(), "half-TCQ needs codes_b");
    check_cuda(*codes_b, "codes_b");
  }
  auto y = out.has_value() ? *out : at::empty({x.size(0), rows}, x.options());
  TORCH_CHECK(y.is_contiguous() && y.numel() == x.size(0) * rows && y.scalar_type() == x.scalar_type(),
              "out must be a contiguous (m, out) tensor of x's dtype");
  qp::QmmArgs a{};
  a.codes_a = codes_a.data_ptr();
  a.codes_b = half ? codes_b->data_ptr() : nullptr;
  a.x = x.data_ptr();
  a.ldx = cols;
  a.y = y.data_ptr();
  a.ldy = rows;
  a.row_scale = row_scale.data_ptr();
  a.lut = lut.data_ptr();
  a.ws = ws.data_ptr<float>();
  a.cnt = cnt.data_ptr<int>();
  a.m = static_cast<int>(x.size(0));
  a.rows = static_cast<int>(rows);
  a.cols = cols;
  a.dtype = dtype_code(x);
  a.num_sms = static_cast<int>(num_sms);
  a.stream = reinterpret_cast<void*>(stream);
  int rc = -1;
  switch (family) {
    case qp::PAIR: rc = qp::qmm_pair(a, p0); break;
    case qp::SCALAR: rc = qp::qmm_scalar(a, p0); break;
    case qp::TCQ: rc = qp::qmm_tcq(a, p0, p1); break;
    case qp::HALF_TCQ: rc = qp::qmm_half_tcq(a, p0, p1); break;
  }
  check(rc, "qpalette quantized matmul");
  return y;
}

at::Tensor dequant(const at::Tensor& codes_a, const c10::optional<at::Tensor>& codes_b,
                   const at::Tensor& row_scale, const at::Tensor& lut, int64_t family, int64_t p0,
                   int64_t p1, int64_t rows, int64_t cols, at::ScalarType dtype, int64_t stream,
                   int64_t num_sms, const c10::optional<at::Tensor>& out) {
  check_cuda(codes_a, "codes");
  check_cuda(row_scale, "row_scale");
  check_cuda(lut, "lut");
  const bool half = family == qp::HALF_TCQ;
  if (half) {
    TORCH_CHECK(codes_b.has_value(), "half-TCQ needs codes_b");
    check_cuda(*codes_b, "codes_b");
  }
  auto w = out.has_value() ? *out : at::empty({rows, cols}, codes_a.options().dtype(dtype));
  TORCH_CHECK(w.is_contiguous() && w.numel() == rows * cols && w.scalar_type() == dtype,
              "out must be a contiguous (rows, cols) tensor of the given dtype");
  qp::DequantArgs a{};
  a.codes_a = codes_a.data_ptr();
  a.codes_b = half ? codes_b->data_ptr() : nullptr;
  a.row_scale = row_scale.data_ptr();
  a.lut = lut.data_ptr();
  a.w = w.data_ptr();
  a.rows = static_cast<int>(rows);
  a.cols = static_cast<int>(cols);
  a.dtype = dtype_code(w);
  a.num_sms = static_cast<int>(num_sms);
  a.stream = reinterpret_cast<void*>(stream);
  int rc = -1;
  switch (family) {
    case qp::PAIR: rc = qp::dequant_pair(a, p0); break;
    case qp::SCALAR: rc = qp::dequant_scalar(a, p0); break;
    case qp::TCQ: rc = qp::dequant_tcq(a, p0, p1); break;
    case qp::HALF_TCQ: rc = qp::dequant_half_tcq(a, p0, p1); break;
  }
  check(rc, "qpalette dequantize");
  return w;
}

at::Tensor hadamard(const at::Tensor& x, const at::Tensor& signs, const c10::optional<at::Tensor>& hk,
                    int64_t k, int64_t p2, int64_t stream, int64_t num_sms,
                    const c10::optional<at::Tensor>& out) {
  check_cuda(x, "x");
  check_cuda(signs, "signs");
  TORCH_CHECK(x.dim() == 2, "x must be (rows, n)");
  const int n = static_cast<int>(x.size(1));
  TORCH_CHECK(signs.scalar_type() == at::kByte && signs.numel() * 8 == n, "signs must be uint8 (n/8,)");
  TORCH_CHECK(k == 1 || (hk.has_value() && hk->numel() == k * k), "H_K missing");
  auto y = out.has_value() ? *out : at::empty_like(x);
  TORCH_CHECK(y.is_contiguous() && y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(),
              "out must be a contiguous tensor like x");
  const int rc = qp::hadamard(x.data_ptr(), y.data_ptr(), signs.data_ptr<uint8_t>(),
                              k > 1 ? hk->data_ptr<int8_t>() : nullptr, static_cast<int>(x.size(0)), n,
                              static_cast<int>(k), static_cast<int>(p2), dtype_code(x),
                              static_cast<int>(num_sms),
                              reinterpret_cast<void*>(stream));
  check(rc, "qpalette Hadamard transform");
  return y;
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
  m.def("qmm", &qmm, "fused dequantize + matmul, batch ≤ 8");
  m.def("dequant", &dequant, "dequantize to a dense matrix");
  m.def("hadamard", &hadamard, "y = H(s ⊙ x) over rows");
}
