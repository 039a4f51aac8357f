"""scripts/bench_tree_verify.py's host-side parts: the roofline reading (pure arithmetic on a
results JSON), the --kernel-times summary and the --merge-sweep bookkeeping."""

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "bench_tree_verify", os.path.join(HERE, "..", "scripts", "bench_tree_verify.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_roofline_memory_and_compute_bound_points(bench):
    # 1 GB of KV in 1000 us at 100 TFLOP/s: 1e11 FLOP, 100 FLOP/B; memory roof 250 us at 4000 GB/s
    mem = bench.roofline({"kv_bytes": 1e9, "ours_us": 1000.0, "TFLOPs": 100.0}, 4000.0, 1000.0)
    assert mem == {"flop_per_byte": 100.0, "bound": "memory", "roofline_us": 250.0,
                   "frac_of_roofline": 0.25, "max_frac_copy_bw": 1.0}
    # 1e12 FLOP on the same bytes: compute roof 1000 us at 1000 TFLOP/s, bandwidth at most 25 %
    comp = bench.roofline({"kv_bytes": 1e9, "ours_us": 2000.0, "TFLOPs": 500.0}, 4000.0, 1000.0)
    assert comp["bound"] == "compute" and comp["roofline_us"] == 1000.0
    assert comp["frac_of_roofline"] == 0.5 and comp["max_frac_copy_bw"] == 0.25


def test_roofline_table_reads_the_committed_results(bench):
    import json

    path = os.path.join(HERE, "..", "bench_results", "tree_verify_h200.json")
    data = json.load(open(path))
    table = bench.roofline_table(data)
    assert table.count("\n| mha |") + table.count("\n| mla |") == len(data["results"])
    assert "datasheet" in table


def test_kernels_dir_imports_another_checkouts_kernels(bench, tmp_path):
    """--kernels-dir: the three kernel modules of another triton_kernels/ directory (an A/B of
    kernel versions), imported under a private name so this checkout's stay untouched."""
    import shutil

    src = os.path.join(HERE, "..", "triton_kernels")
    # the whole directory, as another checkout has it (tree_attention_plan imports _device)
    for name in os.listdir(src):
        if name.endswith(".py"):
            shutil.copy(os.path.join(src, name), tmp_path / name)
    (tmp_path / "tree_attention.py").write_text(
        (tmp_path / "tree_attention.py").read_text() + "\nVARIANT_MARK = 7\n")
    ref, ta, mla = bench._import_ours(str(tmp_path))
    assert ta.VARIANT_MARK == 7 and ta.__file__.startswith(str(tmp_path))
    assert mla.TreeAttentionMLA.__mro__[1] is ta.TreeAttention  # its own base, not ours
    assert hasattr(ref, "tree_attention_reference")


def test_reduce_chunk_overrides_the_served_rule_and_restores_it(bench):
    """--reduce-chunks: inside ``reduce_chunk`` a launch's reduce sums ``chunk`` splits a step
    whatever its width and split count; the served rule is back afterwards, also after an
    error inside."""
    from tests.triton_kernels import load_kernels

    ta = load_kernels(interpret=True).tree_attention
    served = ta._reduce_chunk
    with bench.reduce_chunk(ta, 64):
        assert ta._reduce_chunk(512, 3) == 64 and ta._reduce_chunk(128) == 64
    assert ta._reduce_chunk is served and ta._reduce_chunk(512, 64) == 8
    with pytest.raises(RuntimeError):
        with bench.reduce_chunk(ta, 16):
            raise RuntimeError("boom")
    assert ta._reduce_chunk is served


def test_ab_summary_takes_each_variants_fastest_round(bench, tmp_path):
    """--ab: the tvspec A/B's rounds folded per point (fastest round of each variant, the
    ratio over the first variant); points one variant lacks and failed points are left out."""
    def results(*rows):
        return {"meta": {"gpu": "x"}, "results": [
            {"kind": "mla", "batch": b, "budget": n, "context": c, "ours_us": us,
             "num_splits": 33} for b, n, c, us in rows]}

    new = [results((1, 31, 512, 27.0), (1, 32, 512, 26.0)),
           results((1, 31, 512, 26.0), (1, 32, 512, 26.5))]
    old = [results((1, 31, 512, 33.0), (1, 32, 512, 26.2), (2, 31, 512, 40.0)),
           results((1, 31, 512, 32.5), (1, 32, 512, "error: boom"))]
    rows = bench.ab_summary({"new": new, "old": old})
    assert [(r["budget"], r["new_us"], r["old_us"]) for r in rows] == [(31, 26.0, 32.5),
                                                                       (32, 26.0, 26.2)]
    assert rows[0]["old_over_new"] == 1.25 and rows[0]["old_rounds"] == [33.0, 32.5]
    paths = []
    for i, d in enumerate(new + old):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "ab.json"
    assert bench.main(["--ab", f"new={paths[0]},{paths[1]}", "--ab", f"old={paths[2]},{paths[3]}",
                       "--out", str(out)]) == 0
    assert json.loads(out.read_text())["summary"] == rows
    with pytest.raises(SystemExit):
        bench.parse_ab(["new=" + str(paths[0])])  # one variant is no A/B


def test_kernel_times_summary(bench):
    """--kernel-times: per-kernel medians over replays (the i-th kernel by start), the gaps
    between kernels (negative where they overlap) and the span; a replay with no events gives
    an empty summary."""
    reps = [[(10.0, 20.0, "b"), (0.0, 8.0, "a")],   # unordered: sorted by start
            [(0.0, 9.0, "a"), (11.0, 23.0, "b")],
            [(0.0, 7.0, "a"), (6.0, 21.0, "b")]]    # b starts before a ends: gap -1
    out = bench.summarize_kernel_times(reps)
    assert [k["name"] for k in out["kernels"]] == ["a", "b"]
    assert [k["us"] for k in out["kernels"]] == [8.0, 12.0]
    assert [k["gap_before_us"] for k in out["kernels"]] == [0.0, 2.0]
    assert out["span_us"] == 21.0 and out["sum_us"] == 20.0
    assert bench.summarize_kernel_times([[], []]) == dict(kernels=[], span_us=None, sum_us=0)


def test_merge_sweep_checks_outputs(bench):
    """--merge-sweep: a time per tile, a tile whose output differs from the default's recorded
    as wrong, a failing tile as its error."""
    import torch

    base = torch.ones(4, 2, 8)

    def run(cfg):
        if cfg.block_m == 32:
            raise ValueError("no such tile")
        return float(cfg.block_n), base + (1.0 if cfg.block_n == 16 else 1e-4)

    from tests.triton_kernels import load_kernels

    ta = load_kernels(interpret=True).tree_attention
    res = bench.merge_sweep("16,32,4,2;16,16,4,1;32,64,4,2", ta, base, run)
    assert res["16,32,4,2"] == 32.0
    assert res["16,16,4,1"].startswith("wrong output")
    assert res["32,64,4,2"].startswith("error: ValueError")


def test_prefix_path_record(bench):
    """One prefix path's fields at a point (the same for FA3's and FlashMLA's): time, tile,
    difference from our kernel alone, speedup, the merge sweep; an error in place of the time."""
    import argparse

    import torch

    from tests.triton_kernels import load_kernels

    ta = load_kernels(interpret=True).tree_attention
    out = torch.ones(2, 2, 4)

    def run(cfg):
        t = 10.0 if cfg is None else 8.0
        return t, out, "16,32,4,2,1", out * 1.01

    args = argparse.Namespace(kernel_times=False, merge_sweep="16,64,4,2")
    r = {}
    bench.time_prefix_path(r, "flashmla_prefix", 20.0, args, ta, run)
    assert r == {"flashmla_prefix_us": 10.0, "flashmla_prefix_merge_tile": "16,32,4,2,1",
                 "flashmla_prefix_rel_diff": round(0.01 / 1.01, 5),
                 "speedup_flashmla_prefix": 2.0, "flashmla_prefix_merge_us": {"16,64,4,2": 8.0}}

    def broken(cfg):
        raise RuntimeError("no FA3")

    r = {}
    bench.time_prefix_path(r, "fa3_prefix", 20.0, args, ta, broken)
    assert r == {"fa3_prefix_us": "error: RuntimeError: no FA3"}
