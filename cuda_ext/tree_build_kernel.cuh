// DDTree draft-tree build: one CUDA thread block per request, one launch per decode step.
//
// Semantics (bit-exact with sglang_ddtree.tree.build_tree_reference; see sglang_ddtree/tree.py):
// a node is a rank path (r1..rd), its score the fp32 sum ((lp1[r1] + lp2[r2]) + ...) added in
// depth order (parent score + child log-prob), and the tree is the first min(B, #finite) nodes of
// the total order "score desc, depth asc, rank path lexicographic asc".
//
// Two kernels compute it: tree_build_kernel (level-wise, below; any budget; with a merge and a
// deferred variant) and tree_build_frontier_kernel (best-first, at the end of this file; budgets
// up to 287). All end in write_tree_layout.
//
// Level-wise algorithm (exact even when fp32 rounding creates ties):
//   G   = the best <= B nodes found so far (an unordered set kept in shared memory),
//   C_d = the depth-d members of G right after level d (kept in rank-path lexicographic order).
//   For d = 1..D: candidates are the children p.r of C_{d-1} (r < min(K, B): a node of rank >= B
//   has B better siblings) whose score beats thr = worst score in G once |G| == B, or a lower
//   bound of it (a deeper node ties a shallower one only to lose the depth tie-break).
//   G := best B of G u candidates: when they are at most rank_select_limit(B) items, by
//   counting for each item the larger keys; otherwise by a block-wide 8-bit radix select (most
//   significant digit first, stopping as soon as the cut is exact); both over a 64-bit key that
//   encodes the total order
//   (ordered score bits | 63 - depth | 2^20 - 1 - lexicographic index). Every node of
//   the final tree survives each step (fewer than B nodes precede it anywhere) and every set
//   stays closed under "parent of", so at the end G is the tree.
// Children of one parent are monotone in r (lp is sorted descending and fp32 addition is
// monotone), so "score > thr" keeps a prefix of each parent's ranks and lexicographic order of
// the candidates is the order of a flat index c = offset[parent] + r.
//
// Deferred variant (tree_build_kernel<kModeDeferred>, budgets up to kDeferMaxBudget): G may hold
// up to p.gcap nodes (defer_cap: 4B-8B). A level whose candidates fit is not selected at all: they are
// appended (C_d = all of them, lex = flat index) and counted in a histogram of scores (bins of
// 1/8 nat). Warp 0 keeps the lowest bin f such that at least B counted nodes lie in bins 0..f;
// every node in those bins scores strictly above -(f+1)/8, so that value is a valid threshold
// for any later (deeper) candidate, whatever G holds. A level whose candidates would overflow G
// selects the best B exactly as above. At the end only the nodes at or above the final
// threshold count the larger keys among themselves, and the best B are the tree. Per narrow
// level: two block barriers (counts, append) instead of four or more.
//
// This header has no torch dependency: tree_build.cu launches it, and a host-side emulation can
// include it for CPU testing. The launch parameters and the shared-memory layout live in
// tree_build_params.h, which the host-compiled tree_build.cpp shares.
#pragma once

#include <cstdint>

#include "tree_build_params.h"

namespace ddtree {

constexpr int kLexBits = 20;           // flat candidate index c < B * min(K, B) <= 2^20
constexpr uint32_t kLexMask = (1u << kLexBits) - 1u;
constexpr uint16_t kNoPos = 0xFFFFu;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// Phase clocks for scripts/tree_build_clocks.py only (never defined in the extension build):
// thread 0 of each of the first DDTREE_PHASE_CLOCKS blocks records (mark id, clock64()) pairs.
#ifdef DDTREE_PHASE_CLOCKS
constexpr int kClockPairs = 192;
__device__ long long g_phase_clocks[DDTREE_PHASE_CLOCKS][2 * kClockPairs + 1];
#define DDTREE_MARK_INIT int ddtree_mark_n_ = 0
// a helper that marks takes the kernel's counter: DDTREE_MARK_PARAM in its parameters,
// DDTREE_MARK_ARG in the call
#define DDTREE_MARK_PARAM , int& ddtree_mark_n_
#define DDTREE_MARK_ARG , ddtree_mark_n_
#define DDTREE_MARK(id)                                                                \
  do {                                                                                 \
    if (threadIdx.x == 0 && blockIdx.x < DDTREE_PHASE_CLOCKS && ddtree_mark_n_ < kClockPairs) { \
      long long* c_ = g_phase_clocks[blockIdx.x];                                      \
      c_[1 + 2 * ddtree_mark_n_] = (id);                                               \
      c_[2 + 2 * ddtree_mark_n_] = clock64();                                          \
      c_[0] = ++ddtree_mark_n_;                                                        \
    }                                                                                  \
  } while (0)
#else
#define DDTREE_MARK_INIT (void)0
#define DDTREE_MARK_PARAM
#define DDTREE_MARK_ARG
#define DDTREE_MARK(id) (void)0
#endif

// ---------------------------------------------------------------------------------------------
// Keys: a larger key comes earlier in the total order.

// Monotone float -> uint32 map (a < b  =>  bits(a) < bits(b)); -0 is folded onto +0 so that
// equal scores give equal bits.
__device__ __forceinline__ uint32_t ordered_bits(float s) {
  uint32_t u = __float_as_uint(s);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A lower bound of every score whose ordered bits are >= o (-inf if o is at or below -inf's).
__device__ __forceinline__ float score_lower_bound(uint32_t o) {
  if (o <= 0x007FFFFFu) return -INFINITY;  // ordered_bits(-inf) == 0x007FFFFF
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
}

// score desc, then depth asc, then lex asc (lex = position in the depth's rank-path order).
__device__ __forceinline__ uint64_t node_key(float score, int depth, uint32_t lex) {
  return (uint64_t(ordered_bits(score)) << 32) |
         (uint64_t(uint32_t(kMaxDepth - depth)) << kLexBits) | uint64_t(kLexMask - lex);
}

// Number of ranks r < Kp with parent_score + lp[r] > thr; a prefix because lp is descending.
// Radix-8 search: each round probes 8 ranks at once, independent loads that overlap, so a count
// costs ceil(log8 Kp) shared-memory latencies (2 at Kp = 64) instead of log2 Kp dependent ones.
// Invariant: the count lies in [lo, lo + 8 * step]; a round keeps the passing probes' prefix.
__device__ __forceinline__ int radix8_top(int Kp) {
  int step = 1;
  while (8 * step < Kp) step *= 8;
  return step;
}
__device__ __forceinline__ int count_above(float parent_score, const float* lp, int Kp, float thr) {
  int lo = 0;
  for (int step = radix8_top(Kp); step > 0; step >>= 3) {
    int add = 0;
#pragma unroll
    for (int t = 1; t <= 8; ++t) {
      const int r = lo + t * step - 1;
      add += (r < Kp && parent_score + lp[r] > thr) ? 1 : 0;
    }
    lo += add * step;
  }
  return lo;
}

// Keys of keys[0, n) larger than k: k's position in the best-first order of distinct keys.
__device__ __forceinline__ int count_larger(const uint64_t* keys, int n, uint64_t k) {
  int r = 0;
  for (int f = 0; f < n; ++f) r += keys[f] > k ? 1 : 0;
  return r;
}

// count_above for U parents at once (the warp runs' parents lane + 32 u), their probes
// interleaved; a parent with use[u] false counts 0.
template <int U>
__device__ __forceinline__ void count_above_multi(const float (&ps)[U], const bool (&use)[U],
                                                  const float* lp, int Kp, float thr, int (&cnt)[U]) {
  int lo[U];
#pragma unroll
  for (int u = 0; u < U; ++u) lo[u] = 0;
  for (int step = radix8_top(Kp); step > 0; step >>= 3) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int add = 0;
#pragma unroll
      for (int t = 1; t <= 8; ++t) {
        const int r = lo[u] + t * step - 1;
        add += (r < Kp && ps[u] + lp[r] > thr) ? 1 : 0;
      }
      lo[u] += add * step;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) cnt[u] = use[u] ? lo[u] : 0;
}

// Largest i in [0, m) with off[i] <= c (off[0] == 0 <= c).
__device__ __forceinline__ int find_parent(const int* off, int m, int c) {
  int lo = 0, hi = m;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= c) lo = mid; else hi = mid;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------
// Block-wide helpers. blockDim.x is a multiple of 32; every thread must call them.

// One barrier each: every thread reads all warps' partials after it. The buffer is read until
// the caller's next barrier, so a helper call that follows without a barrier in between must use
// another buffer (the kernel gives block_min its own).
template <typename T>
__device__ __forceinline__ T block_exclusive_sum(T v, T* wbuf, T& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(kFullWarp, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) wbuf[warp] = x;
  __syncthreads();
  T before = T(0), all = T(0);
  for (int w = 0; w < nw; ++w) {
    const T t = wbuf[w];
    if (w < warp) before += t;
    all += t;
  }
  total = all;
  return before + x - v;
}

__device__ __forceinline__ float block_min(float v, float* wbuf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(kFullWarp, v, o));
  if (lane == 0) wbuf[warp] = v;
  __syncthreads();
  float r = wbuf[0];
  for (int w = 1; w < nw; ++w) r = fminf(r, wbuf[w]);
  return r;
}

// Every warp (the same result in every lane of every warp, so no barrier is needed to share
// it): walk the 256-bin histogram from the top bin down and find the bin holding the krem-th
// largest key; returns {bin, keys still to take inside it, keys in it}.
struct RadixPick {
  int bin, krem, cnt;
};

__device__ __forceinline__ RadixPick radix_pick_bin(const int* hist, int krem) {
  const int lane = threadIdx.x & 31;
  int cnt[8];
  int local = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    cnt[q] = hist[255 - (lane * 8 + q)];
    local += cnt[q];
  }
  int incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFullWarp, incl, o);
    if (lane >= o) incl += y;
  }
  const int excl = incl - local;
  // the one lane holding the bin encodes it (bin < 2^8, krem <= B <= 2^10, count < 2^21:
  // at most B + B * min(K, B) keys); a warp max hands it to every lane
  long long code = -1;
  if (excl < krem && krem <= incl) {
    int acc = excl;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (acc < krem && acc + cnt[q] >= krem) {
        code = (static_cast<long long>(255 - (lane * 8 + q)) << 42) |
               (static_cast<long long>(krem - acc) << 21) | static_cast<long long>(cnt[q]);
      }
      acc += cnt[q];
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long y = __shfl_xor_sync(kFullWarp, code, o);
    code = y > code ? y : code;
  }
  return {int(code >> 42), int((code >> 21) & 0x1FFFFF), int(code & 0x1FFFFF)};
}

