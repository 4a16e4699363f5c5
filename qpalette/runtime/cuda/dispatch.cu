// Host-side dispatch on the activation dtype to the per-dtype translation units.
#include <cuda_runtime.h>

#include "qpalette_kernels.h"

namespace qp {

#define QP_DECL(NAME, ARGS, ...)  \
  int NAME##_f16(const ARGS& a, __VA_ARGS__); \
  int NAME##_bf16(const ARGS& a, __VA_ARGS__);
QP_DECL(qmm_pair, QmmArgs, int)
QP_DECL(qmm_scalar, QmmArgs, int)
QP_DECL(qmm_tcq, QmmArgs, int, int)
QP_DECL(qmm_half_tcq, QmmArgs, int, int)
QP_DECL(dequant_pair, DequantArgs, int)
QP_DECL(dequant_scalar, DequantArgs, int)
QP_DECL(dequant_tcq, DequantArgs, int, int)
QP_DECL(dequant_half_tcq, DequantArgs, int, int)

int qmm_pair(const QmmArgs& a, int cb) { return a.dtype == BF16 ? qmm_pair_bf16(a, cb) : qmm_pair_f16(a, cb); }
int qmm_scalar(const QmmArgs& a, int b) { return a.dtype == BF16 ? qmm_scalar_bf16(a, b) : qmm_scalar_f16(a, b); }
int qmm_tcq(const QmmArgs& a, int kv, int q) {
  return a.dtype == BF16 ? qmm_tcq_bf16(a, kv, q) : qmm_tcq_f16(a, kv, q);
}
int qmm_half_tcq(const QmmArgs& a, int kv, int q) {
  return a.dtype == BF16 ? qmm_half_tcq_bf16(a, kv, q) : qmm_half_tcq_f16(a, kv, q);
}
int dequant_pair(const DequantArgs& a, int cb) {
  return a.dtype == BF16 ? dequant_pair_bf16(a, cb) : dequant_pair_f16(a, cb);
}
int dequant_scalar(const DequantArgs& a, int b) {
  return a.dtype == BF16 ? dequant_scalar_bf16(a, b) : dequant_scalar_f16(a, b);
}
int dequant_tcq(const DequantArgs& a, int kv, int q) {
  return a.dtype == BF16 ? dequant_tcq_bf16(a, kv, q) : dequant_tcq_f16(a, kv, q);
}
int dequant_half_tcq(const DequantArgs& a, int kv, int q) {
  return a.dtype == BF16 ? dequant_half_tcq_bf16(a, kv, q) : dequant_half_tcq_f16(a, kv, q);
}

const char* error_string(int rc) { return cudaGetErrorString(static_cast<cudaError_t>(rc)); }

}  // namespace qp
