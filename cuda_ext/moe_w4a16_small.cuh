// Small-M fused W4A16 MoE GEMMs (int4 group-32 symmetric experts, bf16 activations) on
// mma.sync tensor cores: the gate-up (SiLU(x G) * (x U) -> h) and the down (h D * topk weight ->
// y) of sglang_ddtree.triton_kernels.moe_w4a16, for calls of up to ~16 tokens, where the Triton
// kernels read DRAM at about half its copy bandwidth (few programs in flight, see
// bench_results/ncu_fused_moe_summary_h200_s36.json). Included by moe_w4a16_small.cu (nvcc) and,
// with DDTREE_EMU defined, by tests/cuda_ext_emu/moe_driver.cpp (host emulation in CI).
//
// Inputs are the layouts SGLang 0.5.17 loads (no repack) and the prologue of moe_w4a16
// (moe_align) writes: w [E, K / 8, N] int32 (nibble j of row r = q[8 r + j] + 8),
// s [E, K / 32, N] bf16, sorted_ids [max_padded] (pair ids grouped by expert in blocks of BM
// rows, padding = T), block_expert [max_blocks + 1] (expert per block, the used-block count last).
//
// Work split. A warp owns 32 output columns; lane (gid = lane / 4, tig = lane % 4) loads, per
// 32-row K group, 16 bytes of packed row 4 * group + tig at columns col .. col + 3 (col = 32 *
// chunk + 4 * gid): 4 columns x 8 K rows. Those words feed the MMA's A operand directly (swap
// AB: weights are the 16-row M side, the block's tokens the 8-column N side):
//   * columns: m-tile mt takes the lane's columns col + 2 mt (A row gid) and col + 2 mt + 1
//     (A row gid + 8), so the C fragment gives each lane its own 4 columns for tokens 2 tig and
//     2 tig + 1 of each 8-token n-tile;
//   * K: the MMA's k order is free as long as A and B agree. The lane's word w holds K rows
//     8 tig + j; dequantizing (w >> 4 j) & 0x000F000F gives the bf16 pair (nibble j, nibble
//     j + 4), so k-step 0 takes pairs j = 0 (k 2 tig, 2 tig + 1) and j = 1 (k 2 tig + 8, + 9), and
//     k-step 1 pairs j = 2 and j = 3; the B lane (same tig) loads x[token][8 tig .. 8 tig + 7]
//     and permutes it to the same pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7) with prmt.
// Dequantization is the Triton kernels' (bf16 0x4300 | n = 128 + n, minus 136, times the scale:
// one rounding of q * s), fp32 accumulation; h and y are rounded to bf16 once. So the result
// differs from the Triton path only in the fp32 summation order.
//
// Gate-up: CTA = 8 warps = 256 columns of gate and the same of up (a lane's gate and up values
// meet in its registers for the epilogue), one block of BM rows, one K range of a split chosen
// per call on the GPU from the used-block count (the smallest divisor of the K groups, at most
// split_max, that gives split_target CTAs; no host sync). With a split > 1 each CTA stores fp32
// partials of its real rows; the tile's last CTA to arrive sums them in split order
// (deterministic, independent of arrival order), runs the epilogue and re-arms the tile's
// counter. Down: CTA = 8 warps = 256 output columns of one block, the whole K (the
// intermediate size) per warp. Loads are software-pipelined U groups deep through registers.
#pragma once

#include <stdint.h>

