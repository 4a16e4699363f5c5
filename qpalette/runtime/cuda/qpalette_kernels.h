// Host interface of the qpalette CUDA kernels: plain C++ (no CUDA or PyTorch types), so that the
// PyTorch binding (bindings.cpp) and the kernel translation units agree without sharing headers.
#pragma once

#include <stdint.h>

namespace qp {

enum Family : int { PAIR = 0, SCALAR = 1, TCQ = 2, HALF_TCQ = 3 };
enum DType : int { F16 = 0, BF16 = 1 };

// y[m, rows] = x[m, cols] · (decode(codes) ⊙ row_scale)ᵀ for 1 ≤ m ≤ 8.
struct QmmArgs {
  const void* codes_a;    // int32 (rows/16, cols/16 or cols/32, W) — the only codes unless half-TCQ
  const void* codes_b;    // half-TCQ: second half of the input columns; else nullptr
  const void* x;          // activations (m, ldx) in dtype
  long long ldx;
  void* y;                // output (m, ldy) in dtype
  long long ldy;
  const void* row_scale;  // fp16 (rows,)
  const void* lut;        // 32-bit table entries: value pairs in dtype (scalar: value in low half)
  float* ws;              // fp32 (rows, 8), zero on entry, left zero
  int* cnt;               // int32 (rows/16,), zero on entry, left zero
  int m, rows, cols;
  int dtype;
  int num_sms;
  void* stream;           // cudaStream_t
};

// W_r = decode(codes) ⊙ row_scale as a dense (rows, cols) matrix in dtype.
struct DequantArgs {
  const void* codes_a;
  const void* codes_b;
  const void* row_scale;
  const void* lut;
  void* w;
  int rows, cols;
  int dtype;
  int num_sms;
  void* stream;
};

// p0, p1: family parameters — PAIR: code bits per pair; SCALAR: bits; TCQ: KV, Q;
// HALF_TCQ: KV of the first half (the second is KV + 1), Q. Return 0 or a cudaError_t value;
// -1 for parameters no kernel is built for.
int qmm_pair(const QmmArgs& a, int cb);
int qmm_scalar(const QmmArgs& a, int b);
int qmm_tcq(const QmmArgs& a, int kv, int q);
int qmm_half_tcq(const QmmArgs& a, int kv_a, int q);
int dequant_pair(const DequantArgs& a, int cb);
int dequant_scalar(const DequantArgs& a, int b);
int dequant_tcq(const DequantArgs& a, int kv, int q);
int dequant_half_tcq(const DequantArgs& a, int kv_a, int q);

// y = H(s ⊙ x) row by row: x, y (rows, n) in dtype; signs bit-packed (n/8); hk the ±1 int8
// factor H_K (K·K, row-major; nullptr when K = 1); n = K·p2, p2 a power of two.
int hadamard(const void* x, void* y, const uint8_t* signs, const int8_t* hk, int rows, int n, int k,
             int p2, int dtype, int num_sms, void* stream);

// cudaGetErrorString of a return code above.
const char* error_string(int rc);

}  // namespace qp