// Warp-wide fill of len bytes with 1 (true): 16-byte stores on the aligned middle part.
__device__ __forceinline__ void warp_fill_true(bool* dst, int64_t len, int lane) {
  unsigned char* p = reinterpret_cast<unsigned char*>(dst);
  int64_t head = int64_t((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15);
  if (head > len) head = len;
  if (lane < head) p[lane] = 1;
  const int64_t nvec = (len - head) >> 4;
  uint4* v = reinterpret_cast<uint4*>(p + head);
  const uint4 ones = make_uint4(0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u);
  for (int64_t k = lane; k < nvec; k += 32) v[k] = ones;
  for (int64_t k = head + (nvec << 4) + lane; k < len; k += 32) p[k] = 1;
}

// ---------------------------------------------------------------------------------------------
// Pieces both kernels share.

// Rows [d_first, d_first + rows) of request b's log-probs (depths are 1-based) into dst, with
// tree._normalize_logp's normalisation: NaN -> -inf (unreachable), > 0 (misuse) -> 0, -0 -> +0.
__device__ __forceinline__ void stage_logp_rows(const TreeBuildParams& p, int64_t b, int Kp,
                                                int d_first, int rows, float* dst) {
  // Eight loads in flight per thread before any store (staging took 3,900 cycles at budget 64 on
  // the H200 with one load at a time, 3,150 with eight: scripts/tree_build_clocks.py).
  constexpr int kBatch = 8;
  const float* logp_b = p.logp + b * p.logp_sb;
  const int total = rows * Kp, T = blockDim.x;
  for (int base = threadIdx.x; base < total; base += kBatch * T) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = base + u * T;
      v[u] = 0.0f;
      if (e < total) {
        const int rr = e / Kp, r = e - rr * Kp;
        v[u] = logp_b[int64_t(d_first + rr - 1) * p.logp_sd + r];
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = base + u * T;
      if (e < total) dst[e] = v[u] <= 0.0f ? v[u] + 0.0f : (v[u] > 0.0f ? 0.0f : -INFINITY);
    }
  }
}

// The per-position arrays before any node is placed: the root at 0, padding everywhere else.
__device__ __forceinline__ void init_positions(int N, int* p_parent, int* p_depth, int* p_sib,
                                               int* first_child) {
  for (int q = threadIdx.x; q < N; q += blockDim.x) {
    p_parent[q] = -1;
    p_depth[q] = q == 0 ? 0 : -1;
    p_sib[q] = -1;
    first_child[q] = -1;
  }
}

// ---------------------------------------------------------------------------------------------
// The tail's inputs from global memory, loaded when a kernel starts so that their latency (a
// global load: hundreds of cycles) hides behind the build instead of adding to the tail.
struct LayoutInputs {
  int64_t root_id;       // thread 0's: the request's root token
  int64_t seq_len;       // the request's prefix length (0 without seq_lens)
  long long seq_before;  // this thread's part of sum_{b' < b} seq_lens[b'] (FULL_MASK only)
};
__device__ __forceinline__ LayoutInputs load_layout_inputs(const TreeBuildParams& p, int64_t b) {
  LayoutInputs in;
  in.root_id = threadIdx.x == 0 ? p.root_ids[b] : 0;
  in.seq_len = p.seq_lens != nullptr ? p.seq_lens[b] : 0;
  in.seq_before = 0;
  if (p.full_mask != nullptr)
    for (int64_t t = threadIdx.x; t < b; t += blockDim.x) in.seq_before += p.seq_lens[t];
  return in;
}

// ---------------------------------------------------------------------------------------------
// Shared tail of both kernels: every thread of the block calls it after a barrier that orders the
// per-position arrays (p_parent / p_depth / first_child / p_sib, written for positions 1..n;
// p_depth = -1 marks padding) before it. Writes the root and padding entries of the per-node
// outputs (the caller writes positions 1..n), the retrieve arrays, the positions and both masks.
// `scratch` is layout_scratch_bytes(N, D) of shared memory that nobody reads any more.
//
// Mask entry (i, j) is true iff j is i or an ancestor of i (padding rows: only themselves). Up to
// kBitRowsMaxN positions each row is a bit set (its node and the node's ancestors), and the
// request's N x N bytes go out as 16-byte stores over the flat block; above, rows are written a
// byte per lane from an ancestor table. (Written that way, the masks took 12,000 cycles, 6 us, of
// a launch at budget 64 on the H200; 3,750 as bit rows: scripts/tree_build_clocks.py.)
__device__ __forceinline__ void write_tree_layout(const TreeBuildParams& p, int64_t b, int N, int D,
                                                  int n, const int* p_parent, const int* p_depth,
                                                  const int* first_child, const int* p_sib,
                                                  unsigned char* scratch, long long* wbuf_ll,
                                                  const LayoutInputs& in DDTREE_MARK_PARAM) {
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = T >> 5, A = D + 1, W = bit_row_words(N);
  const bool bit_rows = N <= kBitRowsMaxN;
  uint32_t* rows = reinterpret_cast<uint32_t*>(scratch);  // bit_rows: [N][W]
  uint16_t* anc = reinterpret_cast<uint16_t*>(scratch);   // otherwise: anc[q][k], k <= depth of q
  int64_t* tokens = p.tokens + b * N;
  int64_t* parents = p.parents + b * N;
  int64_t* depths = p.depths + b * N;
  bool* valid = p.valid + b * N;
  float* scores = p.scores + b * N;
  const int64_t seq_len = in.seq_len;
  for (int q = tid; q < N; q += T) {
    const int dq = p_depth[q];
    if (bit_rows) {
      uint32_t* row = rows + q * W;
      for (int w = 0; w < W; ++w) row[w] = 0u;
      int x = q;
      row[x >> 5] = 1u << (x & 31);
      for (int k = dq; k > 0; --k) {  // a padding row (dq = -1) keeps its own bit only
        x = p_parent[x];
        row[x >> 5] |= 1u << (x & 31);
      }
    } else {
      int x = q;
      for (int k = dq; k >= 0; --k) {
        anc[q * A + k] = uint16_t(x);
        x = p_parent[x];
      }
    }
    if (q == 0) {
      tokens[0] = in.root_id;  // q == 0: thread 0
      parents[0] = -1;
      depths[0] = 0;
      valid[0] = true;
      scores[0] = 0.0f;
    } else if (q > n) {
      tokens[q] = 0;
      parents[q] = -1;
      depths[q] = 0;
      valid[q] = false;
      scores[q] = -INFINITY;
    }
    p.retrive_index[b * N + q] = b * N + q;
    p.retrive_next_token[b * N + q] = first_child[q];
    p.retrive_next_sibling[b * N + q] = p_sib[q];
    if (p.positions != nullptr) p.positions[b * N + q] = seq_len + (dq > 0 ? dq : 0);
  }

  DDTREE_MARK(9005);  // layout: rows and per-position outputs
  // FULL_MASK block of this request starts at N * (sum_{b' < b} seq_lens[b'] + b * N).
  int64_t full_base = 0;
  if (p.full_mask != nullptr) {
    long long before = 0;
    block_exclusive_sum(in.seq_before, wbuf_ll, before);  // includes a barrier
    full_base = int64_t(N) * (int64_t(before) + b * N);
  } else {
    __syncthreads();
  }

  DDTREE_MARK(9006);  // layout: the barrier after them
  if (bit_rows) {
    auto bit = [&](int i, int j) -> uint32_t { return (rows[i * W + (j >> 5)] >> (j & 31)) & 1u; };
    // ancestor_mask: the request's N * N bytes as one flat run; bytes before the first 16-byte
    // boundary and after the last one singly, the middle 16 at a time
    unsigned char* am = reinterpret_cast<unsigned char*>(p.ancestor_mask + b * int64_t(N) * N);
    const int total = N * N;
    int head = int((16 - (reinterpret_cast<uintptr_t>(am) & 15)) & 15);
    if (head > total) head = total;
    const int nvec = (total - head) >> 4, tail = head + (nvec << 4);
    for (int e = tid; e < head + (total - tail); e += T) {
      const int f = e < head ? e : tail + (e - head);
      const int i = f / N;
      am[f] = static_cast<unsigned char>(bit(i, f - i * N));
    }
    uint4* av = reinterpret_cast<uint4*>(am + head);
    for (int k = tid; k < nvec; k += T) {
      const int e0 = head + (k << 4);
      int i = e0 / N, j = e0 - i * N;
      // the vector's 16 entries as 16 bits (entry v at bit v): runs of whole row words, shifted
      // (a row's bits at N and above are 0)
      uint32_t x16 = 0u;
      for (int filled = 0; filled < 16;) {
        const uint32_t* r = rows + i * W;
        const int w = j >> 5, sh = j & 31;
        uint32_t bits = r[w] >> sh;
        if (sh != 0 && w + 1 < W) bits |= r[w + 1] << (32 - sh);
        const int take = min(16 - filled, N - j);
        x16 |= (bits & ((1u << take) - 1u)) << filled;
        filled += take;
        j += take;
        if (j == N) {
          j = 0;
          ++i;
        }
      }
      // four bits to four bytes (little-endian: bit v of a nibble to byte v): the multiply's
      // shifted copies (0, 7, 14, 21) do not overlap, so it is an OR
      uint32_t w4[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) w4[u] = (((x16 >> (4 * u)) & 0xFu) * 0x00204081u) & 0x01010101u;
      av[k] = make_uint4(w4[0], w4[1], w4[2], w4[3]);
    }
    if (p.full_mask != nullptr) {  // per row: seq_len trues, then the row's N entries
      for (int i = warp; i < N; i += nwarps) {
        bool* frow = p.full_mask + full_base + int64_t(i) * (seq_len + N);
        warp_fill_true(frow, seq_len, lane);
        frow += seq_len;
        for (int j = lane; j < N; j += 32) frow[j] = bit(i, j) != 0u;
      }
    }
    return;
  }

  // Masks from the ancestor table, one warp per row.
  for (int i = warp; i < N; i += nwarps) {
    const int di = p_depth[i];
    bool* arow = p.ancestor_mask + (b * N + i) * int64_t(N);
    bool* frow = nullptr;
    if (p.full_mask != nullptr) {
      frow = p.full_mask + full_base + int64_t(i) * (seq_len + N);
      warp_fill_true(frow, seq_len, lane);
      frow += seq_len;
    }
    for (int j = lane; j < N; j += 32) {
      bool v;
      if (di < 0) {
        v = j == i;
      } else {
        const int dj = p_depth[j];
        v = dj >= 0 && dj <= di && int(anc[i * A + dj]) == j;
      }
      arow[j] = v;
      if (frow != nullptr) frow[j] = v;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The deferred variant's score histogram (tree_build_params.h: kDeferBins).

// Fine bin of a finite score s <= 0: f = floor(-8 s), so bin f holds (-(f+1)/8, -f/8]; the last
// bin also takes everything lower. Scaling by 8 is exact, so the edges are exact.
__device__ __forceinline__ int defer_bin(float s) {
  const float x = -s * 8.0f;
  return x < float(kDeferBins - 1) ? int(x) : kDeferBins - 1;
}

// Counts s in the histogram; returns 1 when its bin is at most f (the walker's published bin).
__device__ __forceinline__ int defer_count(int* dhist, float s, int f) {
  const int bin = defer_bin(s);
  atomicAdd(&dhist[bin], 1);
  return bin <= f ? 1 : 0;
}

// Adds a warp's counts of nodes at or below the published bin to the walker's inbox.
__device__ __forceinline__ void defer_inbox_add(int* inbox, int v, int lane) {
  v = int(__reduce_add_sync(kFullWarp, unsigned(v)));
  if (lane == 0 && v != 0) atomicAdd(inbox, v);
}

// The pruning threshold of bin f: every node counted in bins 0..f scores strictly above it.
__device__ __forceinline__ float defer_tau(int f) {
  return f >= kDeferBins - 1 ? -INFINITY : -float(f + 1) * 0.125f;
}

// Warp-wide (every lane ends with the same f and cnt): lowers the threshold bin f while at least B
// counted nodes stay in bins 0..f. cnt = the nodes counted in bins 0..f. The first time B nodes
// are counted: when they are exactly sorted[0, cnt) (scores, descending: the depth-1 nodes), the
// B-th one's bin and a count of the nodes up to that bin; otherwise per-lane sums of
// kDeferBins / 32 bins find the chunk of the B-th best. Then windows of 32 bins walk down from f
// (one window per call, usually).
__device__ __forceinline__ void defer_walk_bins(const int* dhist, int B, int lane, int& f, int& cnt,
                                                const float* sorted) {
  if (cnt < B) return;
  if (f == kDeferBins - 1 && sorted != nullptr) {
    const int fb = defer_bin(sorted[B - 1]);
    if (fb < kDeferBins - 1) {
      int c = B;  // sorted[0, B) are in bins <= fb; the rest of that bin follows them
      for (int r0 = B; r0 < cnt; r0 += 32) {
        const int r = r0 + lane;
        const unsigned in = __ballot_sync(kFullWarp, r < cnt && defer_bin(sorted[r]) <= fb);
        c += __popc(in);
        if (in != kFullWarp) break;  // sorted: the first node past the bin ends it
      }
      f = fb;
      cnt = c;
    }
  }
  if (f == kDeferBins - 1) {
    constexpr int kChunk = kDeferBins / 32;
    int cs = 0;
#pragma unroll 8
    for (int q = 0; q < kChunk; ++q) cs += dhist[kChunk * lane + q];
    int inc = cs;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFullWarp, inc, o);
      if (lane >= o) inc += y;
    }
    // every counted node is in some bin, so the last lane's sum is cnt >= B
    const int L = __ffs(int(__ballot_sync(kFullWarp, inc >= B))) - 1;
    f = kChunk * L + kChunk - 1;
    cnt = __shfl_sync(kFullWarp, inc, L);
  }
  for (;;) {
    const int bin = f - lane;
    int S = bin >= 0 ? dhist[bin] : 0;
    // bin f alone cannot go (the usual case): no scan
    if (!__any_sync(kFullWarp, lane == 0 && cnt - S >= B)) break;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFullWarp, S, o);
      if (lane >= o) S += y;
    }
    // lane i: may f drop below bins f..f-i? (a prefix of the lanes; never below bin 0, where
    // S reaches cnt)
    const int n = __popc(__ballot_sync(kFullWarp, cnt - S >= B));
    if (n == 0) break;
    cnt -= __shfl_sync(kFullWarp, S, n - 1);
    f -= n;
    if (n < 32 || f < 0) break;
  }
}


