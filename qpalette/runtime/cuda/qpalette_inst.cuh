// Instantiates every palette kernel of one family for one activation dtype. Include after
// defining QP_T (__half or __nv_bfloat16), QP_SFX (f16 or bf16) and one of QP_FAMILY_PAIR,
// QP_FAMILY_SCALAR, QP_FAMILY_TCQ, QP_FAMILY_HALF_TCQ; each .cu of this folder is one such unit,
// so that the build compiles them in parallel. Every case is a palette entry (registry.py).
#pragma once

#include "qpalette_qmm.cuh"

#define QP_CAT2(a, b) a##_##b
#define QP_CAT(a, b) QP_CAT2(a, b)

namespace qp {

#if defined(QP_FAMILY_PAIR)
// VQ-1.5..6.0: 3..12 code bits a pair; NUQ-2..5 as 4..10-bit pair codes.
#define QP_CASES(X) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#define QP_ONE(CB) \
  case CB:         \
    return launch_qmm<PairDec<CB>, PairDec<CB>, QP_T>(a, 1);
#define QP_ONE_DQ(CB) \
  case CB:            \
    return launch_dequant<PairDec<CB>, PairDec<CB>, QP_T>(a, 1);
int QP_CAT(qmm_pair, QP_SFX)(const QmmArgs& a, int cb) {
  switch (cb) { QP_CASES(QP_ONE) default: return -1; }
}
int QP_CAT(dequant_pair, QP_SFX)(const DequantArgs& a, int cb) {
  switch (cb) { QP_CASES(QP_ONE_DQ) default: return -1; }
}
#elif defined(QP_FAMILY_SCALAR)
// NUQ-6..8: two scalar lookups a pair
#define QP_CASES(X) X(6) X(7) X(8)
#define QP_ONE(B) \
  case B:         \
    return launch_qmm<ScalarDec<B>, ScalarDec<B>, QP_T>(a, 1);
#define QP_ONE_DQ(B) \
  case B:            \
    return launch_dequant<ScalarDec<B>, ScalarDec<B>, QP_T>(a, 1);
int QP_CAT(qmm_scalar, QP_SFX)(const QmmArgs& a, int b) {
  switch (b) { QP_CASES(QP_ONE) default: return -1; }
}
int QP_CAT(dequant_scalar, QP_SFX)(const DequantArgs& a, int b) {
  switch (b) { QP_CASES(QP_ONE_DQ) default: return -1; }
}
#elif defined(QP_FAMILY_TCQ)
// TCQ-1.0..5.0: KV = 2..10 bits a step; Q = 9 up to KV 8, then KV + 1
#define QP_CASES(X) X(2, 9) X(3, 9) X(4, 9) X(5, 9) X(6, 9) X(7, 9) X(8, 9) X(9, 10) X(10, 11)
#define QP_ONE(KV, Q) \
  case KV:            \
    return q == Q ? launch_qmm<TcqDec<KV, Q>, TcqDec<KV, Q>, QP_T>(a, 1) : -1;
#define QP_ONE_DQ(KV, Q) \
  case KV:               \
    return q == Q ? launch_dequant<TcqDec<KV, Q>, TcqDec<KV, Q>, QP_T>(a, 1) : -1;
int QP_CAT(qmm_tcq, QP_SFX)(const QmmArgs& a, int kv, int q) {
  switch (kv) { QP_CASES(QP_ONE) default: return -1; }
}
int QP_CAT(dequant_tcq, QP_SFX)(const DequantArgs& a, int kv, int q) {
  switch (kv) { QP_CASES(QP_ONE_DQ) default: return -1; }
}
#elif defined(QP_FAMILY_HALF_TCQ)
// half-TCQ-1.25..4.75: KV and KV + 1 on the two halves, the larger half's table
#define QP_CASES(X) X(2, 9) X(3, 9) X(4, 9) X(5, 9) X(6, 9) X(7, 9) X(8, 10) X(9, 11)
#define QP_ONE(KV, Q) \
  case KV:            \
    return q == Q ? launch_qmm<TcqDec<KV, Q>, TcqDec<KV + 1, Q>, QP_T>(a, 2) : -1;
#define QP_ONE_DQ(KV, Q) \
  case KV:               \
    return q == Q ? launch_dequant<TcqDec<KV, Q>, TcqDec<KV + 1, Q>, QP_T>(a, 2) : -1;
int QP_CAT(qmm_half_tcq, QP_SFX)(const QmmArgs& a, int kv, int q) {
  switch (kv) { QP_CASES(QP_ONE) default: return -1; }
}
int QP_CAT(dequant_half_tcq, QP_SFX)(const DequantArgs& a, int kv, int q) {
  switch (kv) { QP_CASES(QP_ONE_DQ) default: return -1; }
}
#else
#error "define one QP_FAMILY_* before including qpalette_inst.cuh"
#endif

}  // namespace qp
