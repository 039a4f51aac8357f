#!/usr/bin/env python3
"""Split the offline SGLang kit's wheel chunks so that each device call fits its carry limit.

A device call carries every tracked file of this checkout (and untracked files git does not
ignore) plus the paths named in ``carry``, at most 64 MiB in all. The kit's builder cuts its
wheels into two chunks (``w1``, ``w2``) of up to 47 MiB each, which leaves 17 MiB for the
checkout; at 18.4 MB (session 32: the trained tiny pair and five months of bench_results)
the ``w1`` call was refused. This script measures what a call carries besides the kit, and
re-cuts any chunk that no longer fits into ``<name>a``, ``<name>b``, ... (hard links to the same
wheels, largest first into the first part with room), then prints the calls in order:

    python3 scripts/devkit_chunks.py --kit .devkit

With most of ``bench_results/`` out of the working tree (``slim_checkout.py hide``, session 74:
12.5 MiB instead of 25.8) each of the kit's own chunks fits one call; ``--recut`` drops the
parts earlier runs cut and plans from ``w1`` / ``w2`` again (two calls instead of five).

The last chunk's call also carries ``serve.sh`` and ``models`` and is the one to chain the
device work onto (``&& bash scripts/device_call.sh ...``). Nothing is changed when every chunk
fits (``--dry-run`` never changes anything).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
LIMIT = 64 * MIB
# besides the wheels, the last call carries these (small) kit files
LAST_CALL_EXTRAS = ("install.sh", "serve.sh", "models")
MARGIN = 256 * 1024  # for files the checkout gains before the call (a result copied in, a note)
# What a file counts for in a call: its size rounded up to whole 4 KiB blocks. Session 61: a
# chunk of 40.9 MiB beside a checkout of 806 files, 22.8 MiB by their sizes (63.7 MiB in all),
# was refused as over 64 MiB; counted in 4 KiB blocks the checkout is 24.4 MiB (65.3 in all).
BLOCK = 4096


def counted(size: int) -> int:
    """Bytes a file of ``size`` bytes counts for in a call (whole blocks)."""
    return -(-size // BLOCK) * BLOCK


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return counted(path.stat().st_size)
    return sum(counted(p.stat().st_size) for p in path.rglob("*") if p.is_file())


def checkout_bytes(repo: Path) -> int:
    """What every call carries of the checkout: tracked files and untracked ones git does not
    ignore, each in whole blocks (``counted``: the device tool counts more than the sizes)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    total = 0
    for name in filter(None, out.decode().split("\0")):
        p = repo / name
        if p.is_file():  # a tracked file deleted in the working tree travels as nothing
            total += counted(p.stat().st_size)
    return total


def drop_cuts(kit: Path) -> list[str]:
    """Remove the parts earlier runs cut (``w1a``, ``w2ab``: hard links to the wheels of
    ``w1`` / ``w2``, which stay), so that the next plan starts from the kit's own chunks (after
    the checkout shrank, e.g. ``slim_checkout.py hide``). -> the names removed."""
    cut = sorted(p.name for p in kit.iterdir()
                 if p.is_dir() and re.fullmatch(r"w\d+[a-z]+", p.name))
    for name in cut:
        shutil.rmtree(kit / name)
    return cut


def chunk_dirs(kit: Path, own: bool = False) -> list[Path]:
    """The kit's wheel chunks in install order: ``w1`` before ``w2``; a chunk already re-cut
    (``w1a``, ``w1b``) stands for its parent, which is then left out; ``own``: the kit's own
    chunks only, whatever was cut."""
    names = sorted(p.name for p in kit.iterdir() if p.is_dir() and p.name.startswith("w"))
    if own:
        return [kit / n for n in names if re.fullmatch(r"w\d+", n)]
    recut = {n[:-1] for n in names if n[-1].isalpha() and n[:-1] in names}
    return [kit / n for n in names if n not in recut]


def pack(sizes: dict[str, int], room: int) -> list[list[str]]:
    """First-fit decreasing: wheel names -> parts of at most ``room`` bytes each."""
    parts: list[list[str]] = []
    used: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if sizes[name] > room:
            raise SystemExit(f"devkit_chunks: {name} alone ({sizes[name] / MIB:.1f} MiB) does not "
                             f"fit the {room / MIB:.1f} MiB a call has left beside the checkout; "
                             "shrink the checkout (large tracked files) first")
        for i, u in enumerate(used):
            if u + sizes[name] <= room:
                parts[i].append(name)
                used[i] += sizes[name]
                break
        else:
            parts.append([name])
            used.append(sizes[name])
    return parts


