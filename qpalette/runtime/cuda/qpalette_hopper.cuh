// Hopper features the kernels use where the GPU has them: programmatic dependent launch (PDL) and
// thread-block clusters. On older GPUs the PDL calls are no-ops and the launchers use neither.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "qpalette_kernels.h"  // OK, UNSUPPORTED

namespace qp {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// let the next kernel in the stream start its prologue now
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// wait until the previous kernel has finished and its writes are visible
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ int cluster_rank() { return static_cast<int>(cooperative_groups::this_cluster().block_rank()); }
__device__ __forceinline__ void cluster_sync() { cooperative_groups::this_cluster().sync(); }
template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, int rank) { return cooperative_groups::this_cluster().map_shared_rank(p, rank); }
// cluster_sync in two halves, the arrive without ordering memory: no GPU-wide fence, for a barrier
// that only has to say "every CTA of the cluster has started" (before distributed shared memory use)
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
#else
__device__ __forceinline__ void pdl_launch_dependents() {}
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ int cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_sync() { __trap(); }
template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, int) { __trap(); return p; }
__device__ __forceinline__ void cluster_arrive_relaxed() { __trap(); }
__device__ __forceinline__ void cluster_wait() { __trap(); }
#endif

// Host side: the launchers ask `major >= 9` before using clusters or PDL.

// cudaLaunchKernelEx attributes: thread-block clusters of `ctas` CTAs along x, and programmatic
// stream serialization (the launch may start while the previous kernel runs: PDL)
inline cudaLaunchAttribute cluster_attribute(int ctas) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = ctas;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

struct DeviceInfo {
  int index = 0;
  int smem_optin = 0;  // bytes of shared memory a block may opt in to (0: not read yet)
  int smem_per_sm = 0;  // bytes of shared memory a SM holds
  int major = 0;
};

// The current device and its properties, read once per device: launches are on the decode
// path, where host time counts.
inline int current_device(DeviceInfo& d) {
  static DeviceInfo known[64];
  int index = 0;
  if (cudaError_t e = cudaGetDevice(&index)) return e;
  if (index < 0 || index >= 64) return UNSUPPORTED;
  DeviceInfo& k = known[index];
  if (k.smem_optin == 0) {
    DeviceInfo r;
    r.index = index;
    if (cudaError_t e = cudaDeviceGetAttribute(&r.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, index)) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&r.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, index))
      return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&r.major, cudaDevAttrComputeCapabilityMajor, index)) return e;
    k = r;
  }
  d = k;
  return OK;
}

}  // namespace qp
