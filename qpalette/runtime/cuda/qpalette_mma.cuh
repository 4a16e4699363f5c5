// Tensor-core fragments shared by the GEMV and the decode attention (sm_80 or newer):
// mma.m16n8k16 with fp32 accumulators, and ldmatrix. Lane ℓ = 4·g + t holds, of A (16×16, row
// major) a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];
// of B (16×8) b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; of the accumulator d0, d1 = D[g][2t, 2t+1],
// d2, d3 = D[g+8][2t, 2t+1]. The lower half of a register is the element of lower index.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace qp {

template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8×8 matrices of 16-bit elements from shared memory, transposed: lane 8i + r gives the address
// of row r of matrix i (16 bytes); register i of lane 4·g + t gets column g, rows 2t and 2t + 1, of
// matrix i: a B fragment (b0, b1 = registers 0, 1 or 2, 3) of a row-major 16×8 tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}

// Index of 16-byte piece `piece` of row `row` in a buffer of `pieces` pieces a row (≥ 8) stored with
// each row's pieces XOR-swizzled by the row (piece c of row r at c ^ (r mod 8)): the 8 rows of an
// ldmatrix 8×8 matrix then fall in different banks. The decode attention's staged values and the
// H_K mix's staged row use it.
__device__ __forceinline__ int swizzled_piece(int row, int piece, int pieces) { return row * pieces + (piece ^ (row & 7)); }

// Two floats as one register of 16-bit elements (lo in the lower half)
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace qp
