// Device side of the CUDA-graph switch (graph_switch.cpp): one single-thread kernel that picks a
// SWITCH node's body from a count the GPU wrote earlier in the same graph. Like tree_build.cu,
// no torch headers and nothing that throws: the raw launcher returns a cudaError_t.
#include <cuda_runtime.h>

#include "graph_switch.h"

namespace {

// Body i for the first limit the count does not exceed; lim.n (the last body) past them all.
__global__ void switch_select_kernel(cudaGraphConditionalHandle handle, const int* count,
                                     ddtree::SwitchLimits lim) {
  const int c = *count;
  unsigned int body = static_cast<unsigned int>(lim.n);
  for (int i = lim.n - 1; i >= 0; --i) {
    if (c <= lim.v[i]) body = static_cast<unsigned int>(i);
  }
  cudaGraphSetConditional(handle, body);
}

}  // namespace

namespace ddtree {

cudaError_t switch_select_launch_raw(cudaGraphConditionalHandle handle, const int* count,
                                     const SwitchLimits& limits, cudaStream_t stream) noexcept {
  switch_select_kernel<<<1, 1, 0, stream>>>(handle, count, limits);
  return cudaGetLastError();
}

}  // namespace ddtree