// defer_walk_bins for the walker warp, which also keeps cnt exact: the writers of the histogram
// count the nodes they add in bins <= *f_pub into *inbox (f only falls, so a node above the
// published bin never lies in bins 0..f later); the walk takes the inbox first and publishes the
// new f after.
__device__ __forceinline__ void defer_take_inbox(int lane, int& cnt, int* inbox) {
  int add = lane == 0 ? *inbox : 0;
  add = __shfl_sync(kFullWarp, add, 0);
  cnt += add;
  if (lane == 0) *inbox = 0;
}
__device__ __forceinline__ void defer_walk(const int* dhist, int B, int lane, int& f, int& cnt,
                                           const float* sorted, int* inbox, int* f_pub) {
  defer_take_inbox(lane, cnt, inbox);
  defer_walk_bins(dhist, B, lane, f, cnt, sorted);
  if (lane == 0) *f_pub = f;
}

// ---------------------------------------------------------------------------------------------
// The deferred variant's warp runs (tree_build_kernel<kModeDeferredWarp>): warp 0 alone takes
// consecutive narrow levels (at most kRunMaxParents parents, at most kRunMaxCandidates candidates
// that fit in G), each with no block barrier: it walks the histogram (it is the walker), counts
// each parent's children above the threshold (parents lane and lane + 32), scans them, appends
// the candidates (c = lane + 32 k) and counts them in the histogram, __syncwarp between the
// steps. It stops at a level it cannot take: kRunHandBack (more parents: the block does the level
// from its start),
// kRunCounted (the counts are done and in off[]: the block selects or appends), or kRunDone (no
// candidate: the tree is complete; or past depth D).
// Limits measured on the H200 (bench_results/README.md, session 12; batch 64 / budget 64,
// peaked): the block appends a level of more than 64 candidates faster than the warp does
// (20.2 us with 64 here, 20.7 with 128, 20.5 with 32); a warp count of up to 128 parents (four
// per lane) and an always-unrolled four-parent search were slower than the block's (24.4 us).
// Smaller warp-run code also ran faster in every variant tried: keep the loop lean.
constexpr int kRunMaxParents = 64;
// A level of at most this many parents (and Kp <= 64) counts by ballots instead (0: never).
// On the H200 (bench_results/README.md, session 16; interleaved A/B medians against the kernel
// without it): 8 parents took batch 64 / budget 64 from 20.00 to 19.48 us peaked and 10.35 to
// 9.92 random, budget 32 from 15.02 to 15.29 and budget 128 (Kp > 64: never taken) from 29.29
// to 29.59; 4 and 2 parents gained less.
#ifndef DDTREE_FEW_PARENTS
#define DDTREE_FEW_PARENTS 8
#endif
constexpr int kFewParents = DDTREE_FEW_PARENTS > 0 ? DDTREE_FEW_PARENTS : 1;
constexpr int kRunMaxCandidates = 64;
constexpr int kRunDone = 1, kRunHandBack = 2, kRunCounted = 3;

struct DeferRun {
  int d, g, cb, cs, status;
  float thr;
};

// A warp run's candidate c (parent i, rank r) appended to G after its g members; returns its
// histogram bin (warp_hist_add counts it).
__device__ __forceinline__ int append_run_candidate(int d, int c, int i, int r, const float* ps,
                                                    const float* lp, int g, int GC, float* gs,
                                                    uint32_t* gm, uint32_t* gp, uint16_t* pos_of) {
  const float s = (d == 1 ? 0.0f : ps[i]) + lp[r];
  gs[g + c] = s;
  gm[g + c] = (uint32_t(d) << 16) | uint32_t(c);
  gp[g + c] = (uint32_t(i) << 16) | uint32_t(r);
  pos_of[(d - 1) * GC + c] = kNoPos;
  return defer_bin(s);
}

// Warp-wide (every lane calls it): counts each active lane's bin in the histogram, one atomic per
// run of equal bins in consecutive active lanes. A parent's candidates sit in consecutive lanes
// with non-decreasing bins, so siblings sharing a bin (the usual case) cost one atomic instead
// of colliding on one address. The active lanes must be a prefix of the warp (the warp runs'
// candidates c < M): an active lane after an inactive one with the same bin would go uncounted.
__device__ __forceinline__ void warp_hist_add(int* dhist, bool act, int bin, int lane) {
  const int prev = __shfl_up_sync(kFullWarp, bin, 1);
  const bool head = act && (lane == 0 || prev != bin);
  const unsigned ends = __ballot_sync(kFullWarp, head) | ~__ballot_sync(kFullWarp, act);
  if (head) {
    const unsigned after = lane == 31 ? 0u : ends & (~0u << (lane + 1));
    const int len = (after != 0u ? __ffs(int(after)) - 1 : 32) - lane;
    atomicAdd(&dhist[bin], len);
  }
}

