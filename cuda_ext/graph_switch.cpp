// A SWITCH node in the CUDA graph being captured on the current stream, whose body the GPU picks
// at replay from a count an earlier kernel of the same graph wrote (CUDA >= 12.8). The fused MoE
// uses it to launch grids sized for the row blocks a call really uses instead of the most it
// could use (triton_kernels/moe_w4a16.py, "switch").
//
// Protocol (one switch open at a time per thread; bodies are captured in order):
//   graph_switch_begin(counts, index, limits)   set kernel + SWITCH node with len(limits) + 1 bodies
//   graph_switch_body_begin(i) -> stream        capture body i on that stream (relaxed mode)
//   ... launches on that stream ...
//   graph_switch_body_end()
//   graph_switch_end()
// Body i runs when counts[index] <= limits[i] and above limits[i - 1]; the last body otherwise.
// Every function returns an error message ("" = success) and never throws: see tree_build.cpp
// for why nothing here raises through pybind11. On failure the open switch is abandoned (the
// capture itself then fails or must be discarded by the caller).
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <string>
#include <tuple>
#include <vector>

#include "graph_switch.h"

namespace {

constexpr int kMaxDevices = 64;

struct SwitchState {
  bool open = false;
  int device = -1;
  int n_bodies = 0;
  int next_body = 0;    // bodies are captured in order
  bool in_body = false;
  cudaGraph_t bodies[ddtree::kSwitchMaxLimits + 1] = {};
};

thread_local SwitchState g_state;
// One stream per device for capturing bodies: created on first use, kept for the process.
cudaStream_t g_body_stream[kMaxDevices] = {};

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string("graph_switch: ") + what + " failed: " + cudaGetErrorString(e);
}

std::string abandon(std::string message) {
  g_state = SwitchState{};
  return message;
}

}  // namespace

std::string graph_switch_begin(const at::Tensor& counts, int64_t index,
                               const std::vector<int64_t>& limits) {
#if CUDART_VERSION < 12080
  (void)counts;
  (void)index;
  (void)limits;
  return "graph_switch: needs CUDA 12.8 or newer (SWITCH conditional nodes)";
#else
  if (g_state.open) return abandon("graph_switch: a switch is already open (they do not nest)");
  if (!counts.is_cuda() || counts.scalar_type() != at::kInt || !counts.is_contiguous()) {
    return "graph_switch: counts must be a contiguous int32 CUDA tensor";
  }
  if (index < 0 || index >= counts.numel()) {
    return "graph_switch: index " + std::to_string(index) + " outside counts of " +
           std::to_string(counts.numel()) + " entries";
  }
  const int n = static_cast<int>(limits.size());
  if (n < 1 || n > ddtree::kSwitchMaxLimits) {
    return "graph_switch: 1 to " + std::to_string(ddtree::kSwitchMaxLimits) + " limits, got " +
           std::to_string(n);
  }
  ddtree::SwitchLimits lim{};
  lim.n = n;
  for (int i = 0; i < n; ++i) {
    if (limits[i] < 0 || limits[i] > INT32_MAX || (i > 0 && limits[i] <= limits[i - 1])) {
      return "graph_switch: limits must be ascending non-negative int32 values";
    }
    lim.v[i] = static_cast<int>(limits[i]);
  }
  const int dev = counts.device().index();
  if (dev < 0 || dev >= kMaxDevices) return "graph_switch: device index out of range";
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();

  cudaStreamCaptureStatus status;
  unsigned long long capture_id = 0;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n_deps = 0;
  cudaError_t e = cudaStreamGetCaptureInfo(stream, &status, &capture_id, &graph, &deps, &edges,
                                           &n_deps);
  if (e != cudaSuccess) return cuda_error("cudaStreamGetCaptureInfo", e);
  if (status != cudaStreamCaptureStatusActive) {
    return "graph_switch: the current stream is not capturing a CUDA graph";
  }
  cudaGraphConditionalHandle handle;
  e = cudaGraphConditionalHandleCreate(&handle, graph, 0, 0);
  if (e != cudaSuccess) return cuda_error("cudaGraphConditionalHandleCreate", e);
  // The kernel that picks the body joins the capture like any launch on this stream; the
  // SWITCH node then depends on it (the stream's dependencies, read again below).
  e = ddtree::switch_select_launch_raw(handle, counts.data_ptr<int>() + index, lim, stream);
  if (e != cudaSuccess) return cuda_error("switch kernel launch", e);
  e = cudaStreamGetCaptureInfo(stream, &status, &capture_id, &graph, &deps, &edges, &n_deps);
  if (e != cudaSuccess) return cuda_error("cudaStreamGetCaptureInfo", e);

  // Aggregate init zeroes the reserved fields (the struct has no default constructor in C++).
  cudaGraphNodeParams params = {cudaGraphNodeTypeConditional};
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeSwitch;
  params.conditional.size = static_cast<unsigned int>(n + 1);
  cudaGraphNode_t node;
  e = cudaGraphAddNode(&node, graph, deps, edges, n_deps, &params);
  if (e != cudaSuccess) return cuda_error("cudaGraphAddNode (SWITCH)", e);
  e = cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                          cudaStreamSetCaptureDependencies);
  if (e != cudaSuccess) return cuda_error("cudaStreamUpdateCaptureDependencies", e);

  g_state = SwitchState{};
  g_state.open = true;
  g_state.device = dev;
  g_state.n_bodies = n + 1;
  for (int i = 0; i <= n; ++i) g_state.bodies[i] = params.conditional.phGraph_out[i];
  return "";
