// Python bindings of the fused DDTree tree-build kernel (tree_build.cu).
#include <torch/extension.h>

#include <optional>

void tree_build_launch(const at::Tensor& root_ids, const at::Tensor& topk_logp,
                       const at::Tensor& topk_ids, int64_t budget, const at::Tensor& tokens,
                       const at::Tensor& parents, const at::Tensor& depths, const at::Tensor& valid,
                       const at::Tensor& scores, const at::Tensor& ancestor_mask,
                       const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                       const at::Tensor& retrive_next_sibling,
                       const std::optional<at::Tensor>& seq_lens,
                       const std::optional<at::Tensor>& positions,
                       const std::optional<at::Tensor>& full_mask, int64_t threads);

int64_t tree_build_smem_bytes(int64_t budget, int64_t K, int64_t D);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_build", &tree_build_launch,
        "Build DDTree draft trees for a batch in one launch, writing into preallocated outputs.",
        py::arg("root_ids"), py::arg("topk_logp"), py::arg("topk_ids"), py::arg("budget"),
        py::arg("tokens"), py::arg("parents"), py::arg("depths"), py::arg("valid"),
        py::arg("scores"), py::arg("ancestor_mask"), py::arg("retrive_index"),
        py::arg("retrive_next_token"), py::arg("retrive_next_sibling"),
        py::arg("seq_lens") = py::none(), py::arg("positions") = py::none(),
        py::arg("full_mask") = py::none(), py::arg("threads") = 0);
  m.def("smem_bytes", &tree_build_smem_bytes,
        "Dynamic shared memory per block for (budget, K, D).", py::arg("budget"), py::arg("K"),
        py::arg("D"));
}
