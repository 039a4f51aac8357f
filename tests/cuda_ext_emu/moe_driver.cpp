// Runs the small-M MoE gate-up and down kernels (cuda_ext/moe_w4a16_small.cuh) under
// moe_emu.h. Usage: moe_driver IN OUT
// IN : int64 header [M, K, I, E, topk, NT, S_gate_up, S_down, gate-up CTAs, down CTAs,
//      x_stride, max_padded, launches]; then bf16 x [M * x_stride]; int32 w13 [E, K/8, 2I];
//      bf16 s13 [E, K/32, 2I]; int32 w2 [E, I/8, K]; bf16 s2 [E, I/32, K]; int32 sorted_ids
//      [max_padded]; int32 block_expert [max_padded / BM + 1]; fp32 topk_w [M * topk]
// OUT: bf16 h [max_padded, I] (unwritten: 0); bf16 y [M * topk, K] (unwritten: 0xFFFF, a NaN);
//      int32 counters after the launches (all 0 expected).
// `launches` > 1 runs the pair that many times on the same counters (re-arming check).
// Kernels built here: gate-up stages 4 / 6 and down stages 4 / 8 (n-tiles 1 and 2).
#include "moe_emu.h"

#include "moe_w4a16_small.cuh"

#include <cstdio>
#include <cstdlib>

template <typename T>
static std::vector<T> take(FILE* f, size_t n) {
  std::vector<T> v(n);
  if (n && fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "short input\n"); exit(2); }
  return v;
}

template <int NT>
static void run(const ddtree_moe::GateUpParams& gp, const ddtree_moe::DownParams& dp, int sgu,
                int sdn, unsigned gx, unsigned gy, unsigned dx, unsigned dy) {
  using namespace ddtree_moe;
  if (sgu == 4) emu_launch2(gate_up_kernel<NT, 4>, gx, gy, kThreads, gate_up_smem<NT, 4>(), gp);
  else if (sgu == 6) emu_launch2(gate_up_kernel<NT, 6>, gx, gy, kThreads, gate_up_smem<NT, 6>(), gp);
  else { fprintf(stderr, "S_gate_up %d not built\n", sgu); exit(2); }
  if (sdn == 4) emu_launch2(down_kernel<NT, 4>, dx, dy, kThreads, down_smem<NT, 4>(), dp);
  else if (sdn == 8) emu_launch2(down_kernel<NT, 8>, dx, dy, kThreads, down_smem<NT, 8>(), dp);
  else { fprintf(stderr, "S_down %d not built\n", sdn); exit(2); }
}

int main(int argc, char** argv) {
  if (argc != 3) { fprintf(stderr, "usage: moe_driver IN OUT\n"); return 2; }
  FILE* f = fopen(argv[1], "rb");
  if (!f) return 2;
  const auto hd = take<int64_t>(f, 13);
  const int M = hd[0], K = hd[1], I = hd[2], E = hd[3], topk = hd[4], NT = hd[5], sgu = hd[6],
            sdn = hd[7], gu_ctas = hd[8], dn_ctas = hd[9], max_padded = hd[11],
            launches = hd[12];
  const long long x_stride = hd[10];
  const int T = M * topk, BM = 8 * NT, max_blocks = max_padded / BM;
  auto x = take<uint16_t>(f, size_t(M) * x_stride);
  auto w13 = take<int32_t>(f, size_t(E) * K / 8 * 2 * I);
  auto s13 = take<uint16_t>(f, size_t(E) * K / 32 * 2 * I);
  auto w2 = take<int32_t>(f, size_t(E) * I / 8 * K);
  auto s2 = take<uint16_t>(f, size_t(E) * I / 32 * K);
  auto sorted = take<int32_t>(f, max_padded);
  auto bexp = take<int32_t>(f, max_blocks + 1);
  auto tw = take<float>(f, T);
  fclose(f);

  const unsigned gy = (I + 255) / 256, dy = (K + 255) / 256;
  std::vector<uint16_t> h(size_t(max_padded) * I, 0), y(size_t(T) * K, 0xFFFF);
  std::vector<float> part(size_t(2) * gu_ctas * BM * 2 * I, NAN);
  std::vector<int> counters(size_t(max_blocks) * gy, 0);
  ddtree_moe::GateUpParams gp{x.data(), w13.data(), s13.data(), sorted.data(), bexp.data(),
                              part.data(), counters.data(), h.data(), x_stride, max_blocks, T,
                              topk, K, I};
  ddtree_moe::DownParams dp{h.data(), w2.data(), s2.data(), sorted.data(), bexp.data(),
                            tw.data(), y.data(), max_blocks, T, K, I, 0};
  for (int l = 0; l < launches; ++l) {
    if (NT == 1) run<1>(gp, dp, sgu, sdn, gu_ctas, gy, dn_ctas, dy);
    else if (NT == 2) run<2>(gp, dp, sgu, sdn, gu_ctas, gy, dn_ctas, dy);
    else { fprintf(stderr, "NT %d not built\n", NT); return 2; }
  }
  FILE* o = fopen(argv[2], "wb");
  fwrite(h.data(), 2, h.size(), o);
  fwrite(y.data(), 2, y.size(), o);
  fwrite(counters.data(), 4, counters.size(), o);
  fclose(o);
  return 0;
}
