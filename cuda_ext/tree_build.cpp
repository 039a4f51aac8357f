// Host side of the fused DDTree tree builder, compiled by the host C++ compiler: argument checks,
// shared-memory sizing, parameter packing and the Python bindings. The kernel launch itself is
// ddtree::tree_build_launch_raw in tree_build.cu, which returns a cudaError_t instead of
// throwing. No C++ exception crosses into Python either: on the H200 image (torch 2.11+cu130) a
// c10::Error thrown through this module's pybind11 binding crashed the process (SIGSEGV), so
// `tree_build` returns an error message ("" = success) and the Python wrapper
// (sglang_ddtree.tree_backend.build_tree_cuda) raises RuntimeError with it.
// No allocation and no host sync per call: CUDA-graph capturable.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <optional>
#include <string>
#include <type_traits>

#include "tree_build_params.h"

namespace ddtree {
// Defined in tree_build.cu (C++ linkage, so a signature mismatch fails at link time).
cudaError_t tree_build_launch_raw(const TreeBuildParams& p, int bs, int threads,
                                  int64_t smem_bytes, int device, cudaStream_t stream,
                                  int algo) noexcept;
}  // namespace ddtree

// Messages are built by plain string appends, not c10::str: the crash on the H200 image
// persisted after the exception was removed, in the first call that formatted a message, which
// points at the ostream path c10::str takes (no stream is used anywhere else in this module).
namespace {
void ddt_append(std::string& s, const char* v) { s += v; }
void ddt_append(std::string& s, const std::string& v) { s += v; }
void ddt_append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
void ddt_append(std::string& s, const at::Device& v) { s += v.str(); }
void ddt_append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void ddt_append(std::string& s, T v) { s += std::to_string(v); }
inline void ddt_cat_into(std::string&) {}
template <typename T, typename... Rest>
void ddt_cat_into(std::string& s, const T& v, const Rest&... rest) {
  ddt_append(s, v);
  ddt_cat_into(s, rest...);
}
template <typename... Args>
std::string ddt_cat(const Args&... args) {
  std::string s;
  ddt_cat_into(s, args...);
  return s;
}
}  // namespace

// Like TORCH_CHECK, but returns the message from the enclosing std::string function.
#define DDT_CHECK(cond, ...)                                         \
  do {                                                               \
    if (!(cond)) return ddt_cat("tree_build: ", __VA_ARGS__);         \
  } while (0)
// Propagates a non-empty message from a helper.
#define DDT_TRY(expr)               \
  do {                              \
    std::string ddt_err_ = (expr);  \
    if (!ddt_err_.empty()) return ddt_err_; \
  } while (0)

namespace {

std::string check_out(const at::Tensor& t, const char* name, at::ScalarType dtype,
               at::IntArrayRef shape, const at::Device& device) {
  DDT_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  DDT_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  DDT_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  DDT_CHECK(t.is_contiguous(), name, " must be contiguous");
  return "";
}

// Per device: the opt-in dynamic shared-memory limit per block (0 = not queried yet).
std::atomic<int> g_smem_optin[64];

std::string check_cuda(cudaError_t err, const char* what) {
  DDT_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err), " (",
            cudaGetErrorName(err), ")");
  return "";
}

std::string smem_optin_limit(int dev, int* limit) {
  if (dev >= 0 && dev < 64 && g_smem_optin[dev].load() > 0) {
    *limit = g_smem_optin[dev].load();
    return "";
  }
  DDT_TRY(check_cuda(cudaDeviceGetAttribute(limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                     "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)"));
  if (dev >= 0 && dev < 64) g_smem_optin[dev].store(*limit);
  return "";
}

}  // namespace

