// Raw launcher of the tree-build kernels (tree_build_kernel.cuh): the only code nvcc compiles.
//
// Why so little here: a C++ exception (c10::Error from TORCH_CHECK) thrown from host code that
// nvcc compiled crashed the process on the H200 toolchain (torch 2.11+cu130, nvcc 13.0) instead
// of reaching Python. So this translation unit has no torch headers and throws nothing: it takes
// parameters already validated by tree_build.cpp (host C++ compiler), launches, and returns a
// cudaError_t that tree_build.cpp turns into a Python RuntimeError.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "tree_build_kernel.cuh"

namespace {

constexpr int kTrackedDevices = 64;
constexpr int kKernels = ddtree::kTreeKernels;
constexpr int64_t kDefaultSmemLimit = 48 * 1024;  // above this the kernel needs an opt-in

using KernelFn = ddtree::TreeKernelFn;

// Per kernel and device: the largest dynamic shared memory already granted (0 = none). Only
// grows; raising it holds g_smem_lock so that a smaller grant never overwrites a larger one. A
// spin lock on an atomic flag rather than std::mutex, whose lock() may throw.
std::atomic<int64_t> g_smem_granted[kKernels][kTrackedDevices];
std::atomic_flag g_smem_lock = ATOMIC_FLAG_INIT;

cudaError_t grant_smem(KernelFn fn, int64_t smem_bytes) {
  return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem_bytes));
}

}  // namespace

namespace ddtree {

// Launches one block of `threads` threads per request on `stream` (device `device` must be
// current): the kernel tree_kernel_index(algo, ...) picks, first raising its dynamic shared-memory
// limit to `smem_bytes` when the default 48 KB does not suffice. Enqueues no allocation and no
// host sync, and cudaFuncSetAttribute is not a stream operation, so the call is CUDA-graph
// capturable. Returns the first CUDA error (cudaSuccess when the launch was accepted).
cudaError_t tree_build_launch_raw(const TreeBuildParams& p, int bs, int threads,
                                  int64_t smem_bytes, int device, cudaStream_t stream,
                                  int algo) noexcept {
  const int slot = tree_kernel_index(algo, p.B, p.Kp, p.D);
  const KernelFn fn = tree_kernel_fn(slot);
  threads = tree_kernel_threads(slot, threads);  // the kernels' launch bounds
  if (smem_bytes > kDefaultSmemLimit) {
    if (device < 0 || device >= kTrackedDevices) {
      const cudaError_t err = grant_smem(fn, smem_bytes);
      if (err != cudaSuccess) return err;
    } else if (g_smem_granted[slot][device].load() < smem_bytes) {
      while (g_smem_lock.test_and_set(std::memory_order_acquire)) {
      }
      cudaError_t err = cudaSuccess;
      if (g_smem_granted[slot][device].load() < smem_bytes) {
        err = grant_smem(fn, smem_bytes);
        if (err == cudaSuccess) g_smem_granted[slot][device].store(smem_bytes);
      }
      g_smem_lock.clear(std::memory_order_release);
      if (err != cudaSuccess) return err;
    }
  }
  fn<<<static_cast<unsigned>(bs), threads, static_cast<size_t>(smem_bytes), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ddtree