__device__ __forceinline__ DeferRun defer_run(DeferRun st, int D, int Kp, int B, int GC,
                                              const float* lp_base, int* off, float* gs,
                                              uint32_t* gm, uint32_t* gp, uint16_t* pos_of,
                                              int* lvl_cnt, int* dhist, int& f, int& cnt,
                                              int* inbox, int* f_pub DDTREE_MARK_PARAM) {
  const int lane = threadIdx.x & 31;
  // the inbox holds the nodes block levels added at or below the published bin; a run adds
  // none there (it counts its own appends in cnt), so one read serves the whole run
  defer_take_inbox(lane, cnt, inbox);
  for (;;) {
    const int d = st.d;
    if (d > D) {
      st.status = kRunDone;
      return st;
    }
    const int m = st.cs;
    if (m > kRunMaxParents) {
      st.status = kRunHandBack;
      return st;
    }
    // every node of depths < d is in the histogram (ordered by the caller's barrier or by the
    // __syncwarp below)
    defer_walk_bins(dhist, B, lane, f, cnt, d == 2 ? gs : nullptr);
    if (lane == 0) *f_pub = f;
    DDTREE_MARK(100 * d + 7);  // run: walked
    float thr = fmaxf(st.thr, defer_tau(f));
    if (d == 2 && st.g >= B) thr = fmaxf(thr, gs[B - 1]);
    st.thr = thr;
    const float* lp = lp_base + (d - 1) * Kp;
    const float* ps = gs + st.cb;
#if DDTREE_FEW_PARENTS > 0
    if (m <= kFewParents && Kp <= 64) {  // warp-uniform: a chain-like level
      // every lane holds ranks lane and lane + 32 of this depth; parent i's count is the
      // population of two ballots (the same comparisons as count_above), so all lanes know
      // every count and offset at once: no search, no scan, no off[] round trip
      const float l0 = lane < Kp ? lp[lane] : -INFINITY;
      const float l1 = lane + 32 < Kp ? lp[lane + 32] : -INFINITY;
      int po[kFewParents + 1];
      po[0] = 0;
#pragma unroll
      for (int i = 0; i < kFewParents; ++i) {
        const bool ok = i < m;
        const float pv = ok && d > 1 ? ps[i] : 0.0f;
        po[i + 1] = po[i] + __popc(__ballot_sync(kFullWarp, ok && pv + l0 > thr)) +
                    __popc(__ballot_sync(kFullWarp, ok && pv + l1 > thr));
      }
      const int M = po[kFewParents];  // parents i >= m count 0
      if (M == 0) {
        st.status = kRunDone;
        return st;
      }
      if (M > kRunMaxCandidates || st.g + M > GC) {
        // the block takes the level from its counts: off[0, m], off[m] = M
        int v = 0;
#pragma unroll
        for (int i = 0; i <= kFewParents; ++i)
          if (lane == i) v = po[i];
        if (lane <= m) off[lane] = v;
        __syncwarp();
        st.status = kRunCounted;
        return st;
      }
      constexpr int kU = kRunMaxCandidates / 32;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (32 * u >= M) break;  // warp-uniform
        const int c = lane + 32 * u;
        int bin = 0;
        if (c < M) {
          int i = 0, base = 0;
#pragma unroll
          for (int k = 1; k < kFewParents; ++k)
            if (k < m && po[k] <= c) {
              i = k;
              base = po[k];
            }
          bin = append_run_candidate(d, c, i, c - base, ps, lp, st.g, GC, gs, gm, gp, pos_of);
        }
        warp_hist_add(dhist, c < M, bin, lane);
      }
      cnt += M;  // they score above defer_tau(f): all in bins 0..f
      if (lane == 0) lvl_cnt[d] = M;
      __syncwarp();
      st.cb = st.g;
      st.cs = M;
      st.g += M;
      st.d = d + 1;
      continue;
    }
#endif
    // parents lane (first half) and lane + 32 (second half): scanned as two runs of 32, the
    // second after the first's total, so that the offsets follow the parents' order
    // (a level of at most 32 parents, the usual narrow one, searches once per lane; wider ones
    // search both parents at once: on the H200, searching both always and placing four
    // candidates per lane always was slower, session 11)
    int c_a, c_b = 0;
    if (m <= 32) {
      c_a = lane < m ? count_above(d == 1 ? 0.0f : ps[lane], lp, Kp, thr) : 0;
    } else {
      const float pv[2] = {lane < m ? ps[lane] : 0.0f, lane + 32 < m ? ps[lane + 32] : 0.0f};
      const bool use[2] = {lane < m, lane + 32 < m};
      int cv[2];
      count_above_multi<2>(pv, use, lp, Kp, thr, cv);
      c_a = cv[0];
      c_b = cv[1];
    }
    DDTREE_MARK(10000 + 100 * d + 1);  // run: counted
    int inc_a = c_a, inc_b = c_b;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int ya = __shfl_up_sync(kFullWarp, inc_a, o);
      const int yb = __shfl_up_sync(kFullWarp, inc_b, o);
      if (lane >= o) {
        inc_a += ya;
        inc_b += yb;
      }
    }
    const int tot_a = __shfl_sync(kFullWarp, inc_a, 31);
    const int M = tot_a + __shfl_sync(kFullWarp, inc_b, 31);
    if (lane < m) off[lane] = inc_a - c_a;
    if (lane + 32 < m) off[lane + 32] = tot_a + inc_b - c_b;
    if (lane == 0) off[m] = M;
    __syncwarp();
    DDTREE_MARK(100 * d + 8);  // run: counted and scanned
    if (M == 0) {
      st.status = kRunDone;
      return st;
    }
    if (M > kRunMaxCandidates || st.g + M > GC) {
      st.status = kRunCounted;  // off[0, m] holds the offsets, off[m] = M
      return st;
    }
    if (M <= 32) {  // one candidate per lane (the usual narrow level)
      int bin = 0;
      if (lane < M) {
        const int i = find_parent(off, m, lane);
        bin = append_run_candidate(d, lane, i, lane - off[i], ps, lp, st.g, GC, gs, gm, gp,
                                   pos_of);
      }
      DDTREE_MARK(10000 + 100 * d + 2);  // run: appended, not yet counted in the histogram
      warp_hist_add(dhist, lane < M, bin, lane);
    } else {
      // candidates lane + 32 u (u < kU: M <= kRunMaxCandidates), their parents' binary searches
      // interleaved (independent loads that overlap)
      constexpr int kU = kRunMaxCandidates / 32;
      int par[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) par[u] = 0;
      int top = 1;
      while (top * 2 < m) top *= 2;  // the largest power of two below m (1 when m <= 2)
      for (int step = top; step > 0; step >>= 1) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int t = par[u] + step;
          if (t < m && off[t] <= lane + 32 * u) par[u] = t;
        }
      }
      int bin[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int c = lane + 32 * u;
        bin[u] = 0;
        if (c < M)
          bin[u] = append_run_candidate(d, c, par[u], c - off[par[u]], ps, lp, st.g, GC, gs, gm,
                                        gp, pos_of);
      }
      DDTREE_MARK(10000 + 100 * d + 2);
#pragma unroll
      for (int u = 0; u < kU; ++u) warp_hist_add(dhist, lane + 32 * u < M, bin[u], lane);
    }
    cnt += M;  // they score above defer_tau(f): all in bins 0..f
    if (lane == 0) lvl_cnt[d] = M;
    __syncwarp();
    DDTREE_MARK(100 * d + 9);  // run: appended
    st.cb = st.g;
    st.cs = M;
    st.g += M;
    st.d = d + 1;
  }
}

// ---------------------------------------------------------------------------------------------
// The merge variant's narrow depths (tree_build_kernel<true>): warp 0 alone, G kept sorted by key
// (best first) in shared memory with its keys in gkey, C_{d-1}'s scores in cscore (lex order).
// A depth whose parents and candidates are at most kMergeWidth each: item x (parent or candidate
// x, lane x % 32, slot x / 32; flat candidate index = lex order) finds its parent, its rank among
// the candidates (32 rounds of shuffles) and among G (binary search); G member j moves down by
// the candidates before it; whatever lands at B or below drops out. Keys are distinct, so the
// new positions are a permutation. Runs depths until one has no candidate or survivor (status
// kMergeDone), or more than kMergeWidth candidates (kMergePending: off[] and off[m] = M are
// written for that depth, which the block then takes over).
constexpr int kMergeWidth = 64;  // two items per lane
constexpr int kMergeDone = 1, kMergePending = 2;

struct MergeState {
  int d, cur, g, m, csb, status;
  float thr;
};

__device__ __forceinline__ MergeState merge_run(MergeState st, int D, int Kp, int B,
                                                const float* lp_base, int* off, float* gscore,
                                                uint32_t* gmeta, uint32_t* gpar, uint64_t* gkey,
                                                float* cscore, uint16_t* pos_of, int* lvl_cnt) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  for (; st.d <= D; ++st.d) {
    const int d = st.d, m = st.m, g = st.g;
    const float* lp = lp_base + (d - 1) * Kp;
    const float* ps = cscore + st.csb * B;
    // candidate counts of parents lane and lane + 32, scanned in parent order
    int cnt[2], excl[2];
    int base = 0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int x = lane + 32 * t;
      cnt[t] = x < m ? count_above(d == 1 ? 0.0f : ps[x], lp, Kp, st.thr) : 0;
      int incl = cnt[t];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFullWarp, incl, o);
        if (lane >= o) incl += y;
      }
      excl[t] = base + incl - cnt[t];
      base += __shfl_sync(kFullWarp, incl, 31);
    }
    const int M = base;
#pragma unroll
    for (int t = 0; t < 2; ++t)
      if (lane + 32 * t < m) off[lane + 32 * t] = excl[t];
    if (lane == 0) off[m] = M;
    __syncwarp();
    if (M == 0) {
      st.status = kMergeDone;
      return st;
    }
    if (M > kMergeWidth) {
      st.status = kMergePending;
      return st;
    }
    const float* gs_old = gscore + st.cur * B;
    const uint32_t* gm_old = gmeta + st.cur * B;
    const uint32_t* gp_old = gpar + st.cur * B;
    const uint64_t* gk_old = gkey + st.cur * B;
    const int nb = st.cur ^ 1;
    // this lane's candidates c = lane + 32 t
    bool has[2];
    int par[2], rk[2], rc[2];
    float sc[2];
    uint64_t key[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int c = lane + 32 * t;
      has[t] = c < M;
      par[t] = 0;
      rk[t] = 0;
      sc[t] = 0.0f;
      key[t] = 0;
      rc[t] = 0;
      if (has[t]) {
        par[t] = find_parent(off, m, c);
        rk[t] = c - off[par[t]];
        sc[t] = (d == 1 ? 0.0f : ps[par[t]]) + lp[rk[t]];
        key[t] = node_key(sc[t], d, uint32_t(c));
      }
    }
    // this lane's G members j = lane + 32 u (B <= kMergeMaxBudget = 128: u < 4)
    uint64_t gk[4];
    int before[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = lane + 32 * u;
      gk[u] = j < g ? gk_old[j] : 0;
      before[u] = 0;
    }
    for (int src = 0; src < 32; ++src) {
#pragma unroll
      for (int ts = 0; ts < 2; ++ts) {
        const uint64_t ks = __shfl_sync(kFullWarp, key[ts], src);
        if (src + 32 * ts < M) {
#pragma unroll
          for (int t = 0; t < 2; ++t) rc[t] += ks > key[t] ? 1 : 0;
#pragma unroll
          for (int u = 0; u < 4; ++u) before[u] += ks > gk[u] ? 1 : 0;
        }
      }
    }
    bool sel[2];
    int nc[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      int lo = 0, hi = g;  // G members before the candidate: G is sorted best first
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (gk_old[mid] > key[t]) lo = mid + 1; else hi = mid;
      }
      nc[t] = rc[t] + lo;
      sel[t] = has[t] && nc[t] < B;
    }
    const unsigned mask0 = __ballot_sync(kFullWarp, sel[0]);
    const unsigned mask1 = __ballot_sync(kFullWarp, sel[1]);
    const int nsel = __popc(mask0) + __popc(mask1);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = lane + 32 * u, q = j + before[u];
      if (j < g && q < B) {
        gscore[nb * B + q] = gs_old[j];
        gmeta[nb * B + q] = gm_old[j];
        gpar[nb * B + q] = gp_old[j];
        gkey[nb * B + q] = gk[u];
      }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (!sel[t]) continue;
      const int lex = t == 0 ? __popc(mask0 & below) : __popc(mask0) + __popc(mask1 & below);
      const int q = nc[t];
      gscore[nb * B + q] = sc[t];
      gmeta[nb * B + q] = (uint32_t(d) << 16) | uint32_t(lex);
      gpar[nb * B + q] = (uint32_t(par[t]) << 16) | uint32_t(rk[t]);
      gkey[nb * B + q] = node_key(sc[t], d, uint32_t(lex));  // same order among depth d
      pos_of[(d - 1) * B + lex] = kNoPos;
      cscore[(st.csb ^ 1) * B + lex] = sc[t];
    }
    if (lane == 0) lvl_cnt[d] = nsel;
    st.g = g + M < B ? g + M : B;
    st.m = nsel;
    st.cur = nb;
    st.csb ^= 1;
    __syncwarp();
    // once G is full a deeper node must beat its worst score (a tie loses on depth)
    if (st.g == B) st.thr = fmaxf(st.thr, gscore[nb * B + B - 1]);
    if (nsel == 0) {
      st.status = kMergeDone;
      return st;
    }
  }
  st.status = kMergeDone;
  return st;
}

