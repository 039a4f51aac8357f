// Checks two warp-run helpers against direct computations:
// - ddtree::count_above (the radix-8 child count) vs a linear count, on rows the kernel can meet:
//   sorted descending, -inf tails, runs of equal values, thresholds equal to a row's sums;
// - ddtree::warp_hist_add (one atomic per run of equal bins in consecutive active lanes) vs one
//   count per active lane, on one emulated warp: runs of equal bins, a bin repeated after another,
//   active lanes a prefix of every length 0-32 (the helper's precondition: the warp runs'
//   candidates c < M).
// Usage: count_driver SEED CASES; prints the mismatches (0 expected) and the checks, exits 1 on
// any mismatch.
#include "cuda_emu.h"

#include <cstdio>
#include <random>

namespace ddtree {
alignas(16) unsigned char smem[16];
}
#include "tree_build_kernel.cuh"

int main(int argc, char** argv) {
  if (argc != 3) { fprintf(stderr, "usage: count_driver SEED CASES\n"); return 2; }
  std::mt19937 rng(static_cast<unsigned>(atoi(argv[1])));
  const int cases = atoi(argv[2]);
  const int sizes[] = {1, 2, 7, 8, 9, 63, 64, 65, 127, 128, 255, 256, 511, 512, 513, 1023, 1024};
  std::vector<float> lp;
  long bad = 0, checked = 0;
  for (int c = 0; c < cases; ++c) {
    const int Kp = sizes[c % (sizeof(sizes) / sizeof(sizes[0]))];
    lp.resize(Kp);
    // a few distinct values repeated (ties), a -inf tail sometimes
    std::uniform_int_distribution<int> levels(1, 6);
    const int nlev = levels(rng);
    std::uniform_real_distribution<float> u(-20.0f, 0.0f);
    for (int r = 0; r < Kp; ++r) lp[r] = nlev < 4 ? std::round(u(rng) * 4.0f) / 4.0f : u(rng);
    std::sort(lp.begin(), lp.end(), [](float a, float b) { return a > b; });
    if (c % 3 == 0) {
      std::uniform_int_distribution<int> cut(0, Kp);
      for (int r = cut(rng); r < Kp; ++r) lp[r] = -INFINITY;
    }
    const float ps = c % 5 == 0 ? 0.0f : u(rng);
    // thresholds: every row sum (ties with the row), its neighbours, and the extremes
    std::vector<float> thrs = {-INFINITY, INFINITY, 0.0f, ps - 40.0f};
    for (int r = 0; r < Kp; ++r) {
      const float s = ps + lp[r];
      thrs.push_back(s);
      thrs.push_back(std::nextafter(s, -INFINITY));
      thrs.push_back(std::nextafter(s, INFINITY));
    }
    for (float thr : thrs) {
      int want = 0;
      for (int r = 0; r < Kp; ++r) want += ps + lp[r] > thr ? 1 : 0;
      const int got = ddtree::count_above(ps, lp.data(), Kp, thr);
      ++checked;
      if (got != want) {
        if (bad < 10) fprintf(stderr, "Kp=%d ps=%g thr=%g: got %d want %d\n", Kp, ps, thr, got, want);
        ++bad;
      }
    }
  }
  // warp_hist_add: each case a warp's (active, bin) per lane
  struct HistCase {
    const std::vector<int>* bins;
    const std::vector<int>* act;
    int* hist;
  };
  std::uniform_int_distribution<int> nbins(1, 6), pick(0, 7), coin(0, 3);  // coin: a new run
  for (int c = 0; c < cases; ++c) {
    std::vector<int> bins(32), act(32);
    const int spread = nbins(rng);
    int b = pick(rng);
    for (int l = 0; l < 32; ++l) {
      if (coin(rng) == 0) b = (b + 1 + pick(rng)) % (spread + 4);  // a new run, maybe a repeat
      bins[l] = b;
      act[l] = l < c % 33;
    }
    std::vector<int> hist(16, 0), want(16, 0);
    for (int l = 0; l < 32; ++l) want[bins[l]] += act[l];
    const HistCase hc{&bins, &act, hist.data()};
    emu_launch([](const HistCase& h) {
      const int lane = int(threadIdx.x) & 31;
      ddtree::warp_hist_add(h.hist, (*h.act)[lane] != 0, (*h.bins)[lane], lane);
    }, 1, 32, hc);
    ++checked;
    if (hist != want) {
      if (bad < 10) fprintf(stderr, "warp_hist_add case %d: histogram differs\n", c);
      ++bad;
    }
  }
  printf("%ld %ld\n", bad, checked);
  return bad == 0 ? 0 : 1;
}
