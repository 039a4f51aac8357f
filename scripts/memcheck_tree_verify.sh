#!/usr/bin/env bash
# compute-sanitizer memcheck on the Triton tree-verify attention kernels: MHA (GQA) and MLA
# (bf16, and fp8 KV), paged KV (page 16, prefixes not a multiple of it, incl. length 1), eager
# and CUDA-graph replays checked against the fp32 reference (sglang-ddtree doctor's check).
# Short contexts run unsplit; the 2,000-key cases take the split-K path and its reduce kernel
# (MHA's per-split reduce, MLA's chunked one), which the script requires. Where FlashMLA runs,
# two cases with the prefix on it (SGLANG_DDTREE_MLA_PREFIX=flashmla) run after them, with
# PyTorch's caching allocator (FlashMLA allocates while a graph captures). Two drafter
# block cases (GQA 8:1, all-ones mask: SGLANG_DDTREE_DRAFT_ATTENTION=triton) run too, and two
# cases planned for 131,072 tokens as a long-context server plans them: more than 32 splits,
# whose reduce sums all splits in one step (session 25); the script requires one.
# Exit status 0 = clean and within tolerance.
# Usage: bash scripts/memcheck_tree_verify.sh   (PYTHON, COMPUTE_SANITIZER override the tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
# one cudaMalloc per tensor, so that memcheck sees accesses past a tensor's end
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SCRIPT=$(mktemp /tmp/tree_verify_memcheck.XXXXXX.py)
trap 'rm -f "$SCRIPT"' EXIT
cat >"$SCRIPT" <<'PYEOF'
import sys
from sglang_ddtree.doctor import _check_case, default_kernels
bad = 0
split = set()
# (kernel, budget, batch, max context[, planned context]): budget+1 not a power of two, a
# 1-token prefix in each
cases = [("mha", 32, 3, 300), ("mla", 16, 3, 300), ("mla_fp8", 8, 2, 200),
         ("mha", 8, 1, 2000), ("mla", 32, 1, 2000), ("mla_fp8", 8, 2, 2000),
         # the drafter's block (SGLANG_DDTREE_DRAFT_ATTENTION=triton; budget = block size)
         ("draft", 8, 2, 300), ("draft", 16, 1, 2000),
         # planned for a long-context server: > 32 splits, the one-step reduce
         ("mha", 8, 1, 2000, 131072), ("draft", 16, 1, 2000, 131072)]
if sys.argv[1:] == ["flashmla"]:  # the prefix on FlashMLA (Hopper), pages of 64
    cases = [("mla_flashmla", 16, 3, 300), ("mla_flashmla", 32, 2, 2000)]
wide = 0
for kernel, budget, bs, ctx, *plan in cases:
    r = _check_case(kernel, budget, bs, ctx, 16, 2, seed=budget, plan_context=sum(plan))
    print(kernel, budget, bs, ctx, "planned", max(ctx, sum(plan)), "splits", r.num_splits,
          r.status, r.rel_err_vs_reference, r.detail)
    bad += r.status != "pass"
    if r.num_splits > 1 and kernel != "mla_flashmla":
        split.add(kernel[:3])
    wide += kernel in ("mha", "draft") and r.num_splits > 32
if sys.argv[1:] == ["flashmla"]:
    sys.exit(1 if bad else 0)
if {"mha", "mla"} - split:
    print("split-K path not covered for", {"mha", "mla"} - split)
    bad += 1
if not wide:
    print("no launch of more than 32 splits (the one-step reduce) ran")
    bad += 1
sys.exit(1 if bad else 0)
PYEOF
"$PY" "$SCRIPT"  # Triton JIT outside the sanitizer (cache reused inside)
echo "== compute-sanitizer --tool memcheck"
"$CS" --tool memcheck --error-exitcode 1 --print-limit 20 "$PY" "$SCRIPT"
echo "compute-sanitizer: memcheck clean on the tree-verify kernels"
# FlashMLA allocates its outputs inside the captured graph, which the uncached allocator
# cannot do while a stream captures (session 26: cudaErrorStreamCaptureUnsupported): those
# cases run with PyTorch's caching allocator, so memcheck sees accesses past the pool's blocks,
# not past each tensor (our kernels' own bounds are checked by the cases above).
if "$PY" -c "import sys; from sglang_ddtree.doctor import default_kernels; sys.exit('mla_flashmla' not in default_kernels())"; then
  echo "== compute-sanitizer --tool memcheck, prefix on FlashMLA (caching allocator)"
  env -u PYTORCH_NO_CUDA_MEMORY_CACHING "$PY" "$SCRIPT" flashmla
  env -u PYTORCH_NO_CUDA_MEMORY_CACHING "$CS" --tool memcheck --error-exitcode 1 --print-limit 20 "$PY" "$SCRIPT" flashmla
  echo "compute-sanitizer: memcheck clean with the prefix on FlashMLA"
fi
