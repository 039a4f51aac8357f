#!/usr/bin/env python3
"""Leave most of ``bench_results/`` out of the working tree that device calls carry, and put it
back afterwards.

Why. A device call carries every file of the working tree (tracked, and untracked ones git does
not ignore) beside its ``carry`` paths, 64 MiB in all. Beside the 25.8 MiB checkout of session
73 the SGLang kit's two wheel chunks (``w1`` 48 MB, ``w2`` 45 MB) took five calls
(``devkit_chunks.py`` cut them into parts); ``bench_results/`` was 14 MiB of that checkout.
Without it each chunk fits one call: two kit calls instead of five, each of which costs device
time and may find the machine gone cold.

How. git's sparse checkout (non-cone patterns): the files stay tracked and committed and are
only absent from the working tree, so ``git status`` stays clean and no commit can drop them.
Kept in the tree: the ``bench_results`` files something on the device reads, that is the ones
``scripts/gpu_session.sh`` names outside its comments (tables it hands to benchmarks) and the
ones a test names as a quoted file name.

    python3 scripts/slim_checkout.py hide       # before the session's device calls
    python3 scripts/devkit_chunks.py --recut    # then the kit's calls for the slim checkout
    python3 scripts/slim_checkout.py restore    # after them, before results go into bench_results/
    python3 scripts/slim_checkout.py status

``hide`` refuses while ``bench_results/`` has uncommitted changes (commit or move them first).
"""
from __future__ import annotations

import argparse
import fnmatch
import itertools
import re
import subprocess
import sys
from pathlib import Path

RESULTS = "bench_results"
SESSION_SCRIPT = "scripts/gpu_session.sh"
_REF = re.compile(RESULTS + r"/([A-Za-z0-9_.{},*-]+)")


def _git(repo: Path, *args: str, check: bool = True) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=check, capture_output=True,
                          text=True).stdout


def _braces(word: str) -> list[str]:
    """Shell brace expansion of ``word`` (``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json``)."""
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return list(itertools.chain.from_iterable(
        _braces(word[:m.start()] + opt + word[m.end():]) for opt in m.group(1).split(",")))


def shell_code(text: str) -> str:
    """``text`` (a bash script) without its comments: whole-line ones and `` # ...`` tails."""
    lines = (ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return "\n".join(re.sub(r"\s#\s.*$", "", ln) for ln in lines)


def script_refs(code: str, tracked: list[str]) -> set[str]:
    """Tracked results files that ``code`` names as ``bench_results/NAME`` (braces and globs
    expanded against ``tracked``)."""
    out = set()
    for m in _REF.finditer(code):
        for word in _braces(m.group(1).rstrip(".,)`}")):
            out |= set(fnmatch.filter(tracked, f"{RESULTS}/{word}"))
    return out


def quoted_refs(texts: list[str], tracked: list[str], elsewhere: set[str] = frozenset()) -> set[str]:
    """Tracked results files whose name a test that mentions ``bench_results`` quotes (names in
    ``elsewhere``, which files outside the results also bear, e.g. README.md, do not count)."""
    texts = [t for t in texts if RESULTS in t]
    names = {p: Path(p).name for p in tracked if Path(p).name not in elsewhere}
    return {p for p, n in names.items() if any(f'"{n}"' in t or f"'{n}'" in t for t in texts)}


def keep_list(repo: Path) -> list[str]:
    """The results files the slim tree keeps (sorted)."""
    tracked = _git(repo, "ls-files", RESULTS).split()
    keep = script_refs(shell_code((repo / SESSION_SCRIPT).read_text()), tracked)
    tests = [repo / t for t in _git(repo, "ls-files", "tests").split() if t.endswith(".py")]
    elsewhere = {Path(p).name for p in _git(repo, "ls-files").split()
                 if not p.startswith(RESULTS + "/")}
    keep |= quoted_refs([t.read_text(errors="replace") for t in tests if t.is_file()], tracked,
                      elsewhere)
    return sorted(keep)


def patterns(keep: list[str]) -> list[str]:
    """Non-cone sparse patterns: everything, less the results directory's files, plus ``keep``."""
    return ["/*", f"!/{RESULTS}/*", *(f"/{p}" for p in keep)]


def is_slim(repo: Path) -> bool:
    return _git(repo, "config", "--bool", "core.sparseCheckout", check=False).strip() == "true"


def hide(repo: Path) -> int:
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=all", "--", RESULTS)
    if dirty.strip():
        print(f"slim_checkout: {RESULTS}/ has uncommitted changes; commit or move them "
              f"first:\n{dirty}", file=sys.stderr)
        return 1
    keep = keep_list(repo)
    subprocess.run(["git", "-C", str(repo), "sparse-checkout", "set", "--no-cone", *patterns(keep)],
                   check=True)
    left = sum(1 for p in (repo / RESULTS).rglob("*") if p.is_file())
    print(f"slim_checkout: {RESULTS}/ now holds {left} files (kept: the ones the device reads); "
          f"'python3 scripts/slim_checkout.py restore' brings the rest back")
    return 0


def restore(repo: Path) -> int:
    if not is_slim(repo):
        print("slim_checkout: not slim; nothing to restore")
        return 0
    subprocess.run(["git", "-C", str(repo), "sparse-checkout", "disable"], check=True)
    print(f"slim_checkout: {RESULTS}/ restored")
    return 0


def status(repo: Path) -> int:
    absent = [p for p in _git(repo, "ls-files", RESULTS).split() if not (repo / p).exists()]
    print(f"slim_checkout: {'slim' if is_slim(repo) else 'full'} ({len(absent)} tracked "
          f"{RESULTS} files absent from the working tree)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("hide", "restore", "status"))
    ap.add_argument("--repo", default=".")
    args = ap.parse_args(argv)
    repo = Path(args.repo)
    return {"hide": hide, "restore": restore, "status": status}[args.action](repo)


if __name__ == "__main__":
    sys.exit(main())
