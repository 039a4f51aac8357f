// Runs the tree-build kernel the launcher would pick (ddtree::tree_build_kernel, the level-wise
// one, or ddtree::tree_build_frontier_kernel) under cuda_emu.h. Usage: emu_driver IN OUT
// IN : int64 header [bs, D, K, B, threads (0: the launcher's choice), fill, algo (ddtree::TreeAlgo)]; float32 logp[bs*D*K]; int64 ids[bs*D*K];
//      int64 root[bs]; int64 seq_lens[bs]
// OUT: tokens, parents, depths (int64 [bs*N]); valid (u8); scores (f32); ancestor_mask (u8
//      [bs*N*N]); retrive_index, next_token, next_sibling, positions (int64 [bs*N]); then the
//      FULL_MASK buffer (u8) with 16 guard bytes (value 2) on each side.
// stderr: the block barriers each block passed, its shared-memory atomics and their busiest-address
//         depth (means over blocks).
// Shared memory is filled with `fill` before every launch so that reads of unwritten shared
// memory change the result between runs with different fills.
#include "cuda_emu.h"

#include <cstdio>
#include <cstdlib>

namespace ddtree {
alignas(16) unsigned char smem[240 * 1024];
}
#include "tree_build_kernel.cuh"

template <typename T>
static std::vector<T> read_vec(FILE* f, size_t n) {
  std::vector<T> v(n);
  if (n && fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "short input\n"); exit(2); }
  return v;
}

template <typename T>
static void write_vec(FILE* f, const std::vector<T>& v) { fwrite(v.data(), sizeof(T), v.size(), f); }

int main(int argc, char** argv) {
  if (argc != 3) { fprintf(stderr, "usage: emu_driver IN OUT\n"); return 2; }
  FILE* f = fopen(argv[1], "rb");
  const std::vector<int64_t> h = read_vec<int64_t>(f, 7);
  const int bs = int(h[0]), D = int(h[1]), K = int(h[2]), B = int(h[3]);
  // 0: the launcher's choice (ddtree::default_threads_for, as tree_build.cpp)
  const int T = h[4] > 0 ? int(h[4])
                         : ddtree::default_threads_for(int(h[6]), B, std::min(K, B), std::min(D, B));
  const int N = B + 1;
  const size_t nl = size_t(bs) * D * K, nn = size_t(bs) * N;
  const auto logp = read_vec<float>(f, nl);
  const auto ids = read_vec<int64_t>(f, nl);
  const auto root = read_vec<int64_t>(f, bs);
  const auto seq = read_vec<int64_t>(f, bs);
  fclose(f);
  int64_t full_len = 0;
  for (int i = 0; i < bs; ++i) full_len += int64_t(N) * (seq[i] + N);
  std::vector<int64_t> tokens(nn, 77), parents(nn, 77), depths(nn, 77), ri(nn, 77), nt(nn, 77),
      ns(nn, 77), pos(nn, 77);
  std::vector<float> scores(nn, NAN);
  std::vector<unsigned char> valid(nn, 2), anc(nn * N, 2), full(full_len + 32, 2);
  ddtree::TreeBuildParams p{};
  p.logp = logp.data(); p.logp_sb = int64_t(D) * K; p.logp_sd = K;
  p.ids = ids.data(); p.ids_sb = int64_t(D) * K; p.ids_sd = K;
  p.root_ids = root.data();
  p.D = std::min(D, B); p.Kp = std::min(K, B); p.B = B;  // as the launcher in tree_build.cpp
  p.tokens = tokens.data(); p.parents = parents.data(); p.depths = depths.data();
  p.valid = reinterpret_cast<bool*>(valid.data()); p.scores = scores.data();
  p.ancestor_mask = reinterpret_cast<bool*>(anc.data());
  p.retrive_index = ri.data(); p.retrive_next_token = nt.data(); p.retrive_next_sibling = ns.data();
  p.seq_lens = seq.data(); p.positions = pos.data();
  p.full_mask = reinterpret_cast<bool*>(full.data() + 16);
  const int algo = int(h[6]);
  // the device's shared memory per block as the launcher sees it: this emulation's buffer, or
  // DDTREE_EMU_SMEM_LIMIT (a test of the smaller G capacity of ddtree::defer_cap)
  const char* lim_env = getenv("DDTREE_EMU_SMEM_LIMIT");
  const int64_t smem_limit = lim_env ? atoll(lim_env) : int64_t(sizeof(ddtree::smem));
  p.gcap = ddtree::tree_build_gcap(algo, B, p.Kp, p.D, smem_limit);
  fprintf(stderr, "gcap: %d\n", p.gcap);
  const int64_t smem_total = ddtree::tree_build_smem(algo, B, p.Kp, p.D, smem_limit);
  if (smem_total > int64_t(sizeof(ddtree::smem))) { fprintf(stderr, "smem %lld\n", (long long)smem_total); return 2; }
  std::memset(ddtree::smem, int(h[5]), sizeof(ddtree::smem));
  const int kernel = ddtree::tree_kernel_index(algo, B, p.Kp, p.D);
  // the launcher's block size for that kernel (its launch bound)
  emu_launch(ddtree::tree_kernel_fn(kernel), bs, ddtree::tree_kernel_threads(kernel, T), p);
  fprintf(stderr, "kernel: %s\n", ddtree::tree_kernel_name(kernel));
  fprintf(stderr, "block barriers per block: %.2f (threads %d), most in one block: %ld\n",
          double(g_emu_block_syncs) / bs, T, g_emu_block_syncs_max);
  fprintf(stderr, "shared atomics per block: %.1f, busiest-address depth per block: %.1f\n",
          double(g_emu_atomics) / bs, double(g_emu_atomic_depth) / bs);
  FILE* o = fopen(argv[2], "wb");
  write_vec(o, tokens); write_vec(o, parents); write_vec(o, depths); write_vec(o, valid);
  write_vec(o, scores); write_vec(o, anc); write_vec(o, ri); write_vec(o, nt); write_vec(o, ns);
  write_vec(o, pos); write_vec(o, full);
  fclose(o);
  return 0;
}
