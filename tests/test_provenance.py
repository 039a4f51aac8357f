"""``sglang_ddtree.provenance`` and ``scripts/which_commit.py``: a benchmark JSON's
``source_digest`` names the code it ran, found again from git history."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ddtree.provenance import checkout_digest, counts, source_digest

ROOT = Path(__file__).resolve().parents[1]


def test_which_files_count():
    assert counts("sglang_ddtree/worker.py") and counts("cuda_ext/tree_build_kernel.cuh")
    assert counts("triton_kernels/moe_w4a16_configs.json") and counts("scripts/gpu_session.sh")
    assert not counts("README.md") and not counts("bench_results/x.json")
    assert not counts("sglang_ddtree/__pycache__/worker.cpython-311.pyc")
    assert not counts("tests/test_tree.py")


def make_checkout(root: Path, body: str) -> None:
    (root / "sglang_ddtree").mkdir(parents=True, exist_ok=True)
    (root / "scripts").mkdir(exist_ok=True)
    (root / "sglang_ddtree" / "a.py").write_text(body)
    (root / "scripts" / "run.sh").write_text("echo run\n")
    (root / "notes.md").write_text(body)  # not counted


def test_digest_follows_content_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_checkout(a, "x = 1\n")
    make_checkout(b, "x = 1\n")
    (b / "notes.md").write_text("other prose\n")
    (b / "sglang_ddtree" / "__pycache__").mkdir()
    (b / "sglang_ddtree" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert source_digest(str(a)) == source_digest(str(b))
    assert checkout_digest(str(a / "scripts" / "run.sh")) == source_digest(str(a))
    (b / "sglang_ddtree" / "a.py").write_text("x = 2\n")
    assert source_digest(str(a)) != source_digest(str(b))


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0,
                    reason="no git")
def test_which_commit_finds_the_commit_of_a_digest(tmp_path):
    repo = tmp_path / "repo"
    make_checkout(repo, "x = 1\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True,
                              capture_output=True, text=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = source_digest(str(repo))
    (repo / "sglang_ddtree" / "a.py").write_text("x = 2\n")
    git("commit", "-qam", "second")
    # the script runs from its own checkout: copy it into the temporary repo
    (repo / "scripts" / "which_commit.py").write_text(
        (ROOT / "scripts" / "which_commit.py").read_text())
    (repo / "sglang_ddtree" / "provenance.py").write_text(
        (ROOT / "sglang_ddtree" / "provenance.py").read_text())
    (repo / "sglang_ddtree" / "__init__.py").write_text("")
    git("add", "-A")
    git("commit", "-qm", "tools")
    run = lambda d: subprocess.run(  # noqa: E731
        [sys.executable, str(repo / "scripts" / "which_commit.py"), d], cwd=repo,
        capture_output=True, text=True)
    r = run(first)  # the digest a run on the first commit would have recorded
    assert r.returncode == 0 and r.stdout.strip().endswith("first"), r.stdout + r.stderr
    now = source_digest(str(repo))
    r = run(now)
    assert r.returncode == 0 and r.stdout.strip().endswith("tools"), r.stdout + r.stderr
    # a results JSON with the digest at the top level or in its "meta" (bench_tree_verify, doctor)
    for i, data in enumerate(({"source_digest": now}, {"meta": {"source_digest": now}})):
        path = tmp_path / f"result{i}.json"
        path.write_text(json.dumps(data))
        r = run(str(path))
        assert r.returncode == 0 and r.stdout.strip().endswith("tools"), r.stdout + r.stderr
    path = tmp_path / "none.json"
    path.write_text(json.dumps({"meta": {}}))
    assert run(str(path)).returncode == 2
    (repo / "sglang_ddtree" / "a.py").write_text("x = 3\n")  # uncommitted
    r = run(source_digest(str(repo)))
    assert r.returncode == 1 and "uncommitted" in r.stderr