namespace ddtree_moe {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

#ifndef DDTREE_EMU
#define DDT_DEV __device__ __forceinline__

// (a & b) | c
DDT_DEV uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
DDT_DEV uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
DDT_DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// (lo, hi) -> bf16x2, round to nearest even
DDT_DEV uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
DDT_DEV float bf16_to_float(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
DDT_DEV float fast_exp(float x) { return __expf(x); }
// D = A B + D, m16n8k16, bf16 inputs, fp32 accumulation
DDT_DEV void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                      uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Packed weights and scales are read once per call: stream them past L1.
DDT_DEV uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
DDT_DEV uint2 ld_stream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// Activations: every warp of a CTA reads the same rows (L1 keeps them).
DDT_DEV uint4 ld_act16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
// Split partials written by other CTAs: from L2, never a stale L1 line.
DDT_DEV float4 ld_partial(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
DDT_DEV void st16(void* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
// Asynchronous global -> shared copies (sm_80+): the lane that issues a copy is the only one
// that reads it back, so cp.async.wait_group alone orders them (no barrier).
DDT_DEV void cp_async16_stream(void* dst, const void* src) {  // past L1: read once
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"(uint32_t(__cvta_generic_to_shared(dst))), "l"(src) : "memory");
}
DDT_DEV void cp_async16(void* dst, const void* src) {  // through L1: rows every warp reads
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;"
               :: "r"(uint32_t(__cvta_generic_to_shared(dst))), "l"(src) : "memory");
}
DDT_DEV void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;"
               :: "r"(uint32_t(__cvta_generic_to_shared(dst))), "l"(src) : "memory");
}
DDT_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
DDT_DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
DDT_DEV uint4 lds16(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(uint32_t(__cvta_generic_to_shared(p))) : "memory");
  return v;
}
DDT_DEV uint2 lds8(const void* p) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y) : "r"(uint32_t(__cvta_generic_to_shared(p))) : "memory");
  return v;
}
#define DDT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
DDT_DEV void st8(void* p, uint32_t lo, uint32_t hi) {
  *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}
#define DDT_GLOBAL __global__
#define DDT_SHARED __shared__
#else
// tests/cuda_ext_emu/moe_emu.h defines DDT_DEV, DDT_GLOBAL, DDT_SHARED and the primitives above.
#endif

// 4 bf16 pairs (nibble j, nibble j + 4) * scale of one packed word; sc = (s, s).
DDT_DEV void dequant_word(uint32_t w, uint32_t sc, uint32_t (&q)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t t = lop3_and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u);  // 128 + n
    t = fma_bf16x2(t, 0x3F803F80u, 0xC308C308u);                       // n - 8 (exact)
    q[j] = fma_bf16x2(t, sc, 0x80008000u);                             // q * s, one rounding
  }
}

// x[8 tig .. 8 tig + 7] as 4 bf16x2 -> the B pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7).
DDT_DEV void act_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = prmt(v.x, v.z, 0x5410u);
  b[1] = prmt(v.x, v.z, 0x7632u);
  b[2] = prmt(v.y, v.w, 0x5410u);
  b[3] = prmt(v.y, v.w, 0x7632u);
}

// One 32-row K group of the lane's 4 columns (one 16-byte word load, 4 scales) into
// acc[m-tile][n-tile]; n-tile 1 only when the block has rows past its first 8 (`second`).
template <int NT>
DDT_DEV void group_mma(const uint4& wv, const uint2& sv, const uint32_t (&b)[NT][4],
                       float (&acc)[2][NT][4], bool second) {
  const uint32_t sc[4] = {prmt(sv.x, sv.x, 0x1010u), prmt(sv.x, sv.x, 0x3232u),
                          prmt(sv.y, sv.y, 0x1010u), prmt(sv.y, sv.y, 0x3232u)};
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t qa[4], qb[4];
    dequant_word(words[2 * mt], sc[2 * mt], qa);
    dequant_word(words[2 * mt + 1], sc[2 * mt + 1], qb);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt > 0 && !second) continue;
      mma_bf16(acc[mt][nt], qa[0], qb[0], qa[1], qb[1], b[nt][0], b[nt][1]);
      mma_bf16(acc[mt][nt], qa[2], qb[2], qa[3], qb[3], b[nt][2], b[nt][3]);
    }
  }
}

DDT_DEV float silu_mul(float g, float u) { return g / (1.0f + fast_exp(-g)) * u; }

// h[row, col .. col + 3] = bf16(silu(g) * u)
DDT_DEV void store_h(uint16_t* dst, const float (&g)[4], const float (&u)[4]) {
  st8(dst, pack_bf16x2(silu_mul(g[0], u[0]), silu_mul(g[1], u[1])),
      pack_bf16x2(silu_mul(g[2], u[2]), silu_mul(g[3], u[3])));
}