std::string tree_build_launch(const at::Tensor& root_ids, const at::Tensor& topk_logp,
                       const at::Tensor& topk_ids, int64_t budget, const at::Tensor& tokens,
                       const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& valid,
                       const at::Tensor& scores, const at::Tensor& ancestor_mask,
                       const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                       const at::Tensor& retrive_next_sibling,
                       const std::optional<at::Tensor>& seq_lens,
                       const std::optional<at::Tensor>& positions,
                       const std::optional<at::Tensor>& full_mask, int64_t threads,
                       int64_t algo) {
  DDT_CHECK(topk_logp.is_cuda(), "topk_logp must be a CUDA tensor");
  const at::Device device = topk_logp.device();
  DDT_CHECK(topk_logp.dim() == 3, "topk_logp must be [bs, D, K], got ",
              topk_logp.sizes());
  const int64_t bs = topk_logp.size(0), D = topk_logp.size(1), K = topk_logp.size(2);
  DDT_CHECK(topk_logp.scalar_type() == at::kFloat, "topk_logp must be float32, got ",
              topk_logp.scalar_type());
  DDT_CHECK(topk_logp.stride(2) == 1, "topk_logp must be contiguous in K");
  DDT_CHECK(topk_ids.device() == device && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.sizes() == topk_logp.sizes() && topk_ids.stride(2) == 1,
              "topk_ids must be int64 ", topk_logp.sizes(), " on ", device,
              ", contiguous in K; got ", topk_ids.scalar_type(), " ", topk_ids.sizes(), " on ",
              topk_ids.device());
  DDT_CHECK(root_ids.device() == device && root_ids.scalar_type() == at::kLong &&
                  root_ids.dim() == 1 && root_ids.size(0) == bs && root_ids.stride(0) == 1,
              "root_ids must be contiguous int64 [", bs, "] on ", device, ", got ",
              root_ids.scalar_type(), " ", root_ids.sizes(), " on ", root_ids.device());
  DDT_CHECK(budget >= 1 && budget <= ddtree::kMaxBudget, "budget must be in [1, ",
              ddtree::kMaxBudget, "], got ", budget);
  DDT_CHECK(D >= 1 && K >= 1, "topk_logp must have D >= 1 and K >= 1, got ",
              topk_logp.sizes());
  // A node of depth d has d - 1 ancestors in the tree, so depths beyond the budget never fit.
  const int64_t d_eff = D < budget ? D : budget;
  DDT_CHECK(d_eff <= ddtree::kMaxDepth, "min(D, budget) must be <= ",
              ddtree::kMaxDepth, ", got D=", D, ", budget=", budget);
  const int64_t N = budget + 1;
  DDT_TRY(check_out(tokens, "tokens", at::kLong, {bs, N}, device));
  DDT_TRY(check_out(parents, "parents", at::kLong, {bs, N}, device));
  DDT_TRY(check_out(depths, "depths", at::kLong, {bs, N}, device));
  DDT_TRY(check_out(valid, "valid", at::kBool, {bs, N}, device));
  DDT_TRY(check_out(scores, "scores", at::kFloat, {bs, N}, device));
  DDT_TRY(check_out(ancestor_mask, "ancestor_mask", at::kBool, {bs, N, N}, device));
  DDT_TRY(check_out(retrive_index, "retrive_index", at::kLong, {bs, N}, device));
  DDT_TRY(check_out(retrive_next_token, "retrive_next_token", at::kLong, {bs, N}, device));
  DDT_TRY(check_out(retrive_next_sibling, "retrive_next_sibling", at::kLong, {bs, N}, device));
  const bool has_seq = seq_lens.has_value();
  DDT_CHECK(has_seq || (!positions.has_value() && !full_mask.has_value()),
              "positions and full_mask need seq_lens");
  if (has_seq) {
    DDT_TRY(check_out(*seq_lens, "seq_lens", at::kLong, {bs}, device));
  }
  if (positions.has_value()) {
    DDT_TRY(check_out(*positions, "positions", at::kLong, {bs, N}, device));
  }
  if (full_mask.has_value()) {
    // The needed length depends on device-side seq_lens; the caller sizes the buffer.
    DDT_CHECK(full_mask->device() == device && full_mask->scalar_type() == at::kBool &&
                    full_mask->dim() == 1 && full_mask->is_contiguous(),
                "full_mask must be a contiguous 1-D bool tensor on ", device);
  }
  DDT_CHECK(algo == ddtree::kAlgoAuto || algo == ddtree::kAlgoLevelwise ||
                algo == ddtree::kAlgoFrontier || algo == ddtree::kAlgoMerge ||
                algo == ddtree::kAlgoDeferred || algo == ddtree::kAlgoDeferredWarp,
            "algo must be 0 (auto), 1 (level-wise), 2 (frontier), 3 (merge), 4 (deferred) or 5 "
            "(deferred_warp), got ", algo);
  if (bs == 0) return "";

  const int B = static_cast<int>(budget);
  const int Kp = static_cast<int>(K < budget ? K : budget);
  const int T = threads > 0 ? static_cast<int>(threads)
                            : ddtree::default_threads_for(static_cast<int>(algo), B, Kp,
                                                          static_cast<int>(d_eff));
  DDT_CHECK(T % 32 == 0 && T >= 32 && T <= 1024, "threads must be a multiple of 32 in "
              "[32, 1024], got ", T);

  const c10::cuda::CUDAGuard guard(device);
  const int dev = device.index();
  int max_optin = 0;
  DDT_TRY(smem_optin_limit(dev, &max_optin));
  const int64_t smem = ddtree::tree_build_smem(static_cast<int>(algo), B, Kp,
                                               static_cast<int>(d_eff), max_optin);
  DDT_CHECK(smem <= max_optin, "budget ", B, " x depth ", d_eff, " needs ", smem,
              " bytes of shared memory per block; this GPU allows ", max_optin);

  ddtree::TreeBuildParams p{};
  p.logp = topk_logp.data_ptr<float>();
  p.logp_sb = topk_logp.stride(0);
  p.logp_sd = topk_logp.stride(1);
  p.ids = topk_ids.data_ptr<int64_t>();
  p.ids_sb = topk_ids.stride(0);
  p.ids_sd = topk_ids.stride(1);
  p.root_ids = root_ids.data_ptr<int64_t>();
  p.D = static_cast<int>(d_eff);
  p.Kp = Kp;
  p.B = B;
  p.gcap = ddtree::tree_build_gcap(static_cast<int>(algo), B, Kp, static_cast<int>(d_eff),
                                   max_optin);
  p.tokens = tokens.data_ptr<int64_t>();
  p.parents = parents.data_ptr<int64_t>();
  p.depths = depths.data_ptr<int64_t>();
  p.valid = valid.data_ptr<bool>();
  p.scores = scores.data_ptr<float>();
  p.ancestor_mask = ancestor_mask.data_ptr<bool>();
  p.retrive_index = retrive_index.data_ptr<int64_t>();
  p.retrive_next_token = retrive_next_token.data_ptr<int64_t>();
  p.retrive_next_sibling = retrive_next_sibling.data_ptr<int64_t>();
  p.seq_lens = has_seq ? seq_lens->data_ptr<int64_t>() : nullptr;
  p.positions = positions.has_value() ? positions->data_ptr<int64_t>() : nullptr;
  p.full_mask = full_mask.has_value() ? full_mask->data_ptr<bool>() : nullptr;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  return check_cuda(ddtree::tree_build_launch_raw(p, static_cast<int>(bs), T, smem, dev, stream,
                                                  static_cast<int>(algo)),
                    "kernel launch");
}

