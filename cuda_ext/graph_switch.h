// Shared by graph_switch.cpp (host C++) and graph_switch.cu (nvcc).
#pragma once

#include <cuda_runtime_api.h>

namespace ddtree {

constexpr int kSwitchMaxLimits = 7;  // bodies: one per limit, then the last (no limit)

struct SwitchLimits {
  int n;  // limits in use
  int v[kSwitchMaxLimits];  // ascending
};

// Launches the one-thread kernel that sets `handle` to the first i with *count <= v[i] (n if
// none) on `stream`; returns cudaGetLastError().
cudaError_t switch_select_launch_raw(cudaGraphConditionalHandle handle, const int* count,
                                     const SwitchLimits& limits, cudaStream_t stream) noexcept;

}  // namespace ddtree
