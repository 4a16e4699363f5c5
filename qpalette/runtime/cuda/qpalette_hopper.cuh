// Hopper features the kernels use where the GPU has them: programmatic dependent launch (PDL) and
// thread-block clusters. On older GPUs the PDL calls are no-ops and the launchers use neither.
#pragma once

#include <cooperative_groups.h>

namespace qp {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// let the next kernel in the stream start its prologue now
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// wait until the previous kernel has finished and its writes are visible
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ int cluster_rank() { return static_cast<int>(cooperative_groups::this_cluster().block_rank()); }
__device__ __forceinline__ void cluster_sync() { cooperative_groups::this_cluster().sync(); }
// cluster_sync in two halves, so that work between them hides the barrier's latency; the arrive is
// relaxed (no memory fence: it orders no writes, it only says that this CTA has started)
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, int rank) { return cooperative_groups::this_cluster().map_shared_rank(p, rank); }
// 16 bytes to the shared memory of CTA `rank` of the cluster at the offset of `local` in this CTA's
// (32-bit shared::cluster addresses: fewer registers than cluster_peer's generic pointers)
__device__ __forceinline__ void store_to_peer(const void* local, int rank, const uint4& v) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(r), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
#else
__device__ __forceinline__ void pdl_launch_dependents() {}
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ int cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_sync() { __trap(); }
__device__ __forceinline__ void cluster_arrive() { __trap(); }
__device__ __forceinline__ void cluster_wait() { __trap(); }
template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, int) { __trap(); return p; }
__device__ __forceinline__ void store_to_peer(const void*, int, const uint4&) { __trap(); }
#endif

}  // namespace qp
