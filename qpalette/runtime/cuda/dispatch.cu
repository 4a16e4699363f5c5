// Host-side dispatch on family and activation dtype to the per-family translation units.
#include <cuda_runtime.h>

#include "qpalette_kernels.h"

namespace qp {

#define QP_DECL(FAM)                                              \
  int gemv_##FAM##_f16(const GemvArgs& a, int p0, int p1);        \
  int gemv_##FAM##_bf16(const GemvArgs& a, int p0, int p1);       \
  int dequant_##FAM##_f16(const DequantArgs& a, int p0, int p1);  \
  int dequant_##FAM##_bf16(const DequantArgs& a, int p0, int p1);
QP_DECL(pair)
QP_DECL(scalar)
QP_DECL(tcq)
QP_DECL(half_tcq)

#define QP_DISPATCH(OP, a, family, p0, p1)                                                     \
  switch (family) {                                                                            \
    case PAIR: return a.dtype == BF16 ? OP##_pair_bf16(a, p0, p1) : OP##_pair_f16(a, p0, p1);  \
    case SCALAR: return a.dtype == BF16 ? OP##_scalar_bf16(a, p0, p1) : OP##_scalar_f16(a, p0, p1); \
    case TCQ: return a.dtype == BF16 ? OP##_tcq_bf16(a, p0, p1) : OP##_tcq_f16(a, p0, p1);     \
    case HALF_TCQ:                                                                             \
      return a.dtype == BF16 ? OP##_half_tcq_bf16(a, p0, p1) : OP##_half_tcq_f16(a, p0, p1);   \
    default: return NOT_BUILT;                                                                 \
  }

int gemv(const GemvArgs& a, int family, int p0, int p1) { QP_DISPATCH(gemv, a, family, p0, p1) }
int dequant(const DequantArgs& a, int family, int p0, int p1) { QP_DISPATCH(dequant, a, family, p0, p1) }

const char* error_string(int rc) { return cudaGetErrorString(static_cast<cudaError_t>(rc)); }

}  // namespace qp