struct GateUpParams {
  const uint16_t* x;             // [M, K] bf16, row stride x_stride
  const int32_t* w;              // [E, K / 8, 2 I] int32 (gate columns [0, I), up [I, 2 I))
  const uint16_t* s;             // [E, K / 32, 2 I] bf16
  const int32_t* sorted_ids;     // [max_padded]
  const int32_t* block_expert;   // [max_blocks + 1]
  float* part;                   // [2 P, BM, 2 I] fp32 partial slabs (P = gridDim.x)
  int* counters;                 // [max_blocks * gridDim.y], zero between launches
  uint16_t* h;                   // [max_padded, I] bf16 out
  long long x_stride;
  int max_blocks, T, topk, K, I;
  int dbg;
};

struct DownParams {
  const uint16_t* h;             // [max_padded, I] bf16
  const int32_t* w;              // [E, I / 8, N] int32
  const uint16_t* s;             // [E, I / 32, N] bf16
  const int32_t* sorted_ids;     // [max_padded]
  const int32_t* block_expert;   // [max_blocks + 1]
  const void* topk_w;            // [T] fp32, or bf16 with topk_bf16
  uint16_t* y;                   // [T, N] bf16 out, row = pair id
  int max_blocks, T, N, I, topk_bf16;
  int dbg;
};

// Per-warp ring of S stages of packed weights and scales in dynamic shared memory; within a
// stage each field is lane-major (16-byte fields at 16-byte lane stride, 8-byte at 8:
// conflict-free ld.shared). Activations (x, h: a few rows every warp of the CTA reads) go
// through L1 into registers one step ahead instead: through the ring they missed L1 and
// doubled the L2 traffic (Nsight Compute, session 37).
struct GateUpStage {  // gate words, up words, gate scales, up scales
  static constexpr int kWg = 0, kWu = 512, kSg = 1024, kSu = 1280;
  static constexpr int kBytes = 1536;
};
struct DownStage {  // words, scales
  static constexpr int kW = 0, kS = 512;
  static constexpr int kBytes = 768;
};
template <int NT, int S>
constexpr int gate_up_smem() { return kWarps * S * GateUpStage::kBytes; }
template <int NT, int S>
constexpr int down_smem() { return kWarps * S * DownStage::kBytes; }

template <int NT>
DDT_DEV void zero_acc(float (&a)[2][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[mt][nt][i] = 0.0f;
}

// h rows of the lane (tokens 2 tig, 2 tig + 1 of each live n-tile) from finished sums.
template <int NT>
DDT_DEV void gate_up_epilogue(const GateUpParams& p, int row0, int col, int tig, bool second,
                              const float (&accg)[2][NT][4], const float (&accu)[2][NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt > 0 && !second) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + 8 * nt + 2 * tig + i;
      const float g[4] = {accg[0][nt][i], accg[0][nt][2 + i], accg[1][nt][i], accg[1][nt][2 + i]};
      const float u[4] = {accu[0][nt][i], accu[0][nt][2 + i], accu[1][nt][i], accu[1][nt][2 + i]};
      store_h(p.h + (long long)r * p.I + col, g, u);
    }
  }
}

// fp32 partials of the lane's real rows at slab (BM rows x 2 I columns per slab).
template <int NT>
DDT_DEV void store_partials(const GateUpParams& p, long long slab, int row0, int col, int tig,
                            bool second, const float (&accg)[2][NT][4],
                            const float (&accu)[2][NT][4]) {
  constexpr int BM = 8 * NT;
  const int n2 = 2 * p.I;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt > 0 && !second) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rr = 8 * nt + 2 * tig + i;
      if (p.sorted_ids[row0 + rr] >= p.T) continue;
      float* q = p.part + (slab * BM + rr) * n2 + col;
      st16(q, make_float4(accg[0][nt][i], accg[0][nt][2 + i], accg[1][nt][i], accg[1][nt][2 + i]));
      st16(q + p.I,
           make_float4(accu[0][nt][i], accu[0][nt][2 + i], accu[1][nt][i], accu[1][nt][2 + i]));
    }
  }
}

