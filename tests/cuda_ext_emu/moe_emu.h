// Host emulation of the primitives cuda_ext/moe_w4a16_small.cuh uses (on top of cuda_emu.h):
// bf16x2 arithmetic with round-to-nearest-even, prmt, lop3, and the warp-collective
// mma.sync.m16n8k16 (every lane publishes its fragments, each lane computes its own C entries
// from the whole warp's A and B, fp32 sums in k order). Correctness only.
#pragma once
#define DDTREE_EMU 1
#include "cuda_emu.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#define DDT_DEV inline
#define DDT_GLOBAL
#define DDT_SHARED static

struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline EmuDim3 gridDim;
inline void __threadfence() {}

namespace ddtree_moe {

inline float emu_bf16(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
inline uint16_t emu_round_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return uint16_t((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
inline uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t out = 0;
  for (int half = 0; half < 2; ++half) {
    const int sh = 16 * half;
    const double r = double(emu_bf16(uint16_t(a >> sh))) * double(emu_bf16(uint16_t(b >> sh))) +
                     double(emu_bf16(uint16_t(c >> sh)));
    // the operands here make r exact in fp32 (small integers, q * s), so one rounding to bf16
    out |= uint32_t(emu_round_bf16(float(r))) << sh;
  }
  return out;
}
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t src = uint64_t(a) | (uint64_t(b) << 32);
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned which = (sel >> (4 * i)) & 7u;  // no sign replication used
    out |= uint32_t((src >> (8 * which)) & 0xFFu) << (8 * i);
  }
  return out;
}
inline uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(emu_round_bf16(lo)) | (uint32_t(emu_round_bf16(hi)) << 16);
}
inline float bf16_to_float(uint16_t v) { return emu_bf16(v); }
inline float fast_exp(float x) { return std::exp(x); }

inline std::vector<std::array<uint32_t, 6>> g_emu_mma_buf;  // [warp * 32 + lane]

inline void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                     uint32_t b0, uint32_t b1) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  g_emu_mma_buf[warp * 32 + lane] = {a0, a1, a2, a3, b0, b1};
  g_emu_warp_bar[warp]->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const auto& f = g_emu_mma_buf[warp * 32 + l];
    const int g = l >> 2, t = l & 3;
    // A: a0a1 (row g, k 2t..), a2a3 (row g+8, k 2t..), a4a5 (row g, k 2t+8..), a6a7 (g+8, 2t+8..)
    const int rows[4] = {g, g + 8, g, g + 8}, ks[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; ++r) {
      A[rows[r]][ks[r]] = emu_bf16(uint16_t(f[r]));
      A[rows[r]][ks[r] + 1] = emu_bf16(uint16_t(f[r] >> 16));
    }
    // B: b0b1 (k 2t, 2t+1; col g), b2b3 (k 2t+8, 2t+9; col g)
    B[2 * t][g] = emu_bf16(uint16_t(f[4]));
    B[2 * t + 1][g] = emu_bf16(uint16_t(f[4] >> 16));
    B[2 * t + 8][g] = emu_bf16(uint16_t(f[5]));
    B[2 * t + 9][g] = emu_bf16(uint16_t(f[5] >> 16));
  }
  g_emu_warp_bar[warp]->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  const int rr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float s = c[i];
    for (int k = 0; k < 16; ++k) s += A[rr[i]][k] * B[k][cc[i]];
    c[i] = s;
  }
}

// cp.async lands at once here (the kernels read only their own lane's copies after a wait).
inline void cp_async16_stream(void* d, const void* s) { std::memcpy(d, s, 16); }
inline void cp_async16(void* d, const void* s) { std::memcpy(d, s, 16); }
inline void cp_async8(void* d, const void* s) { std::memcpy(d, s, 8); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
inline uint4 lds16(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint2 lds8(const void* p) { uint2 v; std::memcpy(&v, p, 8); return v; }
inline std::vector<unsigned char> g_emu_dyn_smem;  // one block's dynamic shared memory
#define DDT_DYN_SMEM(name) unsigned char* name = ::ddtree_moe::g_emu_dyn_smem.data()
inline uint4 ld_stream16(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint2 ld_stream8(const void* p) { uint2 v; std::memcpy(&v, p, 8); return v; }
inline uint4 ld_act16(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline float4 ld_partial(const float* p) { float4 v; std::memcpy(&v, p, 16); return v; }
inline void st16(void* p, float4 v) { std::memcpy(p, &v, 16); }
inline void st8(void* p, uint32_t lo, uint32_t hi) {
  const uint32_t v[2] = {lo, hi};
  std::memcpy(p, v, 8);
}

}  // namespace ddtree_moe

// A 2-D grid, blocks one after another, one std::thread per CUDA thread.
// Dynamic shared memory starts filled with 0xAB in every block (stale data must not matter).
template <typename Kernel, typename Params>
inline void emu_launch2(Kernel kernel, unsigned gx, unsigned gy, int threads, size_t smem,
                        const Params& p) {
  const int nw = threads / 32;
  gridDim.x = gx;
  gridDim.y = gy;
  ddtree_moe::g_emu_mma_buf.assign(threads, {});
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      ddtree_moe::g_emu_dyn_smem.assign(smem, 0xAB);
      blockIdx.x = bx;
      blockIdx.y = by;
      blockDim.x = threads;
      g_emu_block_bar = std::make_unique<std::barrier<EmuBarrierDone>>(threads);
      g_emu_warp_bar.clear();
      g_emu_warp_buf.assign(nw, std::vector<uint64_t>(32));
      for (int w = 0; w < nw; ++w) g_emu_warp_bar.push_back(std::make_unique<std::barrier<>>(32));
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { threadIdx.x = t; kernel(p); });
      for (auto& th : ts) th.join();
    }
}
