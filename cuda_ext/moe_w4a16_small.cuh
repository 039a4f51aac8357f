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
  float* part;                   // [split_max, part_rows, 2 I] fp32 (split > 1)
  int* counters;                 // [max_blocks * gridDim.y], zero between launches
  uint16_t* h;                   // [max_padded, I] bf16 out
  long long x_stride;
  int max_blocks, T, topk, K, I, part_rows, split_max, split_target;
};

struct DownParams {
  const uint16_t* h;             // [max_padded, I] bf16
  const int32_t* w;              // [E, I / 8, N] int32
  const uint16_t* s;             // [E, I / 32, N] bf16
  const int32_t* sorted_ids;     // [max_padded]
  const int32_t* block_expert;   // [max_blocks + 1]
  const void* topk_w;            // [T] fp32, or bf16 with topk_bf16
  uint16_t* y;                   // [T, N] bf16 out, row = pair id
  int T, N, I, topk_bf16;
};

// The split of this call: smallest divisor c < split_max of the K groups with
// used_blocks * col_ctas * c >= split_target, else split_max (host mirror: live_split_small).
DDT_DEV int live_split(int used, int col_ctas, int groups, int split_max, int target) {
  for (int c = 1; c < split_max; ++c)
    if (groups % c == 0 && used * col_ctas * c >= target) return c;
  return split_max;
}

template <int NT, int U>
DDT_GLOBAL void __launch_bounds__(kThreads, 2) gate_up_kernel(const GateUpParams p) {
  constexpr int BM = 8 * NT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int used = p.block_expert[p.max_blocks];
  const int groups = p.K >> 5;
  const int col_ctas = gridDim.y;
  const int split = live_split(used, col_ctas, groups, p.split_max, p.split_target);
  const int blk = blockIdx.x / split, ks = blockIdx.x % split;
  if (blk >= used) return;  // CTA-uniform: this call needs fewer CTAs than the grid has
  const int e = p.block_expert[blk];
  const int row0 = blk * BM;
  const int chunk = blockIdx.y * kWarps + warp;
  const bool active = chunk * 32 < p.I;  // warp-uniform
  const int col = chunk * 32 + 4 * gid;
  const int n2 = 2 * p.I;
  const int per = groups / split, g0 = ks * per;
  // the block's real rows precede its padding: row 8 real <=> the second n-tile has work
  const bool second = NT > 1 && p.sorted_ids[row0 + 8] < p.T;
  float accg[2][NT][4], accu[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) accg[mt][nt][i] = accu[mt][nt][i] = 0.0f;

  if (active) {
    const uint16_t* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int pair = p.sorted_ids[row0 + 8 * nt + gid];
      const int tok = pair < p.T ? pair / p.topk : 0;  // padding rows read row 0, never stored
      xr[nt] = p.x + (long long)tok * p.x_stride + 32LL * g0 + 8 * tig;
    }
    const int32_t* wp = p.w + ((long long)e * (p.K >> 3) + 4LL * g0 + tig) * n2 + col;
    const uint16_t* sp = p.s + ((long long)e * groups + g0) * n2 + col;
    uint4 wg[U], wu[U], xv[U][NT];
    uint2 sg[U], su[U];
    auto load = [&](int u, int g) {
      const int32_t* w = wp + (long long)g * 4 * n2;
      const uint16_t* s = sp + (long long)g * n2;
      wg[u] = ld_stream16(w);
      wu[u] = ld_stream16(w + p.I);
      sg[u] = ld_stream8(s);
      su[u] = ld_stream8(s + p.I);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt == 0 || second) xv[u][nt] = ld_act16(xr[nt] + 32 * g);
    };
    auto compute = [&](int u) {
      uint32_t b[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt == 0 || second) act_pairs(xv[u][nt], b[nt]);
      group_mma<NT>(wg[u], sg[u], b, accg, second);
      group_mma<NT>(wu[u], su[u], b, accu, second);
    };
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u < per) load(u, u);
    for (int base = 0; base < per; base += U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (base + u < per) {
          compute(u);
          if (base + u + U < per) load(u, base + u + U);
        }
      }
    }
  }

  if (split == 1) {
    if (!active) return;
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
    return;
  }

  // Split K: partials of the real rows, then the tile's last CTA sums them in split order.
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt > 0 && !second) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * nt + 2 * tig + i;
        if (p.sorted_ids[r] >= p.T) continue;
        float* q = p.part + ((long long)ks * p.part_rows + r) * n2 + col;
        st16(q, make_float4(accg[0][nt][i], accg[0][nt][2 + i], accg[1][nt][i], accg[1][nt][2 + i]));
        st16(q + p.I,
             make_float4(accu[0][nt][i], accu[0][nt][2 + i], accu[1][nt][i], accu[1][nt][2 + i]));
      }
    }
  }
  __threadfence();  // this thread's partials before the CTA's arrival
  __syncthreads();
  DDT_SHARED int is_last;
  const int tile = blk * col_ctas + blockIdx.y;
  if (threadIdx.x == 0) is_last = atomicAdd(p.counters + tile, 1) == split - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // the other CTAs' partials (arrived before their counter increments)
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt > 0 && !second) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * nt + 2 * tig + i;
        if (p.sorted_ids[r] >= p.T) continue;
        float g[4] = {0.0f, 0.0f, 0.0f, 0.0f}, u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = 0; k < split; ++k) {
          const float* q = p.part + ((long long)k * p.part_rows + r) * n2 + col;
          const float4 a = ld_partial(q), c = ld_partial(q + p.I);
          g[0] += a.x; g[1] += a.y; g[2] += a.z; g[3] += a.w;
          u[0] += c.x; u[1] += c.y; u[2] += c.z; u[3] += c.w;
        }
        store_h(p.h + (long long)r * p.I + col, g, u);
      }
    }
  }
  if (threadIdx.x == 0) p.counters[tile] = 0;  // re-armed for the next launch
}