// ---------------------------------------------------------------------------------------------

// MODE: kModeLevel (the level-wise kernel), kModeMerge (its merge variant), kModeDeferred (its
// deferred variant: tree_build_params.h, kDeferMaxBudget).
// kModeDeferredWarp: the deferred variant with warp runs over narrow levels (defer_run).
constexpr int kModeLevel = 0, kModeMerge = 1, kModeDeferred = 2, kModeDeferredWarp = 3;

template <int MODE>
__global__ void __launch_bounds__(MODE == kModeMerge ? kMergeMaxThreads : 1024)
    tree_build_kernel(const TreeBuildParams p) {
  constexpr bool MERGE = MODE == kModeMerge;
  constexpr bool DEFER = MODE == kModeDeferred || MODE == kModeDeferredWarp;
  constexpr bool DEFER_WARP = MODE == kModeDeferredWarp;
  extern __shared__ __align__(16) unsigned char smem[];
  const int B = p.B, Kp = p.Kp, D = p.D, N = B + 1;
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int64_t b = blockIdx.x;
  // G's capacity, also the stride of its two buffers and of pos_of's rows
  const int GC = DEFER ? p.gcap : B;
  const SmemLayout L = make_smem_layout(B, Kp, D, GC);
  const LayoutInputs lin = load_layout_inputs(p, b);
  const bool preload = preload_rows(Kp, D);
  DDTREE_MARK_INIT;
  DDTREE_MARK(0);

  float* const lp_base = reinterpret_cast<float*>(smem + L.lp);
  int* off = reinterpret_cast<int*>(smem + L.off);
  float* gscore = reinterpret_cast<float*>(smem + L.gscore);
  uint32_t* gmeta = reinterpret_cast<uint32_t*>(smem + L.gmeta);
  uint32_t* gpar = reinterpret_cast<uint32_t*>(smem + L.gpar);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem + L.keys);
  uint64_t* thr_slot = reinterpret_cast<uint64_t*>(smem + L.thr);
  uint16_t* pos_of = reinterpret_cast<uint16_t*>(smem + L.posanc);
  unsigned char* layout_scratch = smem + L.posanc;  // the masks' scratch once pos_of is dead
  int* lvl_cnt = reinterpret_cast<int*>(smem + L.lvl_cnt);
  int* hist = reinterpret_cast<int*>(smem + L.hist);
  int* wbuf_i = reinterpret_cast<int*>(smem + L.wbuf);
  long long* wbuf_ll = reinterpret_cast<long long*>(smem + L.wbuf);
  float* wbuf_min = reinterpret_cast<float*>(smem + L.wbuf_min);
  int* p_parent = reinterpret_cast<int*>(smem + L.p_parent);
  int* p_depth = reinterpret_cast<int*>(smem + L.p_depth);
  int* p_sib = reinterpret_cast<int*>(smem + L.p_sib);
  int* first_child = reinterpret_cast<int*>(smem + L.first_child);
  uint64_t* gkey = reinterpret_cast<uint64_t*>(smem + L.gkey);  // MERGE only
  float* cscore = reinterpret_cast<float*>(smem + L.cscore);     // MERGE only
  int* mstate = reinterpret_cast<int*>(smem + L.mstate);         // MERGE only
  int* dhist = reinterpret_cast<int*>(smem + L.dhist);           // DEFER only
  float* thr_f = reinterpret_cast<float*>(smem + L.thrf);        // DEFER only
  int* d_fpub = reinterpret_cast<int*>(thr_f + 4);              // DEFER: the walker's bin
  int* d_inbox = reinterpret_cast<int*>(thr_f + 5);             // DEFER: nodes added <= it
  if constexpr (DEFER) {
    uint4* dh4 = reinterpret_cast<uint4*>(dhist);
    for (int q = tid; q < kDeferBins / 4; q += T) dh4[q] = make_uint4(0u, 0u, 0u, 0u);
    if (tid == 0) {
      thr_f[2] = -INFINITY;
      *d_fpub = kDeferBins - 1;
      *d_inbox = 0;
    }
  }

  // Same normalisation as tree._normalize_logp: NaN -> -inf (unreachable), log-probs > 0
  // (misuse) -> 0, -0 -> +0.
  if (preload) stage_logp_rows(p, b, Kp, 1, D, lp_base);  // made visible by the barrier inside the first level

  // Block-uniform state (every thread holds the same values).
  int cur = 0;        // G lives in buffer `cur`
  int g_size = 0;     // |G|
  int c_begin = 0;    // C_{d-1} = G[c_begin, c_begin + c_size), lexicographic order
  int c_size = 1;     // level 0 is the root alone
  float thr = -INFINITY;
  // DEFER (meaningful in the walker warp, which walks the histogram: warp 1, or warp 0 in a
  // one-warp block): the histogram's threshold bin and the nodes counted in bins 0..f_cur
  // (defer_walk); *thr_next: the threshold the walker found at this level (one slot: the next
  // level's walker writes it only after this level's later barriers)
  int f_cur = kDeferBins - 1, cnt_above = 0;
  const int walker = (DEFER_WARP || T < 64) ? 0 : 1;  // the warp runs walk in warp 0
  int* d_run = reinterpret_cast<int*>(thr_f + 6);    // DEFER_WARP: a run's result
  float* thr_next = thr_f + 2;
  // MERGE: whether G is sorted best first (with gkey), and whether C_{d-1}'s scores are in
  // cscore[csb] (after a merge run) rather than in G[c_begin, c_begin + c_size)
  bool g_sorted = true;  // the empty G
  bool c_in_cscore = false;
  int csb = 0;

  for (int d = 1; d <= D; ++d) {
    if (!preload) stage_logp_rows(p, b, Kp, d, 1, lp_base);
    // With every depth staged up front, the previous level's closing barrier already orders
    // its writes before this level's reads; the first level waits for the staging.
    if (!preload || d == 1) __syncthreads();
    DDTREE_MARK(100 * d);
    bool counted = false;  // MERGE: a merge run left this depth's off[] for the block
    if constexpr (MERGE) {
      // a merge run needs at most kMergeWidth parents; the root's candidates are the first
      // row's finite entries, more than kMergeWidth whenever Kp is, so depth 1 tries only when
      // Kp <= kMergeWidth
      if (c_size <= kMergeWidth && (d > 1 || Kp <= kMergeWidth)) {
        if (!g_sorted) {
          // sort G best first into the other buffer (rank = larger keys), C_{d-1} to cscore
          const float* gs0 = gscore + cur * GC;
          const uint32_t* gm0 = gmeta + cur * GC;
          const uint32_t* gp0 = gpar + cur * GC;
          for (int j = tid; j < g_size; j += T)
            keys[j] = node_key(gs0[j], int(gm0[j] >> 16), gm0[j] & 0xFFFFu);
          __syncthreads();
          const int nb = cur ^ 1;
          for (int j = tid; j < g_size; j += T) {
            const uint64_t kj = keys[j];
            const int q = count_larger(keys, g_size, kj);
            gscore[nb * B + q] = gs0[j];
            gmeta[nb * B + q] = gm0[j];
            gpar[nb * B + q] = gp0[j];
            gkey[nb * B + q] = kj;
          }
          if (!c_in_cscore) {
            for (int i = tid; i < c_size; i += T) cscore[(csb ^ 1) * B + i] = gs0[c_begin + i];
            csb ^= 1;
            c_in_cscore = true;
          }
          cur = nb;
          g_sorted = true;
          __syncthreads();
        }
        // the first radix pass's histogram, for a depth the run hands back (ordered by the
        // barrier below)
        for (int q = tid; q < 256; q += T) hist[q] = 0;
        if (warp == 0) {
          MergeState st{d, cur, g_size, c_size, csb, 0, thr};
          DDTREE_MARK(100 * d + 5);  // a merge run from depth d ...
          st = merge_run(st, D, Kp, B, lp_base, off, gscore, gmeta, gpar, gkey, cscore, pos_of,
                         lvl_cnt);
          DDTREE_MARK(100 * st.d + 6);  // ... up to depth st.d (done there, or handed back)
          if (lane == 0) {
            mstate[0] = st.d;
            mstate[1] = st.cur;
            mstate[2] = st.g;
            mstate[3] = st.m;
            mstate[4] = st.csb;
            mstate[5] = st.status;
            mstate[6] = int(__float_as_uint(st.thr));
          }
        }
        __syncthreads();
        const int status = mstate[5];
        cur = mstate[1];
        g_size = mstate[2];
        c_size = mstate[3];
        csb = mstate[4];
        thr = __uint_as_float(uint32_t(mstate[6]));
        c_in_cscore = true;
        if (status == kMergeDone) break;
        d = mstate[0];  // kMergePending: depth d's candidate offsets are in off[]
        counted = true;
      }
    }
    if constexpr (DEFER_WARP) {
      if (preload && c_size <= kRunMaxParents) {
        for (int q = tid; q < 256; q += T) hist[q] = 0;  // a counted level's first radix pass
        if (warp == 0) {
          DeferRun st{d, g_size, c_begin, c_size, 0, thr};
          DDTREE_MARK(100 * d + 5);  // a warp run from depth d ...
          st = defer_run(st, D, Kp, B, GC, lp_base, off, gscore + cur * GC, gmeta + cur * GC,
                         gpar + cur * GC, pos_of, lvl_cnt, dhist, f_cur, cnt_above, d_inbox,
                         d_fpub DDTREE_MARK_ARG);
          DDTREE_MARK(100 * st.d + 6);  // ... up to depth st.d
          if (lane == 0) {
            d_run[0] = st.d;
            d_run[1] = st.g;
            d_run[2] = st.cb;
            d_run[3] = st.cs;
            d_run[4] = st.status;
            d_run[5] = int(__float_as_uint(st.thr));
          }
        }
        __syncthreads();
        const int status = d_run[4];
        g_size = d_run[1];
        c_begin = d_run[2];
        c_size = d_run[3];
        thr = __uint_as_float(uint32_t(d_run[5]));
        if (status == kRunDone) break;
        d = d_run[0];
        counted = status == kRunCounted;  // else kRunHandBack: the block does level d
      }
    }
    const float* lp = preload ? lp_base + (d - 1) * Kp : lp_base;

    const float* gs_old = gscore + cur * GC;
    const uint32_t* gm_old = gmeta + cur * GC;
    const uint32_t* gp_old = gpar + cur * GC;
    float* gs_new = gscore + (cur ^ 1) * GC;
    uint32_t* gm_new = gmeta + (cur ^ 1) * GC;
    uint32_t* gp_new = gpar + (cur ^ 1) * GC;
    const int m = c_size;
    const int cb = c_begin;
    const float* ps = (MERGE && c_in_cscore) ? cscore + csb * B : gs_old + cb;
    auto parent_score = [&](int i) -> float { return d == 1 ? 0.0f : ps[i]; };

    // Candidate offsets: parent i owns flat indices [off[i], off[i+1]); contiguous parent ranges
    // per thread so that the flat order is the lexicographic order.
    if (!counted) {
      for (int q = tid; q < 256; q += T) hist[q] = 0;  // first radix pass's histogram
    }
    if (DEFER && !counted) {
      // This level prunes with the histogram's threshold over every node of depths < d (the
      // walker warp walks it, then a barrier), and at d = 2 also with the B-th best depth-1
      // score (exact: level 1 appended the depth-1 nodes, sorted, at G[0, g_size)). (Walking
      // during the count instead, one level behind, saved the barrier but pruned less: slower
      // on the H200, bench_results/README.md, session 10.)
      if (d == 2 && g_size >= B) thr = fmaxf(thr, gs_old[B - 1]);
      if (warp == walker) {
        defer_walk(dhist, B, lane, f_cur, cnt_above, d == 2 ? gs_old : nullptr, d_inbox, d_fpub);
        if (lane == 0) *thr_next = defer_tau(f_cur);
      }
      __syncthreads();
      thr = fmaxf(thr, *thr_next);
    }
    int M = 0;
    if (counted) {
      M = off[m];  // written by the merge run, before its barrier
    } else if (m <= 32) {
      // Narrow level (typical of deep trees): one warp scans, no block-wide scan.
      if (warp == 0) {
        const int cnt = lane < m ? count_above(parent_score(lane), lp, Kp, thr) : 0;
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(kFullWarp, incl, o);
          if (lane >= o) incl += y;
        }
        if (lane < m) off[lane] = incl - cnt;
        if (lane == 31) off[m] = incl;  // lanes >= m count 0: lane 31 holds the total
      }
      __syncthreads();
      M = off[m];
    } else {
      const int per = (m + T - 1) / T;
      const int i0 = min(m, tid * per), i1 = min(m, i0 + per);
      int nloc = 0;
      for (int i = i0; i < i1; ++i) {
        const int cnt = count_above(parent_score(i), lp, Kp, thr);
        off[i] = cnt;  // own slots only: turned into offsets below by the same thread
        nloc += cnt;
      }
      int run = block_exclusive_sum(nloc, wbuf_i, M);
      for (int i = i0; i < i1; ++i) {
        const int cnt = off[i];
        off[i] = run;
        run += cnt;
      }
      if (tid == 0) off[m] = M;
      __syncthreads();
    }
    DDTREE_MARK(100 * d + 1);
    if (M == 0) break;  // no depth-d node can enter the tree, hence none deeper either

    const int cper = (M + T - 1) / T;
    const int c0 = min(M, tid * cper), c1 = min(M, c0 + cper);
    const int i_first = c0 < c1 ? find_parent(off, m, c0) : 0;
    // This thread's candidates: fn(flat index c, parent i, rank r, score).
    auto each_candidate = [&](auto&& fn) {
      if (c0 < c1) {
        int i = i_first;
        for (int c = c0; c < c1; ++c) {
          while (off[i + 1] <= c) ++i;
          const int r = c - off[i];
          fn(c, i, r, parent_score(i) + lp[r]);
        }
      }
    };
    // Visit every item (old G members, then this thread's candidate range) with its key.
    auto visit = [&](auto&& fn) {
      for (int j = tid; j < g_size; j += T) {
        const uint32_t meta = gm_old[j];
        fn(node_key(gs_old[j], int(meta >> 16), meta & 0xFFFFu), true, j, 0, 0, 0.0f);
      }
      each_candidate([&](int c, int i, int r, float s) {
        fn(node_key(s, d, uint32_t(c)), false, c, i, r, s);
      });
    };

    // DEFER: while G has room, the candidates are appended in lexicographic order (they form
    // C_d, lex = flat index) and counted in the histogram; the best B are kept at the end.
    if constexpr (DEFER) {
      if (g_size + M <= GC) {
        float* gs_w = gscore + cur * GC;
        uint32_t* gm_w = gmeta + cur * GC;
        uint32_t* gp_w = gpar + cur * GC;
        const int fp = *d_fpub;
        int n_in = 0;
        each_candidate([&](int c, int i, int r, float s) {
          gs_w[g_size + c] = s;
          gm_w[g_size + c] = (uint32_t(d) << 16) | uint32_t(c);
          gp_w[g_size + c] = (uint32_t(i) << 16) | uint32_t(r);
          pos_of[(d - 1) * GC + c] = kNoPos;
          n_in += defer_count(dhist, s, fp);
        });
        defer_inbox_add(d_inbox, n_in, lane);
        if (tid == 0) lvl_cnt[d] = M;
        c_begin = g_size;
        c_size = M;
        g_size += M;
        __syncthreads();  // end of level
        DDTREE_MARK(100 * d + 4);
        continue;
      }
    }

    // Threshold key: the B-th largest key of G u candidates (0 = keep everything).
    uint64_t thr_key = 0;
    const bool select = g_size + M > B;
    const int n_tot = g_size + M;
    if (select && n_tot <= rank_select_limit(B)) {
      // Few items (typical of a deep, narrow level): rank each by counting the larger keys, in
      // two barriers, instead of up to eight radix passes. Keys are distinct (depth and
      // lexicographic index are part of them), so exactly one item has rank B - 1.
      visit([&](uint64_t key, bool is_g, int idx, int, int, float) {
        keys[is_g ? idx : g_size + idx] = key;
      });
      // an odd count gets a zero key after it (below every node key: never counted as larger)
      // so that the keys can be read two at a time; n_tot <= 128 <= the keys' slots
      if (tid == 0 && (n_tot & 1)) keys[n_tot] = 0;
      __syncthreads();
      // 16-byte reads, 16 keys in flight per thread (this phase: 3,100-4,700 cycles per depth at
      // budget 64 on the H200 with one 8-byte read at a time, 1,900-3,200 now:
      // scripts/tree_build_clocks.py)
      const ulonglong2* keys2 = reinterpret_cast<const ulonglong2*>(keys);
      const int n2 = (n_tot + 1) >> 1;
      for (int e = tid; e < n_tot; e += T) {
        const uint64_t k = keys[e];
        int g0 = 0, g1 = 0;
#pragma unroll 8
        for (int f = 0; f < n2; ++f) {
          const ulonglong2 x = keys2[f];
          g0 += x.x > k ? 1 : 0;
          g1 += x.y > k ? 1 : 0;
        }
        if (g0 + g1 == B - 1) *thr_slot = k;
      }
      __syncthreads();
      thr_key = *thr_slot;
    } else if (select) {
      uint64_t prefix = 0;
      int krem = B;
      bool done = false;
      // Three histograms in rotation, one barrier per pass: pass p counts into hist[p % 3]
      // (zeroed by pass p - 1, or above for p = 0) and zeroes hist[(p + 1) % 3], which was last
      // read by pass p - 2's pick, before pass p - 1's barrier.
      for (int shift = 56, p = 0; shift >= 0 && !done; shift -= 8, ++p) {
        int* h = hist + (p % 3) * 256;
        int* h_next = hist + ((p + 1) % 3) * 256;
        const uint64_t himask = shift == 56 ? 0ull : (~0ull << (shift + 8));
        for (int q = tid; q < 256; q += T) h_next[q] = 0;
        visit([&](uint64_t key, bool, int, int, int, float) {
          if ((key & himask) == prefix) atomicAdd(&h[int((key >> shift) & 0xFFu)], 1);
        });
        __syncthreads();
        const RadixPick pick = radix_pick_bin(h, krem);
        krem = pick.krem;
        prefix |= uint64_t(pick.bin) << shift;
        done = pick.cnt == krem;  // every key of this bin is taken: keys >= prefix are the top B
      }
      thr_key = prefix;
    }
    DDTREE_MARK(100 * d + 2);

    // Compaction into the other buffer: survivors of G, then the selected candidates in
    // lexicographic order (they form C_d). Both counts are <= B < 2^16: one packed scan.
    int n_surv = 0, n_sel = 0;
    visit([&](uint64_t key, bool is_g, int, int, int, float) {
      if (key >= thr_key) { if (is_g) ++n_surv; else ++n_sel; }
    });
    int packed_total = 0;
    const int packed = block_exclusive_sum((n_surv << 16) | n_sel, wbuf_i, packed_total);
    const int surv_total = packed_total >> 16, sel_total = packed_total & 0xFFFF;
    DDTREE_MARK(100 * d + 3);
    int ws = packed >> 16;
    int wc = packed & 0xFFFF;
    float my_min = INFINITY;
    const int fp = DEFER ? *d_fpub : 0;
    int n_in = 0;
    visit([&](uint64_t key, bool is_g, int idx, int i, int r, float s) {
      if (key < thr_key) return;
      if (is_g) {
        gs_new[ws] = gs_old[idx];
        gm_new[ws] = gm_old[idx];
        gp_new[ws] = gp_old[idx];
        my_min = fminf(my_min, gs_old[idx]);
        ++ws;
      } else {
        const int lex = wc++;
        const int slot = surv_total + lex;
        gs_new[slot] = s;
        gm_new[slot] = (uint32_t(d) << 16) | uint32_t(lex);
        gp_new[slot] = (uint32_t(i) << 16) | uint32_t(r);
        pos_of[(d - 1) * GC + lex] = kNoPos;
        if constexpr (DEFER) n_in += defer_count(dhist, s, fp);
        my_min = fminf(my_min, s);
      }
    });
    if (tid == 0) lvl_cnt[d] = sel_total;
    if constexpr (DEFER) defer_inbox_add(d_inbox, n_in, lane);
    g_size = surv_total + sel_total;
    c_begin = surv_total;
    c_size = sel_total;
    cur ^= 1;
    g_sorted = false;
    c_in_cscore = false;
    // Once G is full, a deeper node must score strictly above G's worst to get in. After a
    // selection every member's key is >= thr_key, whose top half bounds the worst score from
    // below (a looser threshold only lets through candidates that the selection then drops).
    if (select) {
      __syncthreads();  // end of level
      thr = fmaxf(thr, score_lower_bound(uint32_t(thr_key >> 32)));
    } else {
      // also the end-of-level barrier; its own buffer: the compaction scan's is still read
      const float g_min = block_min(my_min, wbuf_min);
      if (g_size == B) thr = g_min;
    }
    DDTREE_MARK(100 * d + 4);
    if (sel_total == 0) break;
  }
  __syncthreads();
  DDTREE_MARK(9000);

  // ---- Final order: output index of each member of G = 1 + number of better members (its index
  // + 1 when a merge run left G sorted). DEFER: G may hold more than B nodes; those with B or more
  // better members are not in the tree (pos_of stays kNoPos) and the tree is closed under
  // "parent of" (a parent beats its children).
  const int n = g_size;
  const int n_tree = n < B ? n : B;
  const float* gs = gscore + cur * GC;
  const uint32_t* gm = gmeta + cur * GC;
  const uint32_t* gp = gpar + cur * GC;
  const bool sorted_at_end = MERGE && g_sorted;  // block-uniform
  const int64_t* ids_b = p.ids + b * p.ids_sb;
  // the token of this thread's first member (j = tid), loaded now: the order below hides the
  // global load's latency
  int64_t tok_first = 0;
  if (tid < n) tok_first = ids_b[int64_t(int(gm[tid] >> 16) - 1) * p.ids_sd + int(gp[tid] & 0xFFFFu)];
  init_positions(N, p_parent, p_depth, p_sib, first_child);
  if (DEFER && n > B) {  // block-uniform (at most B nodes: all of them are the tree, as below)
    // Only nodes at or above the final threshold can be in the tree (B counted nodes score
    // strictly above the histogram's; a selection's bounds the B-th best score from below):
    // their keys, in any order (a count of larger keys does not depend on it),
    // take slots from a warp-aggregated counter; each of them counts the larger ones.
    int* live_cnt = reinterpret_cast<int*>(smem + L.thrf) + 1;
    if (warp == walker) {
      defer_walk(dhist, B, lane, f_cur, cnt_above, nullptr, d_inbox, d_fpub);
      if (lane == 0) {
        *thr_f = fmaxf(thr, defer_tau(f_cur));
        *live_cnt = 0;
      }
    }
    __syncthreads();
    const float thr_end = *thr_f;
    for (int j0 = 0; j0 < n; j0 += T) {  // block-uniform trip count: whole warps ballot
      const int j = j0 + tid;
      const bool live = j < n && gs[j] >= thr_end;
      const unsigned mask = __ballot_sync(kFullWarp, live);
      int base = 0;
      if (lane == 0 && mask != 0u) base = atomicAdd(live_cnt, __popc(mask));
      base = __shfl_sync(kFullWarp, base, 0);
      if (live)
        keys[base + __popc(mask & ((1u << lane) - 1u))] =
            node_key(gs[j], int(gm[j] >> 16), gm[j] & 0xFFFFu);
    }
    __syncthreads();
    const int n_live = *live_cnt;
    const ulonglong2* keys2 = reinterpret_cast<const ulonglong2*>(keys);
    // s threads per live key (a power of two up to 8 while s * n_live <= T: idle threads share
    // the count), each over every s-th pair of keys, summed over the s neighbouring lanes
    int sl = 0;  // log2 s
    while (sl < 3 && (n_live << (sl + 1)) <= T) ++sl;
    const int s = 1 << sl, npair = n_live >> 1;
    for (int t0 = 0; t0 < (n_live << sl); t0 += T) {  // block-uniform trip count
      const int t = t0 + tid, jj = t >> sl, part = t & (s - 1);
      const bool act = jj < n_live;
      const uint64_t k = act ? keys[jj] : 0;
      // 16-byte reads, two keys each; an odd count's last key alone (by part 0)
      int g0 = 0, g1 = 0;
      if (act) {
#pragma unroll 4
        for (int f = part; f < npair; f += s) {
          const ulonglong2 x = keys2[f];
          g0 += x.x > k ? 1 : 0;
          g1 += x.y > k ? 1 : 0;
        }
        if ((n_live & 1) && part == 0) g0 += keys[n_live - 1] > k ? 1 : 0;
      }
      int better = g0 + g1;
      for (int o = 1; o < s; o <<= 1) better += __shfl_xor_sync(kFullWarp, better, o);
      if (act && part == 0 && better < B) {
        // the key holds the node's depth and lex (node_key)
        const int dj = kMaxDepth - int((k >> kLexBits) & 0xFFFu);
        const int lex = int(kLexMask - uint32_t(k & kLexMask));
        pos_of[(dj - 1) * GC + lex] = uint16_t(1 + better);
      }
    }
  } else {
    if (!sorted_at_end)
      for (int j = tid; j < n; j += T) keys[j] = node_key(gs[j], int(gm[j] >> 16), gm[j] & 0xFFFFu);
    __syncthreads();
    for (int j = tid; j < n; j += T) {
      int better = j;
      if (!sorted_at_end) better = count_larger(keys, n, keys[j]);
      pos_of[(int(gm[j] >> 16) - 1) * GC + int(gm[j] & 0xFFFFu)] = uint16_t(1 + better);
    }
  }
  __syncthreads();
  DDTREE_MARK(9001);

  int64_t* tokens = p.tokens + b * N;
  int64_t* parents = p.parents + b * N;
  int64_t* depths = p.depths + b * N;
  bool* valid = p.valid + b * N;
  float* scores = p.scores + b * N;
  for (int j = tid; j < n; j += T) {
    const int dj = int(gm[j] >> 16), lex = int(gm[j] & 0xFFFFu);
    const int plex = int(gp[j] >> 16), r = int(gp[j] & 0xFFFFu);
    const int pos = pos_of[(dj - 1) * GC + lex];
    if (DEFER && pos == kNoPos) continue;  // not among the best B
    const int par = dj == 1 ? 0 : int(pos_of[(dj - 2) * GC + plex]);  // parents are in the tree
    p_parent[pos] = par;
    p_depth[pos] = dj;
    if (r == 0) first_child[par] = pos;  // rank 0 is the best, hence first, child
    tokens[pos] = j == tid ? tok_first : ids_b[int64_t(dj - 1) * p.ids_sd + r];
    parents[pos] = par;
    depths[pos] = dj;
    valid[pos] = true;
    scores[pos] = gs[j];
  }
  __syncthreads();
  DDTREE_MARK(9002);
  // Next sibling of p.r is p.(r+1) if it is in the tree: siblings in the tree are a rank prefix,
  // and p.(r+1) directly follows p.r in its depth's lexicographic order.
  for (int j = tid; j < n; j += T) {
    const int dj = int(gm[j] >> 16), lex = int(gm[j] & 0xFFFFu);
    const int pos = pos_of[(dj - 1) * GC + lex];
    if (DEFER && pos == kNoPos) continue;
    if (lex + 1 < lvl_cnt[dj]) {
      const int q = pos_of[(dj - 1) * GC + lex + 1];
      if (q != kNoPos && p_parent[q] == p_parent[pos]) p_sib[pos] = q;
    }
  }
  __syncthreads();

  // pos_of is dead: its space holds the masks' scratch now.
  DDTREE_MARK(9003);
  write_tree_layout(p, b, N, D, n_tree, p_parent, p_depth, first_child, p_sib, layout_scratch,
                    wbuf_ll, lin DDTREE_MARK_ARG);
  DDTREE_MARK(9009);
}

