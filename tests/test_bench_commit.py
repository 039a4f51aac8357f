"""scripts/bench_commit.py on the CPU (eager paths, no graphs): the script runs end to end,
both paths agree, and the JSON has every point."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))


def test_dry_run_on_cpu(tmp_path):
    import bench_commit

    out = tmp_path / "c.json"
    assert bench_commit.main(["--out", str(out), "--batch-sizes", "1,3", "--budgets", "9",
                              "--layers", "2", "--depth", "4", "--iters", "2", "--repeats", "1",
                              "--device", "cpu", "--walk", "torch"]) == 0
    res = json.loads(out.read_text())
    assert res["ops_walk"] == "accept_walk" and len(res["results"]) == 2
    for row in res["results"]:
        assert row["equal"], row
        assert row["ops"]["host_us"] > 0 and row["fused"]["host_us"] > 0
        assert row["accepted_mean"] >= 1  # the deepest path: at least one draft accepted
    assert {r["bs"] for r in res["results"]} == {1, 3}


def test_deepest_path_tokens_walk_to_the_deepest_node():
    import torch

    import bench_commit
    from sglang_ddtree.accept import accept_walk_reference

    roots, logp, ids = bench_commit.make_topk(2, 5, 3, 50, "peaked", seed=1, device="cpu")
    from sglang_ddtree.tree import build_tree

    tree = build_tree(roots, logp, ids, 12)
    pred = bench_commit.deepest_path_tokens(tree)
    acc, _, _ = accept_walk_reference(tree, pred, 5)
    assert torch.equal(acc, tree.depths.max(dim=1).values)
