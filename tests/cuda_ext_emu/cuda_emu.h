// Host emulation of the few CUDA features cuda_ext/tree_build_kernel.cuh uses, so that the
// kernel's logic runs on a CPU in CI: one std::thread per CUDA thread, std::barrier for
// __syncthreads and for the warp shuffles, blocks run one after another. Correctness only (no
// timing, no warp-synchronous behaviour is modelled: the kernel relies on none).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct EmuDim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local EmuDim3 threadIdx;
inline EmuDim3 blockIdx;
inline EmuDim3 blockDim;

struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct alignas(16) ulonglong2 { unsigned long long x, y; };

// Shared-memory atomics: the total, and per phase (between two block barriers) the count on the
// busiest address, summed over phases -- how many atomics a block must serialize at least when
// they collide on one address (a radix histogram with most keys in one bin).
inline std::mutex g_emu_atomic_mu;
inline std::unordered_map<const void*, long> g_emu_atomic_phase;
inline long g_emu_atomics = 0;
inline long g_emu_atomic_depth = 0;
inline void emu_fold_atomics() {
  long worst = 0;
  for (const auto& kv : g_emu_atomic_phase) worst = std::max(worst, kv.second);
  g_emu_atomic_depth += worst;
  g_emu_atomic_phase.clear();
}
struct EmuBarrierDone {
  void operator()() noexcept { emu_fold_atomics(); }  // every thread arrived: the phase is over
};
inline std::unique_ptr<std::barrier<EmuBarrierDone>> g_emu_block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> g_emu_warp_bar;
inline std::vector<std::vector<uint64_t>> g_emu_warp_buf;

// Block-wide barriers passed by thread 0 of every block so far: the kernel's count of serial
// phases, which sets its latency when its per-phase work is small (scripts/tree_build_phases.py).
inline long g_emu_block_syncs = 0;
inline void __syncthreads() {
  if (threadIdx.x == 0) ++g_emu_block_syncs;
  g_emu_block_bar->arrive_and_wait();
}

// Every lane publishes a value; fn folds the 32 values (each lane gets fn's result for it).
template <typename Fold>
inline uint64_t emu_warp_all(uint64_t v, Fold fn) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  g_emu_warp_buf[warp][lane] = v;
  g_emu_warp_bar[warp]->arrive_and_wait();
  uint64_t acc = fn(g_emu_warp_buf[warp]);
  g_emu_warp_bar[warp]->arrive_and_wait();
  return acc;
}

// A shuffle: this lane reads lane src's value.
template <typename T>
inline T emu_shfl(T v, int src) {
  static_assert(sizeof(T) <= 8, "64-bit values at most");
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  const uint64_t got = emu_warp_all(raw, [src](const std::vector<uint64_t>& b) { return b[src]; });
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}
inline int emu_lane() { return threadIdx.x & 31; }
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src & 31); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, int d) {
  return emu_shfl(v, emu_lane() >= d ? emu_lane() - d : emu_lane());
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, int d) {
  return emu_shfl(v, emu_lane() + d < 32 ? emu_lane() + d : emu_lane());
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int d) { return emu_shfl(v, emu_lane() ^ d); }
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  return unsigned(emu_warp_all(v, [](const std::vector<uint64_t>& b) {
    uint64_t t = 0;
    for (uint64_t x : b) t += x;
    return t;
  }));
}
// Also orders the warp's shared-memory accesses (the emulation's memory is sequentially
// consistent enough through the barrier's synchronisation).
inline void __syncwarp(unsigned = 0xFFFFFFFFu) {
  g_emu_warp_bar[threadIdx.x >> 5]->arrive_and_wait();
}
inline unsigned __ballot_sync(unsigned, int pred) {
  const int lane = emu_lane();
  return unsigned(emu_warp_all(pred ? (uint64_t(1) << lane) : 0, [](const std::vector<uint64_t>& b) {
    uint64_t bits = 0;
    for (uint64_t x : b) bits |= x;
    return bits;
  }));
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline bool __any_sync(unsigned, int pred) {
  return emu_warp_all(pred ? 1 : 0, [](const std::vector<uint64_t>& b) {
    uint64_t any = 0;
    for (uint64_t x : b) any |= x;
    return any;
  }) != 0;
}

inline int atomicAdd(int* p, int v) {
  {
    std::lock_guard<std::mutex> lock(g_emu_atomic_mu);
    ++g_emu_atomics;
    ++g_emu_atomic_phase[p];
  }
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
using std::fminf;
using std::min;

// The most barriers one block passed: with one block per request, the slowest block sets the
// launch's time.
inline long g_emu_block_syncs_max = 0;

template <typename Kernel, typename Params>
inline void emu_launch(Kernel kernel, int grid, int threads, const Params& params) {
  const int nw = threads / 32;
  for (int bidx = 0; bidx < grid; ++bidx) {
    const long syncs_before = g_emu_block_syncs;
    blockIdx.x = bidx;
    blockDim.x = threads;
    g_emu_block_bar = std::make_unique<std::barrier<EmuBarrierDone>>(threads);
    g_emu_warp_bar.clear();
    g_emu_warp_buf.assign(nw, std::vector<uint64_t>(32));
    for (int w = 0; w < nw; ++w) g_emu_warp_bar.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { threadIdx.x = t; kernel(params); });
    for (auto& th : ts) th.join();
    emu_fold_atomics();  // the last phase ends with the block
    g_emu_block_syncs_max = std::max(g_emu_block_syncs_max, g_emu_block_syncs - syncs_before);
  }
}