def plan(kit: Path, checkout: int, limit: int = LIMIT, margin: int = MARGIN,
         own: bool = False) -> list[dict]:
    """Each chunk with the bytes its call carries and, where that passes ``limit``, the parts
    to cut it into. The last chunk's call carries the kit's extras as well. ``own``: plan from
    the kit's own chunks, not the parts earlier runs cut (``chunk_dirs``)."""
    chunks = chunk_dirs(kit, own)
    if not chunks:
        raise SystemExit(f"devkit_chunks: no wheel chunks (w1, w2, ...) in {kit}")
    extras_last = sum(tree_bytes(kit / e) for e in LAST_CALL_EXTRAS if (kit / e).exists())
    install = tree_bytes(kit / "install.sh") if (kit / "install.sh").exists() else 0
    out = []
    for i, d in enumerate(chunks):
        extra = extras_last if i == len(chunks) - 1 else install
        wheels = {p.name: counted(p.stat().st_size) for p in sorted(d.glob("*.whl"))}
        carried = checkout + extra + sum(wheels.values())
        room = limit - checkout - extra - margin
        entry = {"chunk": d.name, "carried_bytes": carried, "fits": carried + margin <= limit,
                 "last": i == len(chunks) - 1}
        if not entry["fits"]:
            entry["parts"] = pack(wheels, room)
        out.append(entry)
    return out


def apply(kit: Path, entries: list[dict]) -> list[tuple[str, bool]]:
    """Make the parts (hard links, or copies across file systems); -> [(chunk dir, last)]."""
    calls = []
    for e in entries:
        if e["fits"]:
            calls.append((e["chunk"], e["last"]))
            continue
        src = kit / e["chunk"]
        names = [f"{e['chunk']}{chr(ord('a') + j)}" for j in range(len(e["parts"]))]
        for name, wheels in zip(names, e["parts"]):
            dst = kit / name
            dst.mkdir(exist_ok=True)
            for w in dst.glob("*.whl"):  # a part from an earlier cut: start over
                w.unlink()
            for w in wheels:
                try:
                    os.link(src / w, dst / w)
                except OSError:
                    (dst / w).write_bytes((src / w).read_bytes())
        calls.extend((n, e["last"] and j == len(names) - 1) for j, n in enumerate(names))
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kit", default=".devkit")
    ap.add_argument("--repo", default=".")
    ap.add_argument("--limit-mib", type=float, default=LIMIT / MIB)
    ap.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    ap.add_argument("--recut", action="store_true",
                    help="drop the parts earlier runs cut and plan from the kit's own chunks "
                         "(after the checkout shrank: scripts/slim_checkout.py hide)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    kit, limit = Path(args.kit), int(args.limit_mib * MIB)
    checkout = checkout_bytes(Path(args.repo))
    entries = plan(kit, checkout, limit, own=args.recut)
    if args.json:
        print(json.dumps({"checkout_bytes": checkout, "limit_bytes": limit, "chunks": entries},
                         indent=1))
    else:
        print(f"checkout: {checkout / MIB:.1f} MiB travels with every call (limit "
              f"{limit / MIB:.0f} MiB)")
        for e in entries:
            state = "fits" if e["fits"] else f"too big: cut into {len(e['parts'])}"
            print(f"  {e['chunk']}: {e['carried_bytes'] / MIB:.1f} MiB carried, {state}")
    if args.dry_run:
        return 0
    if args.recut:
        dropped = drop_cuts(kit)
        if dropped:
            print(f"dropped the parts earlier runs cut: {', '.join(dropped)}")
    calls = apply(kit, entries)
    k = kit.name
    print("calls, in order (the machine goes cold 30 s after each: make them all at once, one "
          "batch of calls, which run one after another; session 33 lost a machine between two "
          "turns); FA3's parts, where devkit_fa3.py built them, go after sglang-kernel's chunk "
          "and before the last:")
    lines = []
    for name, last in calls:
        carry = [f"{k}/{name}", f"{k}/install.sh"] + ([f"{k}/serve.sh", f"{k}/models"]
                                                       if last else [])
        tail = " >/dev/null && bash scripts/device_call.sh \"STEPS\"" if last else ""
        lines.append(f"  carry {json.dumps(carry)}: bash {k}/install.sh {k}/{name}{tail}")
    for carry, cmd, fits in fa3_calls(kit, checkout, limit):
        state = "" if fits else "  <- too big beside this checkout: rebuild the parts " \
                                "(devkit_fa3.py build --part-mib smaller)"
        lines.insert(len(lines) - 1, f"  carry {json.dumps(carry)}: {cmd}{state}")
    print("\n".join(lines))
    return 0


def fa3_calls(kit: Path, checkout: int, limit: int = LIMIT) -> list:
    """[(carry, command, fits)] for the FA3 parts ``devkit_fa3.py build`` left in
    ``kit/fa3`` (none where it did not run)."""
    manifest = kit / "fa3" / "manifest.json"
    if not manifest.is_file():
        return []
    out = []
    for p in json.loads(manifest.read_text())["parts"]:
        part = kit / "fa3" / p["name"]
        carried = checkout + manifest.stat().st_size + (part.stat().st_size if part.exists()
                                                        else p["bytes"])
        carry = [f"{kit.name}/fa3/manifest.json", f"{kit.name}/fa3/{p['name']}"]
        out.append((carry, f"python3 scripts/devkit_fa3.py install {kit.name}/fa3/{p['name']}",
                    carried <= limit))
    return out


if __name__ == "__main__":
    sys.exit(main())