template <int NT, int U>
DDT_GLOBAL void __launch_bounds__(kThreads) down_kernel(const DownParams p) {
  constexpr int BM = 8 * NT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int blk = blockIdx.x;
  if (p.block_expert[blk] < 0) return;  // unused block (CTA-uniform)
  const int chunk = blockIdx.y * kWarps + warp;
  if (chunk * 32 >= p.N) return;  // warp-uniform; no block barrier below
  const int e = p.block_expert[blk];
  const int row0 = blk * BM;
  const int col = chunk * 32 + 4 * gid;
  const int groups = p.I >> 5;
  const bool second = NT > 1 && p.sorted_ids[row0 + 8] < p.T;
  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
  const uint16_t* hr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    hr[nt] = p.h + (long long)(row0 + 8 * nt + gid) * p.I + 8 * tig;
  const int32_t* wp = p.w + ((long long)e * (p.I >> 3) + tig) * p.N + col;
  const uint16_t* sp = p.s + (long long)e * groups * p.N + col;
  uint4 wv[U], hv[U][NT];
  uint2 sv[U];
  auto load = [&](int u, int g) {
    wv[u] = ld_stream16(wp + (long long)g * 4 * p.N);
    sv[u] = ld_stream8(sp + (long long)g * p.N);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      if (nt == 0 || second) hv[u][nt] = ld_act16(hr[nt] + 32 * g);
  };
  auto compute = [&](int u) {
    uint32_t b[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      if (nt == 0 || second) act_pairs(hv[u][nt], b[nt]);
    group_mma<NT>(wv[u], sv[u], b, acc, second);
  };
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < groups) load(u, u);
  for (int base = 0; base < groups; base += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u < groups) {
        compute(u);
        if (base + u + U < groups) load(u, base + u + U);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt > 0 && !second) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int pair = p.sorted_ids[row0 + 8 * nt + 2 * tig + i];
      if (pair >= p.T) continue;
      const float wt = p.topk_bf16 ? bf16_to_float(static_cast<const uint16_t*>(p.topk_w)[pair])
                                   : static_cast<const float*>(p.topk_w)[pair];
      st8(p.y + (long long)pair * p.N + col,
          pack_bf16x2(acc[0][nt][i] * wt, acc[0][nt][2 + i] * wt),
          pack_bf16x2(acc[1][nt][i] * wt, acc[1][nt][2 + i] * wt));
    }
  }
}

}  // namespace ddtree_moe
