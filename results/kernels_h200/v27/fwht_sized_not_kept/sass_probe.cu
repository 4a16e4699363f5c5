#include "qpalette_fwht.cuh"
using namespace qp;
template <int L>
__global__ void k(const float* x, __half* out, int log2n) {
  __shared__ float z[4096];
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = x[threadIdx.x * 8 + i];
  fwht_row_sized<__half, L>(v, log2n, 0.5f, z, out, threadIdx.x, threadIdx.x < 512);
}
template __global__ void k<0>(const float*, __half*, int);
template __global__ void k<12>(const float*, __half*, int);
