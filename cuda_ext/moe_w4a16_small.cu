// C entry points of the small-M W4A16 MoE GEMMs (moe_w4a16_small.cuh), built by
// cuda_ext/loader.py into a plain shared library (nvcc, static CUDA runtime, no torch headers)
// and called through ctypes by sglang_ddtree.triton_kernels.moe_w4a16_small. Every entry point
// returns a cudaError_t (0 = success) and never throws. No allocation and no host sync: the
// launches are CUDA-graph capturable (the caller passes the capturing stream). Call
// ddtree_moe_small_probe on a device before the first launch there (outside any capture): it
// loads the kernels and raises their dynamic shared memory limit.
#include <cuda_runtime.h>
#include <stdlib.h>

#include "moe_w4a16_small.cuh"

namespace {

// The instantiations a call may pick: (n-tiles 1 / 2: blocks of 8 / 16 rows, ring stages).
#define DDT_GATE_UP_CASES(X) X(1, 4) X(1, 6) X(1, 8) X(2, 4)
#define DDT_DOWN_CASES(X) X(1, 4) X(1, 8) X(2, 4) X(2, 6)

template <int NT, int S>
cudaError_t launch_gate_up(const ddtree_moe::GateUpParams& p, dim3 grid, cudaStream_t stream) {
  ddtree_moe::gate_up_kernel<NT, S>
      <<<grid, ddtree_moe::kThreads, ddtree_moe::gate_up_smem<NT, S>(), stream>>>(p);
  return cudaGetLastError();
}

template <int NT, int S>
cudaError_t launch_down(const ddtree_moe::DownParams& p, dim3 grid, cudaStream_t stream) {
  ddtree_moe::down_kernel<NT, S>
      <<<grid, ddtree_moe::kThreads, ddtree_moe::down_smem<NT, S>(), stream>>>(p);
  return cudaGetLastError();
}

unsigned col_ctas(int n) { return (n + 32 * ddtree_moe::kWarps - 1) / (32 * ddtree_moe::kWarps); }

}  // namespace

extern "C" {

// Grid (ctas, ceil(I / 256)); part: [2 ctas, 8 nt, 2 I] fp32; counters: max_blocks *
// ceil(I / 256) ints, zero (left zero).
int ddtree_moe_small_gate_up(const void* x, long long x_stride, const void* w, const void* s,
                             const int* sorted_ids, const int* block_expert, void* part,
                             int* counters, void* h, int max_blocks, int T, int topk, int K,
                             int I, int ctas, int nt, int stages, int device, void* stream) {
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
  p.dbg = getenv("DDTREE_MOE_DBG_X") != nullptr;
  const dim3 grid(ctas, col_ctas(I));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
#define DDT_CASE(A, B) \
  if (nt == A && stages == B) return int(launch_gate_up<A, B>(p, grid, st));
  DDT_GATE_UP_CASES(DDT_CASE)
#undef DDT_CASE
  return int(cudaErrorInvalidValue);
}

// Grid (ctas, ceil(N / 256)).
int ddtree_moe_small_down(const void* h, const void* w, const void* s, const int* sorted_ids,
                          const int* block_expert, const void* topk_w, int topk_bf16, void* y,
                          int max_blocks, int T, int N, int I, int ctas, int nt, int stages,
                          int device, void* stream) {
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
  p.max_blocks = max_blocks;
  p.T = T;
  p.N = N;
  p.I = I;
  p.dbg = getenv("DDTREE_MOE_DBG_X") != nullptr;
  const dim3 grid(ctas, col_ctas(N));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
#define DDT_CASE(A, B) \
  if (nt == A && stages == B) return int(launch_down<A, B>(p, grid, st));
  DDT_DOWN_CASES(DDT_CASE)
#undef DDT_CASE
  return int(cudaErrorInvalidValue);
}

// Loads every kernel on `device`, sets its dynamic shared memory limit, and writes per kernel
// [registers, local (spill) bytes per thread, resident CTAs per SM, dynamic shared bytes] into
// out (4 ints each: gate-up cases, then down cases, in the macro order). Returns the count of
// kernels written, or -cudaError_t. Call outside any stream capture.
int ddtree_moe_small_probe(int device, int* out, int capacity) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return -int(err);
  int n = 0;
  cudaFuncAttributes a;
  int occ = 0;
  const char* carve = getenv("DDTREE_MOE_CARVEOUT");
#define DDT_PROBE(K, SMEM)                                                                   \
  err = cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);          \
  if (err != cudaSuccess) return -int(err);                                                 \
  if (carve) cudaFuncSetAttribute(K, cudaFuncAttributePreferredSharedMemoryCarveout, atoi(carve)); \
  err = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(K));                            \
  if (err != cudaSuccess) return -int(err);                                                 \
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, K, ddtree_moe::kThreads, SMEM);   \
  if (err != cudaSuccess) return -int(err);                                                 \
  if (4 * n + 3 < capacity) {                                                               \
    out[4 * n] = a.numRegs;                                                                 \
    out[4 * n + 1] = int(a.localSizeBytes);                                                 \
    out[4 * n + 2] = occ;                                                                   \
    out[4 * n + 3] = SMEM;                                                                  \
  }                                                                                         \
  ++n;
#define DDT_CASE_G(A, B) \
  DDT_PROBE((ddtree_moe::gate_up_kernel<A, B>), (ddtree_moe::gate_up_smem<A, B>()))
#define DDT_CASE_D(A, B) DDT_PROBE((ddtree_moe::down_kernel<A, B>), (ddtree_moe::down_smem<A, B>()))
  DDT_GATE_UP_CASES(DDT_CASE_G)
  DDT_DOWN_CASES(DDT_CASE_D)
#undef DDT_CASE_G
#undef DDT_CASE_D
#undef DDT_PROBE
  return n;
}

}  // extern "C"
