"""scripts/slim_checkout.py: bench_results/ out of the working tree a device call carries (git
sparse checkout), all but what the device reads, and back; a real git repository each time."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("slim_checkout",
                                              HERE.parent / "scripts" / "slim_checkout.py")
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)

SESSION = """#!/bin/bash
# bench_results/in_a_comment.json is only named here
step a 10 python3 x.py --table $PWD/bench_results/table_{a,b}.json  # bench_results/tail.json
step b 10 python3 y.py --old ${OLD:-bench_results/old_table.json}
"""
TEST = '''import os
DATA = os.path.join("bench_results", "read_by_test.json")
TOP = "README.md"  # the project's README, not bench_results/README.md
'''


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t",
                           *args], check=True, capture_output=True, text=True).stdout


def _git_version():
    try:
        out = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return tuple(int(v) for v in out.split()[2].split(".")[:2])


@pytest.fixture
def repo(tmp_path):
    version = _git_version()
    if version is None or version < (2, 35):  # sparse-checkout set --no-cone came in 2.35
        pytest.skip(f"git >= 2.35 needed, got {version}")
    r = tmp_path / "repo"
    (r / "scripts").mkdir(parents=True)
    (r / "tests").mkdir()
    (r / "bench_results").mkdir()
    (r / "scripts" / "gpu_session.sh").write_text(SESSION)
    (r / "tests" / "test_x.py").write_text(TEST)
    (r / "README.md").write_text("top\n")
    for name in ("table_a.json", "table_b.json", "old_table.json", "read_by_test.json",
                 "in_a_comment.json", "tail.json", "big_result.json", "README.md"):
        (r / "bench_results" / name).write_text("{}\n")
    git(r, "init", "-q")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "init")
    return r


KEPT = ["bench_results/old_table.json", "bench_results/read_by_test.json",
        "bench_results/table_a.json", "bench_results/table_b.json"]


def test_the_keep_list_is_what_the_device_reads(repo):
    # comments (whole lines and tails) do not count, braces and ${VAR:-default} do; a test's
    # quoted README.md is the project's own, not bench_results/README.md
    assert sc.keep_list(repo) == KEPT


def test_braces_expand_like_the_shell():
    assert sc._braces("t_{a,b}_{1,2}.json") == ["t_a_1.json", "t_a_2.json", "t_b_1.json",
                                                "t_b_2.json"]
    assert sc._braces("plain.json") == ["plain.json"]


def test_hide_then_restore_round_trip(repo, capsys):
    tracked = git(repo, "ls-files")
    assert sc.main(["hide", "--repo", str(repo)]) == 0
    present = sorted(f"bench_results/{p.name}" for p in (repo / "bench_results").iterdir())
    assert present == KEPT
    assert sc.is_slim(repo)
    assert git(repo, "status", "--porcelain") == ""  # nothing to commit: no deletions staged
    assert git(repo, "ls-files") == tracked  # still tracked
    # a commit made while slim keeps every results file
    (repo / "scripts" / "new.py").write_text("x = 1\n")
    git(repo, "add", "scripts/new.py")
    git(repo, "commit", "-qam", "while slim")
    assert "bench_results/big_result.json" in git(repo, "ls-tree", "-r", "--name-only", "HEAD")
    sc.main(["status", "--repo", str(repo)])
    assert "slim (4 tracked" in capsys.readouterr().out
    assert sc.main(["restore", "--repo", str(repo)]) == 0
    assert not sc.is_slim(repo)
    assert len(list((repo / "bench_results").iterdir())) == 8
    assert git(repo, "status", "--porcelain") == ""


def test_hide_refuses_uncommitted_results(repo, capsys):
    (repo / "bench_results" / "new_result.json").write_text("{}\n")
    assert sc.main(["hide", "--repo", str(repo)]) == 1
    assert "new_result.json" in capsys.readouterr().err
    assert not sc.is_slim(repo)


def test_restore_when_full_is_a_no_op(repo, capsys):
    assert sc.main(["restore", "--repo", str(repo)]) == 0
    assert "nothing to restore" in capsys.readouterr().out


def test_the_real_session_script_and_tests_keep_what_they_name():
    # every file gpu_session.sh hands a benchmark from bench_results/ stays in the slim tree
    root = HERE.parent
    keep = sc.keep_list(root)
    code = sc.shell_code((root / "scripts" / "gpu_session.sh").read_text())
    tracked = [str(p.relative_to(root)) for p in (root / "bench_results").iterdir()]
    assert sc.script_refs(code, tracked) <= set(keep)
    # named outright: the tables gpu_session.sh hands benchmarks, files tests read
    for name in ("moe_trial_table_s36_a.json", "moe_trial_table_s36_b.json",
                 "moe_w4a16_configs_before_s55.json", "moe_w4a16_configs_before_s60.json",
                 "tree_verify_h200.json", "ncu_tree_build_h200_s13_sass.csv.gz"):
        assert f"bench_results/{name}" in keep, name
    assert "bench_results/README.md" not in keep