#endif
}

// Returns (message, stream): the raw cudaStream_t capturing body i, for torch.cuda.ExternalStream.
std::tuple<std::string, int64_t> graph_switch_body_begin(int64_t i) {
#if CUDART_VERSION < 12080
  (void)i;
  return {"graph_switch: needs CUDA 12.8 or newer", 0};
#else
  if (!g_state.open || g_state.in_body) {
    return {abandon("graph_switch: body_begin without an open switch, or inside a body"), 0};
  }
  if (i != g_state.next_body || i >= g_state.n_bodies) {
    return {abandon("graph_switch: body " + std::to_string(i) + " out of order (expected " +
                    std::to_string(g_state.next_body) + " of " +
                    std::to_string(g_state.n_bodies) + ")"), 0};
  }
  const int dev = g_state.device;
  cudaStream_t& body_stream = g_body_stream[dev];
  if (body_stream == nullptr) {
    cudaStream_t s = nullptr;
    const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return {abandon(cuda_error("cudaStreamCreateWithFlags", e)), 0};
    body_stream = s;
  }
  const cudaError_t e = cudaStreamBeginCaptureToGraph(body_stream, g_state.bodies[i], nullptr,
                                                      nullptr, 0,
                                                      cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) return {abandon(cuda_error("cudaStreamBeginCaptureToGraph", e)), 0};
  g_state.in_body = true;
  return {"", reinterpret_cast<int64_t>(body_stream)};
#endif
}

std::string graph_switch_body_end() {
#if CUDART_VERSION < 12080
  return "graph_switch: needs CUDA 12.8 or newer";
#else
  if (!g_state.open || !g_state.in_body) {
    return abandon("graph_switch: body_end without a body being captured");
  }
  cudaGraph_t captured = nullptr;
  const cudaError_t e = cudaStreamEndCapture(g_body_stream[g_state.device], &captured);
  if (e != cudaSuccess) return abandon(cuda_error("cudaStreamEndCapture (body)", e));
  g_state.in_body = false;
  g_state.next_body += 1;
  return "";
#endif
}

std::string graph_switch_end() {
  if (!g_state.open || g_state.in_body || g_state.next_body != g_state.n_bodies) {
    return abandon("graph_switch: end before every body was captured");
  }
  g_state = SwitchState{};
  return "";
}

// Whether this build has SWITCH nodes (the CUDA runtime it was compiled against is >= 12.8).
bool graph_switch_supported() { return CUDART_VERSION >= 12080; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("graph_switch_begin", &graph_switch_begin,
        "Open a SWITCH node in the graph the current stream captures: a one-thread kernel picks "
        "body i for the first limits[i] >= counts[index] (the last body past them all). Returns "
        "an error message, or an empty string.",
        py::arg("counts"), py::arg("index"), py::arg("limits"));
  m.def("graph_switch_body_begin", &graph_switch_body_begin,
        "Start capturing body i; returns (error message, raw stream to launch on).",
        py::arg("i"));
  m.def("graph_switch_body_end", &graph_switch_body_end, "End the body being captured.");
  m.def("graph_switch_end", &graph_switch_end, "Close the switch (every body captured).");
  m.def("graph_switch_supported", &graph_switch_supported,
        "Whether this build has SWITCH nodes (CUDA >= 12.8).");
}
