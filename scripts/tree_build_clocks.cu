// Phase clocks of the fused tree-build kernels on a GPU, for scripts/tree_build_clocks.py (which
// writes the input, compiles this with -DDDTREE_PHASE_CLOCKS=<blocks> and reads the output).
// Usage: tree_build_clocks IN OUT
// IN : the format of tests/cuda_ext_emu/emu_driver.cpp (int64 header [bs, D, K, B, threads,
//      fill (unused), algo]; float32 logp; int64 ids; int64 roots; int64 seq_lens).
// OUT: int64 [blocks][2 * kClockPairs + 1] as the kernel recorded them on the last of 50
//      launches (per block: count, then (mark id, clock64) pairs), then one float: the mean
//      microseconds per launch over 200 back-to-back launches (launch gaps included).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tree_build_kernel.cuh"

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                    \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

template <typename T>
static T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, sizeof(T) * (v.size() ? v.size() : 1)));
  if (!v.empty()) CHECK(cudaMemcpy(d, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
static T* zeros(size_t n) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, sizeof(T) * (n ? n : 1)));
  CHECK(cudaMemset(d, 0, sizeof(T) * (n ? n : 1)));
  return d;
}

template <typename T>
static std::vector<T> read_vec(FILE* f, size_t n) {
  std::vector<T> v(n);
  if (n && fread(v.data(), sizeof(T), n, f) != n) {
    fprintf(stderr, "short input\n");
    exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: tree_build_clocks IN OUT\n");
    return 2;
  }
  FILE* f = fopen(argv[1], "rb");
  const std::vector<int64_t> h = read_vec<int64_t>(f, 7);
  const int bs = int(h[0]), D = int(h[1]), K = int(h[2]), B = int(h[3]), algo = int(h[6]);
  const int T = h[4] > 0 ? int(h[4])
                         : ddtree::default_threads_for(int(h[6]), B, std::min(K, B), std::min(D, B));
  const int N = B + 1;
  const size_t nl = size_t(bs) * D * K, nn = size_t(bs) * N;
  const auto logp = read_vec<float>(f, nl);
  const auto ids = read_vec<int64_t>(f, nl);
  const auto root = read_vec<int64_t>(f, bs);
  fclose(f);

  ddtree::TreeBuildParams p{};
  p.logp = upload(logp);
  p.logp_sb = int64_t(D) * K;
  p.logp_sd = K;
  p.ids = upload(ids);
  p.ids_sb = int64_t(D) * K;
  p.ids_sd = K;
  p.root_ids = upload(root);
  p.D = D < B ? D : B;  // as the launcher in tree_build.cpp
  p.Kp = K < B ? K : B;
  p.B = B;
  p.tokens = zeros<int64_t>(nn);
  p.parents = zeros<int64_t>(nn);
  p.depths = zeros<int64_t>(nn);
  p.valid = zeros<bool>(nn);
  p.scores = zeros<float>(nn);
  p.ancestor_mask = zeros<bool>(nn * N);
  p.retrive_index = zeros<int64_t>(nn);
  p.retrive_next_token = zeros<int64_t>(nn);
  p.retrive_next_sibling = zeros<int64_t>(nn);
  // no verify layout, as in scripts/bench_tree_build.py

  int optin = 0;
  CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  p.gcap = ddtree::tree_build_gcap(algo, B, p.Kp, p.D, optin);  // as the launcher
  const int64_t smem = ddtree::tree_build_smem(algo, B, p.Kp, p.D, optin);
  const int kernel = ddtree::tree_kernel_index(algo, B, p.Kp, p.D);
  const ddtree::TreeKernelFn fn = ddtree::tree_kernel_fn(kernel);
  const int threads = ddtree::tree_kernel_threads(kernel, T);
  CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  for (int i = 0; i < 50; ++i) fn<<<bs, threads, smem>>>(p);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  const size_t per_block = 2 * ddtree::kClockPairs + 1;
  std::vector<long long> clocks(size_t(DDTREE_PHASE_CLOCKS) * per_block);
  CHECK(cudaMemcpyFromSymbol(clocks.data(), ddtree::g_phase_clocks,
                             sizeof(long long) * clocks.size()));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < 200; ++i) fn<<<bs, threads, smem>>>(p);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  const float us = ms * 1e3f / 200.0f;
  FILE* o = fopen(argv[2], "wb");
  fwrite(clocks.data(), sizeof(long long), clocks.size(), o);
  fwrite(&us, sizeof(float), 1, o);
  fclose(o);
  fprintf(stderr, "kernel %s, threads %d, smem %lld: %.2f us per launch\n",
          ddtree::tree_kernel_name(kernel), threads, (long long)smem, us);
  return 0;
}