// h of the lane's real rows from partial slabs slab_of(0 .. count - 1), summed in that order.
template <int NT, typename SlabOf>
DDT_DEV void sum_partials(const GateUpParams& p, int count, SlabOf slab_of, int row0, int col,
                          int tig, bool second) {
  constexpr int BM = 8 * NT;
  const int n2 = 2 * p.I;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt > 0 && !second) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rr = 8 * nt + 2 * tig + i;
      if (p.sorted_ids[row0 + rr] >= p.T) continue;
      float g[4] = {0.0f, 0.0f, 0.0f, 0.0f}, u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int k = 0; k < count; ++k) {
        const float* q = p.part + ((long long)slab_of(k) * BM + rr) * n2 + col;
        const float4 a = ld_partial(q), c = ld_partial(q + p.I);
        g[0] += a.x; g[1] += a.y; g[2] += a.z; g[3] += a.w;
        u[0] += c.x; u[1] += c.y; u[2] += c.z; u[3] += c.w;
      }
      store_h(p.h + (long long)(row0 + rr) * p.I + col, g, u);
    }
  }
}

// The CTA's arrival at a split tile; true for the last of `count` (after a block barrier).
DDT_DEV bool arrive_last(int* counter, int count) {
  __threadfence();  // this thread's partials before the CTA's arrival
  __syncthreads();
  DDT_SHARED int is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == count - 1;
  __syncthreads();
  const bool last = is_last;
  if (last) __threadfence();  // the other CTAs' partials (stored before their arrivals)
  __syncthreads();  // every thread has read is_last before a later arrival rewrites it
  return last;
}