// smem_limit: the device's shared memory per block (opt-in); < 0: no limit (the deferred
// variants' larger G capacity).
int64_t tree_build_smem_bytes(int64_t budget, int64_t K, int64_t D, int64_t algo,
                              int64_t smem_limit) {
  const int Kp = static_cast<int>(K < budget ? K : budget);
  const int d_eff = static_cast<int>(D < budget ? D : budget);
  return ddtree::tree_build_smem(static_cast<int>(algo), static_cast<int>(budget), Kp, d_eff,
                                 smem_limit < 0 ? INT64_MAX : smem_limit);
}

// Which kernel serves (algo, budget, K, D): "frontier", "merge", "deferred", "deferred_warp" or
// "levelwise".
std::string tree_build_kernel_name(int64_t budget, int64_t K, int64_t D, int64_t algo) {
  const int Kp = static_cast<int>(K < budget ? K : budget);
  const int d_eff = static_cast<int>(D < budget ? D : budget);
  return ddtree::tree_kernel_name(ddtree::tree_kernel_index(static_cast<int>(algo),
                                                             static_cast<int>(budget), Kp, d_eff));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_build", &tree_build_launch,
        "Build DDTree draft trees for a batch in one launch, writing into preallocated outputs. "
        "Returns an error message, or an empty string on success (never throws).",
        py::arg("root_ids"), py::arg("topk_logp"), py::arg("topk_ids"), py::arg("budget"),
        py::arg("tokens"), py::arg("parents"), py::arg("depths"), py::arg("valid"),
        py::arg("scores"), py::arg("ancestor_mask"), py::arg("retrive_index"),
        py::arg("retrive_next_token"), py::arg("retrive_next_sibling"),
        py::arg("seq_lens") = py::none(), py::arg("positions") = py::none(),
        py::arg("full_mask") = py::none(), py::arg("threads") = 0, py::arg("algo") = 0);
  m.def("smem_bytes", &tree_build_smem_bytes,
        "Dynamic shared memory per block for (budget, K, D) and algo (0 auto, 1 level-wise, "
        "2 frontier, 3 merge, 4 deferred, 5 deferred_warp) on a device granting smem_limit "
        "bytes per block (-1: no limit).",
        py::arg("budget"), py::arg("K"), py::arg("D"), py::arg("algo") = 0,
        py::arg("smem_limit") = -1);
  m.def("kernel_name", &tree_build_kernel_name,
        "The kernel that serves (budget, K, D, algo): 'frontier', 'merge', 'deferred', "
        "'deferred_warp' or 'levelwise'.",
        py::arg("budget"), py::arg("K"), py::arg("D"), py::arg("algo") = 0);
}
