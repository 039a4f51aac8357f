#!/usr/bin/env python3
"""Name the commits whose source files give a benchmark JSON's ``source_digest``.

    python scripts/which_commit.py bench_results/tree_build_h200.json   # or the digest itself
    python scripts/which_commit.py 3f2a... --max-count 200

Walks ``git rev-list --all`` (newest first) and prints every commit whose tree has that digest
(``sglang_ddtree.provenance``). No match means the run had uncommitted changes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_ddtree.provenance import counts, digest_of  # noqa: E402


def git(*args: str, data: bool = False):
    out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True)
    return out.stdout if data else out.stdout.decode()


def commit_digest(commit: str) -> str:
    files = []
    for line in git("ls-tree", "-r", commit).splitlines():
        meta, path = line.split("\t", 1)
        _, kind, blob = meta.split()
        if kind == "blob" and counts(path):
            files.append((path, git("cat-file", "blob", blob, data=True)))
    return digest_of(files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("digest", help="a digest, or a JSON file with a source_digest field (at the "
                    "top level or in its 'meta', as bench_tree_verify and doctor write it)")
    ap.add_argument("--max-count", type=int, default=100, help="newest commits to try")
    args = ap.parse_args(argv)
    want = args.digest
    if os.path.isfile(want):
        with open(want) as f:
            data = json.load(f)
        want = data.get("source_digest") or (data.get("meta") or {}).get("source_digest")
        if not want:
            print(f"{args.digest}: no source_digest field", file=sys.stderr)
            return 2
    found = [c for c in git("rev-list", "--all", f"--max-count={args.max_count}").split()
             if commit_digest(c) == want]
    for c in found:
        print(git("log", "-1", "--format=%h %ad %s", "--date=iso", c).strip())
    if not found:
        print(f"no commit among the newest {args.max_count} has digest {want} "
              "(uncommitted changes?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