// Gate-up, stream-K: a grid of P CTAs (one wave) over the call's used_blocks x (K / 32) group
// steps in equal contiguous ranges of L = ceil(work / P) steps, so no CTA waits for a second
// wave and one grid serves calls on 8 experts and on hundreds. Each warp streams its range
// through an S-stage cp.async ring (the next block's first groups load while this block's last
// ones compute). A tile (block) whose range one CTA covers whole is finished by it; a tile
// split between CTAs c0 .. c1 (at most two partial tiles per CTA: its first and its last) gets
// their fp32 partials in slabs 2 c + (0 for the CTA's first tile, 1 for its last), and the last
// to arrive sums them in CTA order (deterministic) and re-arms the tile's counter.
// Grid (P, ceil(I / 256)); dynamic shared memory gate_up_smem<NT, S>().
template <int NT, int S>
DDT_GLOBAL void __launch_bounds__(kThreads) gate_up_kernel(const GateUpParams p) {
  using St = GateUpStage;
  constexpr int BM = 8 * NT;
  DDT_DYN_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int used = p.block_expert[p.max_blocks];
  const int G = p.K >> 5;
  const int P = gridDim.x;
  const long long work = (long long)used * G;
  const long long L = (work + P - 1) / P;
  const long long start = (long long)blockIdx.x * L;
  const long long end = start + L < work ? start + L : work;
  if (start >= end) return;  // CTA-uniform
  const int chunk = blockIdx.y * kWarps + warp;
  const bool active = chunk * 32 < p.I;  // warp-uniform
  const int col = chunk * 32 + 4 * gid;
  const int n2 = 2 * p.I;
  unsigned char* ring = smem + warp * S * St::kBytes;
  const int first_blk = int(start / G);

  // issue side: the next group step to copy into the ring (incremental: no division per step)
  const int total = int(end - start);
  int issued = 0, iblk = first_blk, ig = int(start - (long long)first_blk * G);
  const int32_t* wp = nullptr;
  const uint16_t* sp = nullptr;
  auto setup = [&]() {  // block iblk's expert, at group ig
    const int e = p.block_expert[iblk];
    wp = p.w + ((long long)e * (p.K >> 3) + 4LL * ig + tig) * n2 + col;
    sp = p.s + ((long long)e * G + ig) * n2 + col;
  };
  if (active) setup();
  auto issue = [&](int stage) {
    if (issued < total && active) {
      unsigned char* st = ring + stage * St::kBytes;
      cp_async16_stream(st + St::kWg + 16 * lane, wp);
      cp_async16_stream(st + St::kWu + 16 * lane, wp + p.I);
      cp_async8(st + St::kSg + 8 * lane, sp);
      cp_async8(st + St::kSu + 8 * lane, sp + p.I);
      wp += 4 * n2;
      sp += n2;
      if (++ig == G && issued + 1 < total) {
        ++iblk;
        ig = 0;
        setup();
      }
    }
    ++issued;
    cp_async_commit();  // one group per step, empty or not: wait_group counts stay uniform
  };
#pragma unroll
  for (int k = 0; k < S - 1; ++k) issue(k);

  // x of the block's tokens, one step ahead of compute (through L1); the next block's pair ids
  // are loaded when a block starts
  auto x_row = [&](int pair) {  // padding rows read token 0, never stored
    return p.x + (long long)(pair < p.T ? pair / p.topk : 0) * p.x_stride + 8 * tig;
  };
  const uint16_t* xbase[NT];
  int npair[NT];
  uint4 xcur[NT], xnext[NT];
  {
    const int g0 = int(start - (long long)first_blk * G);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      xbase[nt] = x_row(p.sorted_ids[first_blk * BM + 8 * nt + gid]);
      npair[nt] = first_blk + 1 < used ? p.sorted_ids[(first_blk + 1) * BM + 8 * nt + gid] : p.T;
      if (active) xcur[nt] = ld_act16(xbase[nt] + 32 * g0);
    }
  }

  // compute side
  float accg[2][NT][4], accu[2][NT][4];
  zero_acc<NT>(accg);
  zero_acc<NT>(accu);
  int cblk = first_blk, cg = int(start - (long long)first_blk * G), seg0 = cg;
  bool second = NT > 1 && p.sorted_ids[cblk * BM + 8] < p.T;
  int stage = 0;
  for (long long cpos = start; cpos < end; ++cpos) {
    const bool last_group = cg + 1 == G;
    if (active && cpos + 1 < end) {  // the next step's x
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        xnext[nt] = ld_act16(p.dbg ? xbase[nt] : last_group ? x_row(npair[nt]) : xbase[nt] + 32 * (cg + 1));
    }
    cp_async_wait<S - 2>();  // this lane's copies of step cpos have landed
    if (active) {
      const unsigned char* st = ring + stage * St::kBytes;
      const uint4 wg = lds16(st + St::kWg + 16 * lane), wu = lds16(st + St::kWu + 16 * lane);
      const uint2 sg = lds8(st + St::kSg + 8 * lane), su = lds8(st + St::kSu + 8 * lane);
      uint32_t b[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) act_pairs(xcur[nt], b[nt]);
      group_mma<NT>(wg, sg, b, accg, second);
      group_mma<NT>(wu, su, b, accu, second);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xcur[nt] = xnext[nt];
    issue(stage == 0 ? S - 1 : stage - 1);  // refill the stage consumed one step ago
    stage = stage + 1 == S ? 0 : stage + 1;
    ++cg;
    if (cg == G || cpos + 1 == end) {  // the end of this CTA's segment of block cblk
      const int row0 = cblk * BM;
      if (seg0 == 0 && cg == G) {
        if (active) gate_up_epilogue<NT>(p, row0, col, tig, second, accg, accu);
      } else {
        const int slot = cblk == first_blk ? 0 : 1;
        if (active)
          store_partials<NT>(p, 2LL * blockIdx.x + slot, row0, col, tig, second, accg, accu);
        const long long tile_end = (long long)(cblk + 1) * G;
        const int c0 = int((long long)cblk * G / L);
        const int c1 = int((tile_end - 1) / L);
        const int tile = cblk * gridDim.y + blockIdx.y;
        if (arrive_last(p.counters + tile, c1 - c0 + 1)) {
          const int blk = cblk;
          if (active)
            sum_partials<NT>(p, c1 - c0 + 1, [&](int k) {
              const long long c = c0 + k;  // CTA c's slab: its first tile or its last
              return 2 * c + ((c * L) / G == blk ? 0 : 1);
            }, row0, col, tig, second);
          if (threadIdx.x == 0) p.counters[tile] = 0;
        }
      }
      zero_acc<NT>(accg);
      zero_acc<NT>(accu);
      ++cblk;
      cg = seg0 = 0;
      if (cpos + 1 < end) {
        second = NT > 1 && p.sorted_ids[cblk * BM + 8] < p.T;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          xbase[nt] = x_row(npair[nt]);
          npair[nt] = cblk + 1 < used ? p.sorted_ids[(cblk + 1) * BM + 8 * nt + gid] : p.T;
        }
      }
    }
  }
  cp_async_wait<0>();
}

