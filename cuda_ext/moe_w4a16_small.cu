// C entry points of the small-M W4A16 MoE GEMMs (moe_w4a16_small.cuh), built by
// cuda_ext/loader.py into a plain shared library (nvcc, static CUDA runtime, no torch headers)
// and called through ctypes by sglang_ddtree.triton_kernels.moe_w4a16_small. Every entry point
// returns a cudaError_t (0 = success) and never throws. No allocation and no host sync: the
// launches are CUDA-graph capturable (the caller passes the capturing stream).
#include <cuda_runtime.h>

#include "moe_w4a16_small.cuh"

namespace {

template <int NT, int U>
cudaError_t launch_gate_up(const ddtree_moe::GateUpParams& p, dim3 grid, cudaStream_t stream) {
  ddtree_moe::gate_up_kernel<NT, U><<<grid, ddtree_moe::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int NT, int U>
cudaError_t launch_down(const ddtree_moe::DownParams& p, dim3 grid, cudaStream_t stream) {
  ddtree_moe::down_kernel<NT, U><<<grid, ddtree_moe::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The instantiations a call may pick: n-tiles 1 / 2 (blocks of 8 / 16 rows), pipeline depths.
#define DDT_GATE_UP_CASES(X) X(1, 2) X(1, 3) X(1, 4) X(2, 2) X(2, 3)
#define DDT_DOWN_CASES(X) X(1, 4) X(1, 8) X(2, 4) X(2, 8)

}  // namespace

extern "C" {

// grid: (max_blocks * split_max, ceil(I / 256)); counters: max_blocks * ceil(I / 256) ints.
int ddtree_moe_small_gate_up(const void* x, long long x_stride, const void* w, const void* s,
                             const int* sorted_ids, const int* block_expert, void* part,
                             int* counters, void* h, int max_blocks, int T, int topk, int K,
                             int I, int part_rows, int split_max, int split_target, int nt, int u,
                             int device, void* stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return int(err);
  ddtree_moe::GateUpParams p;
  p.x = static_cast<const uint16_t*>(x);
  p.w = static_cast<const int32_t*>(w);
  p.s = static_cast<const uint16_t*>(s);
  p.sorted_ids = sorted_ids;
  p.block_expert = block_expert;
  p.part = static_cast<float*>(part);
  p.counters = counters;
  p.h = static_cast<uint16_t*>(h);
  p.x_stride = x_stride;
  p.max_blocks = max_blocks;
  p.T = T;
  p.topk = topk;
  p.K = K;
  p.I = I;
  p.part_rows = part_rows;
  p.split_max = split_max;
  p.split_target = split_target;
  const dim3 grid(max_blocks * split_max, (I + 32 * ddtree_moe::kWarps - 1) / (32 * ddtree_moe::kWarps));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
#define DDT_CASE(A, B) \
  if (nt == A && u == B) return int(launch_gate_up<A, B>(p, grid, st));
  DDT_GATE_UP_CASES(DDT_CASE)
#undef DDT_CASE
  return int(cudaErrorInvalidValue);
}

// grid: (max_blocks, ceil(N / 256)).
int ddtree_moe_small_down(const void* h, const void* w, const void* s, const int* sorted_ids,
                          const int* block_expert, const void* topk_w, int topk_bf16, void* y,
                          int max_blocks, int T, int N, int I, int nt, int u, int device,
                          void* stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return int(err);
  ddtree_moe::DownParams p;
  p.h = static_cast<const uint16_t*>(h);
  p.w = static_cast<const int32_t*>(w);
  p.s = static_cast<const uint16_t*>(s);
  p.sorted_ids = sorted_ids;
  p.block_expert = block_expert;
  p.topk_w = topk_w;
  p.topk_bf16 = topk_bf16;
  p.y = static_cast<uint16_t*>(y);
  p.T = T;
  p.N = N;
  p.I = I;
  const dim3 grid(max_blocks, (N + 32 * ddtree_moe::kWarps - 1) / (32 * ddtree_moe::kWarps));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
#define DDT_CASE(A, B) \
  if (nt == A && u == B) return int(launch_down<A, B>(p, grid, st));
  DDT_DOWN_CASES(DDT_CASE)
#undef DDT_CASE
  return int(cudaErrorInvalidValue);
}

// Loads every kernel on `device` (outside any stream capture, so that a first launch inside one
// does not load a module) and writes per kernel [registers, local (spill) bytes per thread] into
// out (2 ints each: gate-up cases, then down cases, in the macro order). Returns the count of
// kernels written, or -cudaError_t.
int ddtree_moe_small_probe(int device, int* out, int capacity) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return -int(err);
  int n = 0;
  cudaFuncAttributes a;
#define DDT_PROBE(K)                                              \
  err = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(K)); \
  if (err != cudaSuccess) return -int(err);                      \
  if (2 * n + 1 < capacity) {                                    \
    out[2 * n] = a.numRegs;                                      \
    out[2 * n + 1] = int(a.localSizeBytes);                      \
  }                                                              \
  ++n;
#define DDT_CASE_G(A, B) DDT_PROBE((ddtree_moe::gate_up_kernel<A, B>))
#define DDT_CASE_D(A, B) DDT_PROBE((ddtree_moe::down_kernel<A, B>))
  DDT_GATE_UP_CASES(DDT_CASE_G)
  DDT_DOWN_CASES(DDT_CASE_D)
#undef DDT_CASE_G
#undef DDT_CASE_D
#undef DDT_PROBE
  return n;
}

}  // extern "C"
