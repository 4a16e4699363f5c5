// Instantiates the GEMV and dequantize kernels of one family for one activation dtype. Include
// after defining QP_T (__half or __nv_bfloat16), QP_SFX (f16 or bf16) and one of QP_FAMILY_PAIR,
// QP_FAMILY_SCALAR, QP_FAMILY_TCQ, QP_FAMILY_HALF_TCQ; each gemv_*.cu of this folder is one such
// unit, so that the build compiles them in parallel. Every case is a palette entry (registry.py).
#pragma once

#include "qpalette_gemv.cuh"

#define QP_CAT2(a, b) a##_##b
#define QP_CAT(a, b) QP_CAT2(a, b)

namespace qp {

#if defined(QP_FAMILY_PAIR)
// VQ-1.5..6.0: 3..12 code bits a pair; NUQ-2..5 as 4..10-bit pair codes.
#define QP_CASES(X) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#define QP_ONE(CB) \
  case CB:         \
    return LAUNCH<PairLanes<CB>, PairLanes<CB>, QP_T>(a);
#define QP_SWITCH(a, p0, p1) switch (p0) { QP_CASES(QP_ONE) default: return NOT_BUILT; }
#define QP_NAME pair
#elif defined(QP_FAMILY_SCALAR)
// NUQ-6..8: two scalar lookups a pair
#define QP_CASES(X) X(6) X(7) X(8)
#define QP_ONE(B) \
  case B:         \
    return LAUNCH<ScalarLanes<B>, ScalarLanes<B>, QP_T>(a);
#define QP_SWITCH(a, p0, p1) switch (p0) { QP_CASES(QP_ONE) default: return NOT_BUILT; }
#define QP_NAME scalar
#elif defined(QP_FAMILY_TCQ)
// TCQ-1.0..5.0: KV = 2..10 bits a step; Q = 9 up to KV 8, then KV + 1
#define QP_CASES(X) X(2, 9) X(3, 9) X(4, 9) X(5, 9) X(6, 9) X(7, 9) X(8, 9) X(9, 10) X(10, 11)
#define QP_ONE(KV, Q) \
  case KV:            \
    return p1 == Q ? LAUNCH<TcqLanes<KV, Q>, TcqLanes<KV, Q>, QP_T>(a) : NOT_BUILT;
#define QP_SWITCH(a, p0, p1) switch (p0) { QP_CASES(QP_ONE) default: return NOT_BUILT; }
#define QP_NAME tcq
#elif defined(QP_FAMILY_HALF_TCQ)
// half-TCQ-1.25..4.75: KV and KV + 1 on the two halves, the larger half's table
#define QP_CASES(X) X(2, 9) X(3, 9) X(4, 9) X(5, 9) X(6, 9) X(7, 9) X(8, 10) X(9, 11)
#define QP_ONE(KV, Q) \
  case KV:            \
    return p1 == Q ? LAUNCH<TcqLanes<KV, Q>, TcqLanes<KV + 1, Q>, QP_T>(a) : NOT_BUILT;
#define QP_SWITCH(a, p0, p1) switch (p0) { QP_CASES(QP_ONE) default: return NOT_BUILT; }
#define QP_NAME half_tcq
#else
#error "define one QP_FAMILY_* before including qpalette_inst.cuh"
#endif

int QP_CAT(QP_CAT(gemv, QP_NAME), QP_SFX)(const GemvArgs& a, int p0, int p1) {
#define LAUNCH launch_gemv
  QP_SWITCH(a, p0, p1)
#undef LAUNCH
}
int QP_CAT(QP_CAT(dequant, QP_NAME), QP_SFX)(const DequantArgs& a, int p0, int p1) {
#define LAUNCH launch_dequant
  QP_SWITCH(a, p0, p1)
#undef LAUNCH
}

}  // namespace qp