// ---------------------------------------------------------------------------------------------
// Best-first ("frontier") kernel for small budgets: warp 0 of the block pops the tree's nodes in
// the total order, one per iteration, exactly like the reference's heap (build_tree_reference):
// popping node x pushes its first child (rank 0, one depth down) and its next sibling (same
// parent, rank + 1). Each pushed node follows its generator in the total order (log-probs are
// <= 0 and every row is sorted descending), so the i-th pop is output position i.
//
// The frontier (at most B + 1 nodes: every pop removes one and adds at most two) is a list kept
// sorted in the total order, in registers: position q in slot q % ITEMS of lane q / ITEMS. A pop
// takes position 0 and merges the popped node's successors in: each new position reads the old
// entry one place to its right, at it, or one to its left (two shuffles bring the neighbours'
// boundary entries), and the successors' positions are two warp sums of "entries before it".
// An entry is two words, (ordered score bits) and (63 - depth, rank, record id); the record in
// shared memory holds what only a pop needs (parent, previous sibling, parent score). When two
// entries have the same score and depth (exact ties), the comparison walks both rank paths up
// in shared memory.

__device__ __forceinline__ float score_from_bits(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);  // ordered_bits^-1
}

__device__ __forceinline__ uint32_t depth_word(int depth) { return uint32_t(kMaxDepth - depth) << 26; }

