// Launch parameters and shared-memory layout of ddtree::tree_build_kernel, shared by the kernel
// (tree_build_kernel.cuh, nvcc), the host-compiled launcher (tree_build.cpp, the host C++
// compiler) and the CPU emulation in tests/cuda_ext_emu. Plain C++ with no CUDA or torch
// dependency, so that the host side can size shared memory and fill the parameters itself.
#pragma once

#include <cstdint>

// Host and device under nvcc; plain host functions for any other compiler.
#if defined(__CUDACC__)
#define DDTREE_HOST_DEVICE __host__ __device__
#else
#define DDTREE_HOST_DEVICE
#endif

namespace ddtree {

constexpr int kMaxBudget = 1024;       // lex positions, ranks and output indices fit 16 bits
constexpr int kMaxDepth = 63;          // the depth field of the key has 6 bits

struct TreeBuildParams {
  const float* logp;      // [bs, D, K] float32, last dim contiguous, sorted descending
  int64_t logp_sb, logp_sd;
  const int64_t* ids;     // [bs, D, K] int64, last dim contiguous
  int64_t ids_sb, ids_sd;
  const int64_t* root_ids;  // [bs] int64
  int D;                  // depths 1..D (the launcher passes min(D, B): deeper nodes cannot fit)
  int Kp;                 // min(K, B): ranks that can ever be selected
  int B;                  // budget; N = B + 1 verify tokens per request
  int gcap;               // G's capacity: tree_build_gcap (the launcher sets it; B unless deferred)
  // DraftTree outputs, all contiguous
  int64_t* tokens;        // [bs, N]
  int64_t* parents;       // [bs, N]
  int64_t* depths;        // [bs, N]
  bool* valid;            // [bs, N]
  float* scores;          // [bs, N]
  bool* ancestor_mask;    // [bs, N, N]
  int64_t* retrive_index;         // [bs, N]
  int64_t* retrive_next_token;    // [bs, N]
  int64_t* retrive_next_sibling;  // [bs, N]
  // Optional verify layout (seq_lens == nullptr: skipped)
  const int64_t* seq_lens;  // [bs] int64 prefix lengths
  int64_t* positions;       // [bs, N] int64 or nullptr
  bool* full_mask;          // flat FULL_MASK bool or nullptr
};

// Threads per block when the caller does not choose: the launcher's rule, shared with the CPU
// emulation (tests/cuda_ext_emu) so that phase counts are taken at the threads that serve.
// On the H200 (bench_results/tree_build_h200_s12.json, threads sweep at batch 64): 128 threads were
// as fast as 256 up to budget 64 (peaked 28.4 / 28.3 us, random 14.3 / 13.7 at budget 64) and
// slower at budget 128 (52.2 vs 50.9 us peaked, 21.1 vs 18.9 random).
DDTREE_HOST_DEVICE inline int default_threads(int budget) {
  if (budget <= 64) return 128;
  if (budget <= 256) return 256;
  if (budget <= 512) return 512;
  return 1024;
}

// ---------------------------------------------------------------------------------------------
// Shared-memory layout (host and device compute the same byte offsets).

DDTREE_HOST_DEVICE inline int64_t ddtree_align16(int64_t x) { return (x + 15) & ~int64_t(15); }

// Largest |G u candidates| that a level selects from by counting ranks (n^2 / threads key
// comparisons per thread) rather than by radix passes. On the H200 counting was faster at
// budgets 16-64 and, with a limit of 2B, slower at budget 256 (bench_results/README.md), so
// budgets of 128 and more (every selection has more than 128 items) keep the radix select.
DDTREE_HOST_DEVICE inline int rank_select_limit(int) { return 128; }

// The masks are written from ancestor bit rows (row q: one bit per position, set for q and its
// ancestors; (N + 31) / 32 words) when N is at most this, else from an ancestor table
// (anc[q][k] = ancestor of q at depth k, u16). Returns the bytes of whichever serves.
constexpr int kBitRowsMaxN = 288;
DDTREE_HOST_DEVICE inline int bit_row_words(int N) { return (N + 31) / 32; }
DDTREE_HOST_DEVICE inline int64_t layout_scratch_bytes(int N, int D) {
  return N <= kBitRowsMaxN ? 4 * int64_t(N) * bit_row_words(N) : 2 * int64_t(N) * (D + 1);
}

// The level-wise kernel's merge variant (algo kAlgoMerge, opt-in): up to this budget, a depth
// with at most 64 parents and 64 candidates is done by one warp that keeps the best-B set sorted
// and merges the candidates into it, with no block barrier (tree_build_kernel<true>).
constexpr int kMergeMaxBudget = 128;
constexpr int kMergeMaxThreads = 256;  // its launch bound (the launcher clamps): no spills

// The deferred variant (algo kAlgoDeferred, tree_build_kernel<kModeDeferred>): up to this budget,
// G may hold up to defer_cap(B) nodes, so a depth only appends its candidates (no selection) while
// they fit; a histogram of every generated node's score (kDeferBins bins of 1/8 nat) gives the
// pruning threshold, and one count over G at the end keeps the best B. A depth whose candidates
// would overflow G selects the best B as the level-wise kernel does. G's capacity: defer_cap.
constexpr int kDeferMaxBudget = 256;
constexpr int kDeferBins = 4096;        // fine bins: bin f holds scores in (-(f+1)/8, -f/8]

struct SmemLayout {
  int64_t lp, off, gscore, gmeta, gpar, keys, thr, thrf, posanc, lvl_cnt, hist, dhist, wbuf, wbuf_min;
  int64_t gkey, cscore, mstate;  // the merge variant's (budgets <= kMergeMaxBudget only)
  int64_t p_parent, p_depth, p_sib, first_child, total;
};

// Stage every depth's log-probs at once (one global-memory latency instead of one per depth)
// when they take at most 32 KB.
DDTREE_HOST_DEVICE inline bool preload_rows(int Kp, int D) { return int64_t(Kp) * D <= 8192; }

// gcap: G's capacity (B, or defer_cap(B) for the deferred variant): G's buffers, the sort keys
// and pos_of are sized by it.
DDTREE_HOST_DEVICE inline SmemLayout make_smem_layout(int B, int Kp, int D, int gcap) {
  const int64_t N = B + 1;
  const int64_t lp_rows = preload_rows(Kp, D) ? D : 1;
  SmemLayout L;
  int64_t o = 0;
  L.lp = o;          o = ddtree_align16(o + 4 * lp_rows * Kp);       // float[rows][Kp]: log-probs
  L.off = o;         o = ddtree_align16(o + 4 * int64_t(gcap + 1));  // int[gcap+1]: candidate offsets
  L.gscore = o;      o = ddtree_align16(o + 4 * 2 * int64_t(gcap));  // float[2][gcap]: G (double buffer)
  L.gmeta = o;       o = ddtree_align16(o + 4 * 2 * int64_t(gcap));  // u32[2][gcap]: depth<<16 | lex
  L.gpar = o;        o = ddtree_align16(o + 4 * 2 * int64_t(gcap));  // u32[2][gcap]: parent lex<<16 | rank
  // u64: the rank-counting select's keys during the build, the final sort keys after it (one
  // more: a zero key pads an odd count)
  const int64_t nkeys = gcap > rank_select_limit(B) ? gcap : rank_select_limit(B);
  L.keys = o;        o = ddtree_align16(o + 8 * (nkeys + 1));
  L.thr = o;         o = ddtree_align16(o + 8);                       // u64: selected cut key
  // float: the final threshold; int: live keys; float[2]: the walker's thresholds; int: its
  // published bin; int: its inbox; int[6]: a warp run's result
  L.thrf = o;        o = ddtree_align16(o + 48);
  // u16: pos_of[D][gcap] (output index of (depth, lex)) during the build, then the masks'
  // scratch (ancestor bit rows or table: layout_scratch_bytes).
  const int64_t pos_bytes = 2 * int64_t(D) * gcap, anc_bytes = layout_scratch_bytes(int(N), D);
  L.posanc = o;      o = ddtree_align16(o + (pos_bytes > anc_bytes ? pos_bytes : anc_bytes));
  L.lvl_cnt = o;     o = ddtree_align16(o + 4 * int64_t(D + 1));     // int[D+1]: |C_d|
  L.hist = o;        o = ddtree_align16(o + 4 * 3 * 256);            // int[3][256]: radix histograms
  // int[kDeferBins]: the deferred variant's score histogram
  L.dhist = o;       o = ddtree_align16(o + (gcap > B ? 4 * kDeferBins : 0));
  L.wbuf = o;        o = ddtree_align16(o + 8 * 32);                 // 64-bit[32]: block scans
  L.wbuf_min = o;    o = ddtree_align16(o + 4 * 32);                 // float[32]: block_min
  const int64_t mb = B <= kMergeMaxBudget ? B : 0;
  L.gkey = o;        o = ddtree_align16(o + 8 * 2 * mb);             // u64[2][B]: keys of sorted G
  L.cscore = o;      o = ddtree_align16(o + 4 * 2 * mb);             // float[2][B]: C_d scores, lex order
  L.mstate = o;      o = ddtree_align16(o + (mb ? 4 * 8 : 0));        // int[8]: a merge run's result
  L.p_parent = o;    o = ddtree_align16(o + 4 * N);                  // int[N] per output index
  L.p_depth = o;     o = ddtree_align16(o + 4 * N);                  // int[N], -1 = padding
  L.p_sib = o;       o = ddtree_align16(o + 4 * N);                  // int[N]
  L.first_child = o; o = ddtree_align16(o + 4 * N);                  // int[N]
  L.total = o;
  return L;
}

// The deferred variant's G capacity: 8B up to budget 128 and 4B above, or half that when the
// larger layout exceeds smem_limit (the device's per-block opt-in; the larger capacity needs
// 2 * D * cap bytes for pos_of). A larger G means fewer levels that overflow it and select
// exactly (block-wide, several barriers): on the H200 (bench_results/README.md, session 18;
// interleaved A/B medians, peaked inputs, batch 64) 4B -> 8B took budget 32 from 15.01 to 12.60
// us, 64 from 19.52 to 17.84 and 128 from 29.3 to 26.4, and 2B -> 4B took budget 256 from 65.7
// to 45.6, random inputs unchanged; 16B at budget 64 gained no more.
DDTREE_HOST_DEVICE inline int defer_cap(int B, int Kp, int D, int64_t smem_limit) {
  const int big = B <= 128 ? 8 * B : 4 * B;
  return make_smem_layout(B, Kp, D, big).total <= smem_limit ? big : big / 2;
}

// ---------------------------------------------------------------------------------------------
// The best-first ("frontier") kernel for small budgets: one warp pops the B best nodes one by one
// from a sorted frontier held in registers (32 * items slots, at least B + 1), so its time grows
// with B and not with the tree's depth. Served when the budget fits the largest item count and every
// depth's log-probs fit in shared memory; above that the level-wise kernel serves.
constexpr int kFrontierMaxItems = 9;   // 288 slots
constexpr int kFrontierMaxThreads = 256;  // launch bound of the frontier kernel
constexpr int kFrontierMaxBudget = 32 * kFrontierMaxItems - 1;

// Item count per lane of the frontier kernel's instantiations (1, 2, 3, 5, 9), 0 = none fits.
DDTREE_HOST_DEVICE inline int frontier_items(int B) {
  const int need = (B + 1 + 31) / 32;
  if (need <= 1) return 1;
  if (need <= 2) return 2;
  if (need <= 3) return 3;
  if (need <= 5) return 5;
  if (need <= 9) return 9;
  return 0;
}

// Which kernel serves (budget, Kp, D) by default: the frontier kernel up to this budget, where
// it is faster on the H200 (bench_results/tree_build_h200_s11.json, session 11: 8.2-9.4 us at budget
// 16 against 10.4-15.7 for the deferred variant with warp runs, peaked inputs), then that variant
// up to its largest budget, kDeferMaxBudget (use_defer).
constexpr int kFrontierDefaultMaxBudget = 16;

enum TreeAlgo : int {
  kAlgoAuto = 0, kAlgoLevelwise = 1, kAlgoFrontier = 2, kAlgoMerge = 3, kAlgoDeferred = 4,
  kAlgoDeferredWarp = 5  // the deferred variant with warp runs over narrow levels (auto above 16)
};

// The deferred variant serves when asked for and the budget allows it, and by default (kAlgoAuto)
// above the frontier kernel's budgets, with warp runs (kAlgoDeferredWarp): on the H200 it was
// the fastest kernel at every batch (1, 8, 64) x budget 32 / 64 point in both input
// distributions; at budget 128 the variant without runs was 0.2-0.4 us faster at the random
// points and at batch 1 peaked, and at budget 256 the level-wise kernel or that variant was
// ahead at five of six points by up to 0.9 us (bench_results/tree_build_h200_s12.json and
// tree_build_h200_s12a.json, session 12).
DDTREE_HOST_DEVICE inline bool use_defer(int algo, int B) {
  if (algo == kAlgoDeferred || algo == kAlgoDeferredWarp) return B <= kDeferMaxBudget;
  return algo == kAlgoAuto && B > kFrontierDefaultMaxBudget && B <= kDeferMaxBudget;
}

// The merge variant serves only when asked for and the budget allows it, and needs every
// depth's log-probs staged up front.
DDTREE_HOST_DEVICE inline bool use_merge(int algo, int B, int Kp, int D) {
  return algo == kAlgoMerge && B <= kMergeMaxBudget && preload_rows(Kp, D);
}

DDTREE_HOST_DEVICE inline bool frontier_fits(int B, int Kp, int D) {
  return frontier_items(B) > 0 && preload_rows(Kp, D);
}

DDTREE_HOST_DEVICE inline bool use_frontier(int algo, int B, int Kp, int D) {
  if (algo == kAlgoLevelwise || algo == kAlgoMerge || algo == kAlgoDeferred ||
      algo == kAlgoDeferredWarp || !frontier_fits(B, Kp, D))
    return false;
  return algo == kAlgoFrontier || B <= kFrontierDefaultMaxBudget;
}

struct FrontierSmemLayout {
  int64_t lp, p_parent, p_depth, p_rank, p_sib, first_child, score, anc, rec_link, rec_ps, misc, wbuf,
      total;
};

// The arrays a pop writes come first, at offsets fixed for every budget (sized for the largest,
// kFrontierMaxBudget): their addresses are then a constant plus the position, which keeps the
// pop loop free of address arithmetic. The rest depends on (B, Kp, D).
constexpr int64_t kFrontierN = kFrontierMaxBudget + 1;          // positions
constexpr int64_t kFrontierRecords = 2 * kFrontierMaxBudget + 2;  // 2 per pop + the first
DDTREE_HOST_DEVICE inline FrontierSmemLayout make_frontier_smem_layout(int B, int Kp, int D) {
  const int64_t N = B + 1;
  FrontierSmemLayout L;
  int64_t o = 0;
  L.p_parent = o;    o += 4 * kFrontierN;                  // int per output index
  L.p_depth = o;     o += 4 * kFrontierN;                  // int, -1 = padding
  L.p_rank = o;      o += 4 * kFrontierN;                  // int
  L.p_sib = o;       o += 4 * kFrontierN;                  // int
  L.first_child = o; o += 4 * kFrontierN;                  // int
  L.score = o;       o += 4 * kFrontierN;                  // float
  // frontier entries' records: parent position | previous sibling position << 16, and the
  // parent's score
  L.rec_link = o;    o += 4 * kFrontierRecords;
  L.rec_ps = o;      o += 4 * kFrontierRecords;
  L.misc = o;        o = ddtree_align16(o + 4 * 4);        // int[4]: n
  L.wbuf = o;        o = ddtree_align16(o + 8 * 32);       // 64-bit[32]: block scans
  L.lp = o;          o = ddtree_align16(o + 4 * int64_t(D) * Kp);   // float[D][Kp]
  L.anc = o;         o = ddtree_align16(o + layout_scratch_bytes(int(N), D));  // masks' scratch
  L.total = o;
  return L;
}

// The kernel that serves (algo, B, Kp, D), as an index shared by the launcher (tree_build.cu,
// which keeps per-kernel state), the host-compiled bindings, the CPU emulation and
// scripts/tree_build_clocks.cu: 0 the level-wise kernel, 1..5 the frontier kernel for 1, 2, 3,
// 5, 9 slots per lane, 6 the level-wise kernel's merge variant, 7 its deferred variant, 8 the
// deferred variant with warp runs (tree_kernel_fn in tree_build_kernel.cuh maps an index to its
// entry point).
constexpr int kTreeKernels = 9;
constexpr int kMergeKernelIndex = 6;
constexpr int kDeferKernelIndex = 7;
constexpr int kDeferWarpKernelIndex = 8;
DDTREE_HOST_DEVICE inline int tree_kernel_index(int algo, int B, int Kp, int D) {
  if (use_merge(algo, B, Kp, D)) return kMergeKernelIndex;
  if (use_defer(algo, B)) return algo == kAlgoDeferred ? kDeferKernelIndex : kDeferWarpKernelIndex;
  if (!use_frontier(algo, B, Kp, D)) return 0;
  switch (frontier_items(B)) {
    case 1: return 1;
    case 2: return 2;
    case 3: return 3;
    case 5: return 4;
    default: return 5;
  }
}

DDTREE_HOST_DEVICE inline const char* tree_kernel_name(int index) {
  if (index == 0) return "levelwise";
  if (index == kMergeKernelIndex) return "merge";
  if (index == kDeferWarpKernelIndex) return "deferred_warp";
  return index == kDeferKernelIndex ? "deferred" : "frontier";
}

// Threads per block the kernel `index` runs with when asked for `threads`: the frontier kernel
// and the merge variant are compiled for at most 256 (the block size changes no result).
DDTREE_HOST_DEVICE inline int tree_kernel_threads(int index, int threads) {
  const int cap = (index == 0 || index == kDeferKernelIndex || index == kDeferWarpKernelIndex)
                      ? 1024
                      : (index == kMergeKernelIndex ? kMergeMaxThreads : kFrontierMaxThreads);
  return threads > cap ? cap : threads;
}

// TreeBuildParams::gcap for the kernel that serves (algo, B, Kp, D) on a device that grants
// smem_limit bytes of shared memory per block.
DDTREE_HOST_DEVICE inline int tree_build_gcap(int algo, int B, int Kp, int D, int64_t smem_limit) {
  if (use_frontier(algo, B, Kp, D) || !use_defer(algo, B)) return B;
  return defer_cap(B, Kp, D, smem_limit);
}

// Dynamic shared memory of the kernel that serves (algo, B, Kp, D) (same smem_limit).
DDTREE_HOST_DEVICE inline int64_t tree_build_smem(int algo, int B, int Kp, int D,
                                                  int64_t smem_limit) {
  if (use_frontier(algo, B, Kp, D)) return make_frontier_smem_layout(B, Kp, D).total;
  return make_smem_layout(B, Kp, D, tree_build_gcap(algo, B, Kp, D, smem_limit)).total;
}

// Threads per block when the caller does not choose, for the kernel that serves (algo, B, Kp, D):
// 256 for the deferred variant (its appends and final count gain from more threads:
// bench_results/tree_build_h200_s10.json, session 10, batch 64 / budget 64, peaked 31.1 / 24.7 /
// 23.5 us at 64 / 128 / 256 threads; budget 128 in tree_build_h200_s10b.json 39.8 / 34.8 at
// 128 / 256), default_threads(B) otherwise.
DDTREE_HOST_DEVICE inline int default_threads_for(int algo, int B, int Kp, int D) {
  const int k = tree_kernel_index(algo, B, Kp, D);
  if (k == kDeferKernelIndex || k == kDeferWarpKernelIndex) return B <= 256 ? 256 : default_threads(B);
  return default_threads(B);
}

}  // namespace ddtree
