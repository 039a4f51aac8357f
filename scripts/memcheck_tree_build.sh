#!/usr/bin/env bash
# compute-sanitizer (memcheck, then racecheck and synccheck for the shared-memory barriers) on a
# small parity run of the fused tree-build kernels (level-wise, frontier, merge, deferred) against the CPU oracle. Exit status 0 = clean.
# Usage: bash scripts/memcheck_tree_build.sh   (PYTHON, COMPUTE_SANITIZER override the tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tests._tree_inputs
# one cudaMalloc per tensor, so that memcheck sees writes past a tensor's end
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SCRIPT=$(mktemp /tmp/tree_build_parity.XXXXXX.py)
trap 'rm -f "$SCRIPT"' EXIT
cat >"$SCRIPT" <<'PYEOF'
import sys
import torch
from sglang_ddtree import tree_backend
from sglang_ddtree.tree import DraftTree, build_tree_reference
from tests._tree_inputs import random_inputs
tree_backend._loader().load_tree_build_ext(required=True)
if "--build-only" in sys.argv:
    sys.exit(0)
n = 0
# (bs, budget, D, K, quant, p_ninf, threads): preload and per-depth row paths, ties, -inf, 1..1024
for bs, budget, depth, k, quant, p_ninf, threads in [
        (3, 1, 4, 3, None, 0.0, 0), (4, 64, 15, 64, None, 0.0, 0), (3, 64, 15, 64, 4.0, 0.3, 64),
        (2, 300, 6, 300, 4.0, 0.0, 0), (1, 1024, 9, 1024, None, 0.0, 0), (2, 33, 40, 5, None, 0.5, 32)]:
    g = torch.Generator().manual_seed(budget + bs)
    roots, lp, ids = random_inputs(bs, depth, k, max(64, 2 * k), g, quant=quant, p_ninf=p_ninf)
    seq = torch.randint(0, 50, (bs,), generator=g)
    n_nodes = budget + 1
    flat = torch.zeros(int((n_nodes * (seq + n_nodes)).sum()), dtype=torch.bool, device="cuda")
    pos = torch.empty(bs, n_nodes, dtype=torch.int64, device="cuda")
    ref = build_tree_reference(roots, lp, ids, budget)
    for algo in (1, 2, 3, 4, 5):  # level-wise, frontier, merge, deferred, deferred_warp
        out = tree_backend.build_tree_cuda(roots.cuda(), lp.cuda(), ids.cuda(), budget,
                                           DraftTree.empty(bs, budget, "cuda"),
                                           seq_lens=seq.cuda(), positions=pos, full_mask=flat,
                                           threads=threads, algo=algo)
        for name, v in ref.tensors().items():
            assert torch.equal(v, getattr(out, name).cpu()), (bs, budget, algo, name)
        n += 1
print(f"parity ok on {n} cases")
PYEOF
"$PY" "$SCRIPT" --build-only  # JIT build / cache load outside the sanitizer
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  "$CS" --tool "$tool" --error-exitcode 1 --print-limit 20 "$PY" "$SCRIPT"
done
echo "compute-sanitizer: memcheck, racecheck, synccheck clean"