// Down: grid (R, ceil(N / 256)); CTA (r, y) takes blocks r, r + R, ... of the call's used ones
// for its 256 output columns, its warps streaming every K group of those blocks through one
// S-stage cp.async ring; y[pair, cols] = bf16(h[row] D_e * topk_weight[pair]).
// Dynamic shared memory down_smem<NT, S>().
template <int NT, int S>
DDT_GLOBAL void __launch_bounds__(kThreads) down_kernel(const DownParams p) {
  using St = DownStage;
  constexpr int BM = 8 * NT;
  DDT_DYN_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int used = p.block_expert[p.max_blocks];
  const int R = gridDim.x, r = blockIdx.x;
  const int nblk = used > r ? (used - r + R - 1) / R : 0;
  const int chunk = blockIdx.y * kWarps + warp;
  if (nblk == 0 || chunk * 32 >= p.N) return;  // no block barrier in this kernel
  const int col = chunk * 32 + 4 * gid;
  const int G = p.I >> 5;
  const int n = nblk * G;
  unsigned char* ring = smem + warp * S * St::kBytes;

  // issue side, incremental; the next block's expert is loaded one block ahead
  int issued = 0, ig = 0, ij = 0;
  int e_next = p.block_expert[r];
  const int32_t* wp = nullptr;
  const uint16_t* sp = nullptr;
  auto setup = [&]() {  // block r + ij R
    const int blk = r + ij * R;
    const int e = e_next;
    if (ij + 1 < nblk) e_next = p.block_expert[blk + R];
    wp = p.w + ((long long)e * (p.I >> 3) + tig) * p.N + col;
    sp = p.s + (long long)e * G * p.N + col;
  };
  setup();
  auto issue = [&](int stage) {
    if (issued < n) {
      unsigned char* st = ring + stage * St::kBytes;
      cp_async16_stream(st + St::kW + 16 * lane, wp);
      cp_async8(st + St::kS + 8 * lane, sp);
      wp += 4 * p.N;
      sp += p.N;
      if (++ig == G && issued + 1 < n) {
        ++ij;
        ig = 0;
        setup();
      }
    }
    ++issued;
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < S - 1; ++k) issue(k);

  // h rows of the block (by padded row: no indirection), one step ahead of compute, via L1
  auto h_row = [&](int jj, int nt) {
    return p.h + (long long)((r + jj * R) * BM + 8 * nt + gid) * p.I + 8 * tig;
  };
  uint4 hcur[NT], hnext[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) hcur[nt] = ld_act16(h_row(0, nt));

  float acc[2][NT][4];
  zero_acc<NT>(acc);
  int stage = 0, g = 0, j = 0;
  bool second = NT > 1 && p.sorted_ids[r * BM + 8] < p.T;
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        hnext[nt] = ld_act16(p.dbg ? h_row(0, nt) : g + 1 < G ? h_row(j, nt) + 32 * (g + 1) : h_row(j + 1, nt));
    }
    cp_async_wait<S - 2>();
    const unsigned char* st = ring + stage * St::kBytes;
    const uint4 wv = lds16(st + St::kW + 16 * lane);
    const uint2 sv = lds8(st + St::kS + 8 * lane);
    uint32_t b[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) act_pairs(hcur[nt], b[nt]);
    group_mma<NT>(wv, sv, b, acc, second);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) hcur[nt] = hnext[nt];
    issue(stage == 0 ? S - 1 : stage - 1);
    stage = stage + 1 == S ? 0 : stage + 1;
    if (++g == G) {  // block done: y rows of its real pairs
      const int row0 = (r + j * R) * BM;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt > 0 && !second) continue;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int pair = p.sorted_ids[row0 + 8 * nt + 2 * tig + q];
          if (pair >= p.T) continue;
          const float wt = p.topk_bf16
                               ? bf16_to_float(static_cast<const uint16_t*>(p.topk_w)[pair])
                               : static_cast<const float*>(p.topk_w)[pair];
          st8(p.y + (long long)pair * p.N + col,
              pack_bf16x2(acc[0][nt][q] * wt, acc[0][nt][2 + q] * wt),
              pack_bf16x2(acc[1][nt][q] * wt, acc[1][nt][2 + q] * wt));
        }
      }
      zero_acc<NT>(acc);
      g = 0;
      ++j;
      if (j < nblk) second = NT > 1 && p.sorted_ids[(r + j * R) * BM + 8] < p.T;
    }
  }
  cp_async_wait<0>();
}

}  // namespace ddtree_moe