// Rank-path order of two distinct unpopped nodes of the same depth, given by (parent position,
// rank): walk both up to their common ancestor and compare the ranks just below it.
__device__ __forceinline__ bool path_before(int pa, int ra, int pb, int rb, const int* p_parent,
                                            const int* p_rank) {
  while (pa != pb) {
    ra = p_rank[pa];
    rb = p_rank[pb];
    pa = p_parent[pa];
    pb = p_parent[pb];
  }
  return ra < rb;
}

// At most kFrontierMaxThreads threads per block (the launcher clamps): the register-resident
// frontier needs more than the 64 registers per thread that 1024 threads would leave.
template <int ITEMS>
__global__ void __launch_bounds__(kFrontierMaxThreads, 1) tree_build_frontier_kernel(const TreeBuildParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int B = p.B, Kp = p.Kp, D = p.D, N = B + 1;
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31;
  const int64_t b = blockIdx.x;
  const FrontierSmemLayout L = make_frontier_smem_layout(B, Kp, D);
  const LayoutInputs lin = load_layout_inputs(p, b);
  float* lp = reinterpret_cast<float*>(smem + L.lp);
  int* p_parent = reinterpret_cast<int*>(smem + L.p_parent);
  int* p_depth = reinterpret_cast<int*>(smem + L.p_depth);
  int* p_rank = reinterpret_cast<int*>(smem + L.p_rank);
  int* p_sib = reinterpret_cast<int*>(smem + L.p_sib);
  int* first_child = reinterpret_cast<int*>(smem + L.first_child);
  float* p_score = reinterpret_cast<float*>(smem + L.score);
  unsigned char* layout_scratch = smem + L.anc;
  uint32_t* rec_link = reinterpret_cast<uint32_t*>(smem + L.rec_link);
  float* rec_ps = reinterpret_cast<float*>(smem + L.rec_ps);
  int* misc = reinterpret_cast<int*>(smem + L.misc);
  long long* wbuf_ll = reinterpret_cast<long long*>(smem + L.wbuf);
  DDTREE_MARK_INIT;
  DDTREE_MARK(0);

  stage_logp_rows(p, b, Kp, 1, D, lp);  // every depth
  init_positions(N, p_parent, p_depth, p_sib, first_child);
  __syncthreads();
  DDTREE_MARK(100);

  if (tid < 32) {
    // The frontier as a list sorted in the total order (best first): position q in slot
    // q % ITEMS of lane q / ITEMS; positions >= len hold empty entries (key 0). An entry is two
    // words: hi = ordered score bits, lo = (63 - depth) << 26 | rank << 16 | record id. The
    // record (shared memory) holds what only a pop needs: parent position, previous sibling's
    // position, parent score.
    uint32_t khi[ITEMS], klo[ITEMS];
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      khi[j] = 0u;
      klo[j] = 0u;
    }
    int len = 0;
    {
      const float s0 = 0.0f + lp[0];  // the root's first child: record 0
      if (s0 > -INFINITY) {
        if (lane == 0) {
          khi[0] = ordered_bits(s0);
          klo[0] = depth_word(1);
        }
        len = 1;
      }
      if (lane == 0) {
        rec_link[0] = 0u;
        rec_ps[0] = 0.0f;
      }
      __syncwarp();
    }
    int nrec = 1;
    int n = 0;
    for (int pos = 1; pos <= B && len > 0; ++pos) {
      // pop the head (position 0: lane 0, slot 0)
      const uint32_t hhi = __shfl_sync(kFullWarp, khi[0], 0);
      const uint32_t hlo = __shfl_sync(kFullWarp, klo[0], 0);
      // the neighbours' boundary entries, for the shift below (independent of the new keys)
      const uint32_t phi = __shfl_up_sync(kFullWarp, khi[ITEMS - 1], 1);
      const uint32_t plo = __shfl_up_sync(kFullWarp, klo[ITEMS - 1], 1);
      uint32_t nhi = __shfl_down_sync(kFullWarp, khi[0], 1);
      uint32_t nlo = __shfl_down_sync(kFullWarp, klo[0], 1);
      if (lane == 31) {  // nothing follows the last slot
        nhi = 0u;
        nlo = 0u;
      }
      const int depth = kMaxDepth - int(hlo >> 26), rank = int((hlo >> 16) & 0x3FFu);
      const uint32_t link = rec_link[hlo & 0xFFFFu];
      const float hps = rec_ps[hlo & 0xFFFFu];
      const int parent = int(link & 0xFFFFu);
      const float score = score_from_bits(hhi);
      // successors: first child (depth + 1, rank 0) and next sibling (same parent, rank + 1);
      // -inf ones are never pushed, as in the reference
      const float cs = depth < D ? score + lp[depth * Kp] : -INFINITY;
      const float ss = rank + 1 < Kp ? hps + lp[(depth - 1) * Kp + rank + 1] : -INFINITY;
      const int id_c = nrec, id_s = nrec + 1;
      nrec += 2;
      if (lane == 0) {  // predicated stores: fixed offsets keep this branch-free
        p_parent[pos] = parent;
        p_depth[pos] = depth;
        p_rank[pos] = rank;
        p_score[pos] = score;
        *(rank == 0 ? first_child + parent : p_sib + int(link >> 16)) = pos;
        rec_link[id_c] = uint32_t(pos);
        rec_ps[id_c] = score;
        rec_link[id_s] = uint32_t(parent) | (uint32_t(pos) << 16);
        rec_ps[id_s] = hps;
      }
      __syncwarp();  // later pops read these records; the tie walk below may pass this node
      n = pos;

      const bool has_c = cs > -INFINITY, has_s = ss > -INFINITY;
      const uint32_t c_hi = ordered_bits(cs), s_hi = ordered_bits(ss);
      const uint32_t c_lo = depth_word(depth + 1) | uint32_t(id_c);
      const uint32_t s_lo = (hlo & 0xFC000000u) | (uint32_t(rank + 1) << 16) | uint32_t(id_s);
      // A = the better of the two (a child never ties its uncle: the depths differ)
      const bool c_first = has_c && (!has_s || c_hi > s_hi);
      const bool has_a = has_c || has_s, has_b = has_c && has_s;
      const uint32_t a_hi = c_first ? c_hi : s_hi, b_hi = c_first ? s_hi : c_hi;
      const uint32_t a_lo = c_first ? c_lo : s_lo, b_lo = c_first ? s_lo : c_lo;
      const int a_par = c_first ? pos : parent, b_par = c_first ? parent : pos;

      // new positions of A and B: the entries (head excluded) before them, plus A for B. Keys
      // with the same score and depth (bits 26 and up) are exact ties of the total order's
      // first two keys: the rank paths decide (a walk a warp vote skips when no lane has one).
      const uint64_t ka = (uint64_t(a_hi) << 32) | a_lo, kb = (uint64_t(b_hi) << 32) | b_lo;
      int ca = 0, cb = 0;
      bool tie = false;
#pragma unroll
      for (int j = 0; j < ITEMS; ++j) {
        const int q = lane * ITEMS + j;
        const bool live = q >= 1 && q < len;
        const uint64_t ek = (uint64_t(khi[j]) << 32) | klo[j];
        const bool ta = ((ek ^ ka) >> 26) == 0, tb = ((ek ^ kb) >> 26) == 0;
        ca += live && has_a && !ta && ek > ka ? 1 : 0;
        cb += live && has_b && !tb && ek > kb ? 1 : 0;
        tie = tie || (live && ((has_a && ta) || (has_b && tb)));
      }
      if (__any_sync(kFullWarp, tie)) {
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
          const int q = lane * ITEMS + j;
          const uint64_t ek = (uint64_t(khi[j]) << 32) | klo[j];
          if (q < 1 || q >= len) continue;
          const int e_par = int(rec_link[klo[j] & 0xFFFFu] & 0xFFFFu);
          const int e_rank = int((klo[j] >> 16) & 0x3FFu);
          if (has_a && ((ek ^ ka) >> 26) == 0 &&
              path_before(e_par, e_rank, a_par, int((a_lo >> 16) & 0x3FFu), p_parent, p_rank))
            ++ca;
          if (has_b && ((ek ^ kb) >> 26) == 0 &&
              path_before(e_par, e_rank, b_par, int((b_lo >> 16) & 0x3FFu), p_parent, p_rank))
            ++cb;
        }
      }
      const int pa = has_a ? int(__reduce_add_sync(kFullWarp, unsigned(ca))) : (1 << 30);
      const int pb = has_b ? int(__reduce_add_sync(kFullWarp, unsigned(cb))) + 1 : (1 << 30);

      // rebuild: new position q holds A, B, or the old entry at q + 1 - (new keys before q),
      // chosen by selects on values (indexing by that count would put the list in local memory)
      uint32_t xhi[ITEMS], xlo[ITEMS];
#pragma unroll
      for (int j = 0; j < ITEMS; ++j) {
        const int q = lane * ITEMS + j;
        const int nb = (pa < q ? 1 : 0) + (pb < q ? 1 : 0);
        const int jr = j + 1 < ITEMS ? j + 1 : ITEMS - 1, jl = j >= 1 ? j - 1 : 0;
        const uint32_t rh = j + 1 < ITEMS ? khi[jr] : nhi, lh = j >= 1 ? khi[jl] : phi;
        const uint32_t rl = j + 1 < ITEMS ? klo[jr] : nlo, ll = j >= 1 ? klo[jl] : plo;
        uint32_t h = nb == 0 ? rh : (nb == 1 ? khi[j] : lh);
        uint32_t l = nb == 0 ? rl : (nb == 1 ? klo[j] : ll);
        if (q == pa) { h = a_hi; l = a_lo; }
        if (q == pb) { h = b_hi; l = b_lo; }
        xhi[j] = h;
        xlo[j] = l;
      }
#pragma unroll
      for (int j = 0; j < ITEMS; ++j) {
        khi[j] = xhi[j];
        klo[j] = xlo[j];
      }
      len += (has_a ? 1 : 0) + (has_b ? 1 : 0) - 1;
      DDTREE_MARK(1000 + pos);
    }
    if (lane == 0) misc[0] = n;
  }
  __syncthreads();
  DDTREE_MARK(9000);

  const int n = misc[0];
  int64_t* tokens = p.tokens + b * N;
  const int64_t* ids_b = p.ids + b * p.ids_sb;
  for (int q = 1 + tid; q <= n; q += T) {
    const int dq = p_depth[q];
    tokens[q] = ids_b[int64_t(dq - 1) * p.ids_sd + p_rank[q]];
    p.parents[b * N + q] = p_parent[q];
    p.depths[b * N + q] = dq;
    p.valid[b * N + q] = true;
    p.scores[b * N + q] = p_score[q];
  }
  DDTREE_MARK(9003);
  write_tree_layout(p, b, N, D, n, p_parent, p_depth, first_child, p_sib, layout_scratch, wbuf_ll,
                    lin DDTREE_MARK_ARG);
  DDTREE_MARK(9009);
}

// The entry point of kernel `index` (tree_kernel_index in tree_build_params.h).
using TreeKernelFn = void (*)(TreeBuildParams);
inline TreeKernelFn tree_kernel_fn(int index) {
  switch (index) {
    case 1: return tree_build_frontier_kernel<1>;
    case 2: return tree_build_frontier_kernel<2>;
    case 3: return tree_build_frontier_kernel<3>;
    case 4: return tree_build_frontier_kernel<5>;
    case 5: return tree_build_frontier_kernel<9>;
    case kMergeKernelIndex: return tree_build_kernel<kModeMerge>;
    case kDeferKernelIndex: return tree_build_kernel<kModeDeferred>;
    case kDeferWarpKernelIndex: return tree_build_kernel<kModeDeferredWarp>;
    default: return tree_build_kernel<kModeLevel>;
  }
}

}  // namespace ddtree
