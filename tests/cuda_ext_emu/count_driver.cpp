// Checks ddtree::count_above (the radix-8 child count) against a linear count on rows that the
// kernel can meet: sorted descending, -inf tails, runs of equal values, thresholds equal to a
// row's sums. Usage: count_driver SEED CASES; prints the number of mismatches (0 expected) and
// exits 1 on any.
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
  printf("%ld %ld\n", bad, checked);
  return bad == 0 ? 0 : 1;
}
