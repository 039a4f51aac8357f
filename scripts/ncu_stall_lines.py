#!/usr/bin/env python
"""Sum Nsight Compute's warp-state samples of a tree kernel per CUDA source line.

Input: the per-instruction CSV that ``ncu ... --page source --csv --print-source sass`` writes
(one launch; ``scripts/profile_tree_kernel.py`` says how), and a cubin of the same code with line
info: ``--build`` compiles ``cuda_ext/tree_build.cu`` with the extension's own flags (``-O3
-lineinfo``, one ``sm_XY``), or ``--cubin`` names one. ``nvdisasm -g`` maps each SASS offset of
the kernel (``--kernel``, a substring of its mangled name) to its source line; every offset of the
profile must carry the same opcode in the cubin, or the script stops (a different compiler or
different flags give different code).

    python scripts/ncu_stall_lines.py --csv bench_results/ncu_tree_build_h200_s13_sass.csv.gz \\
        --build --arch 90 --kernel tree_build_kernelILi3E --top 70

Prints, per source line (``--by function``: per enclosing function): samples not at a barrier, then ``stall_wait``, ``stall_no_inst``
(instruction fetch), ``stall_selected``, ``stall_short_sb``, ``stall_branch_resolving``, then
barrier samples, the line's SASS instruction count and the most warp-level executions of one of
them. Samples are over all warps: a phase every warp runs is sampled about four times as often per
unit of time (one sample per SM sub-partition) as warp 0 running alone.
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import gzip
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOWN = ["stall_wait", "stall_no_inst", "stall_selected", "stall_short_sb",
         "stall_branch_resolving"]
_LINE_RE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
_INSN_RE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SECTION_RE = re.compile(r"^\.text\.(\S+):")
# a function definition's first line in the kernel sources; its name is the first word before a
# "(" once any __launch_bounds__(...) is removed
_FUNC_START_RE = re.compile(r"^(?:__device__|__global__|DDTREE_HOST_DEVICE)\b")
_BOUNDS_RE = re.compile(r"__launch_bounds__\([^()]*\)")
_NAME_RE = re.compile(r"(\w+)\s*\(")


def opcode(text: str) -> str:
    """The opcode of a SASS instruction, without its predicate (``@!P0 BRA x`` -> ``BRA``)."""
    words = text.strip().rstrip(";").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def parse_nvdisasm(text: str, kernel: str) -> dict:
    """{offset: ((file basename, line), instruction)} for the first section whose name holds
    ``kernel``, from ``nvdisasm -g -c`` output."""
    out, cur, inside = {}, None, False
    for line in text.splitlines():
        m = _SECTION_RE.match(line)
        if m:
            if inside:
                break
            inside = kernel in m.group(1)
            continue
        if not inside:
            continue
        m = _LINE_RE.match(line)
        if m:
            cur = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = _INSN_RE.match(line)
        if m:
            out[int(m.group(1), 16)] = (cur, m.group(2).strip())
    return out


def read_profile(text: str) -> list:
    """The per-instruction rows of an ncu source-page CSV (everything before the header that
    starts with "Address" is ncu's log)."""
    lines = text.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no per-instruction table (a header starting with \"Address\")")
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def samples(row: dict, key: str) -> int:
    """A count cell of the table: 0 where empty or "-"; thousands separators (which some ncu
    versions print) dropped."""
    v = (row.get(key) or "").replace(",", "").strip()
    return int(float(v)) if v not in ("", "-") else 0


def per_line(rows: list, sass: dict) -> dict:
    """{(file, line): Counter of stall samples, 'n' instructions, 'exec' most executions}."""
    base = int(rows[0]["Address"], 16)
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by = collections.defaultdict(collections.Counter)
    for r in rows:
        off = int(r["Address"], 16) - base
        if off not in sass or opcode(sass[off][1]) != opcode(r["Source"]):
            got = sass[off][1] if off in sass else "nothing"
            raise ValueError(f"offset {off:#x}: the profile has {r['Source'].strip()!r}, the "
                             f"cubin {got!r}: not the same code")
        c = by[sass[off][0]]
        for k in reasons:
            c[k] += samples(r, k)
        c["n"] += 1
        c["exec"] = max(c["exec"], samples(r, "Instructions Executed"))
    return by


def function_of_lines(source_lines: list) -> list:
    """Per 1-based line, the function whose definition most recently started at or above it
    (a file-level line before any definition maps to "(file scope)"). A definition may put its
    name on the line after the qualifiers (``__global__ void __launch_bounds__(...)`` then
    ``name(...)``)."""
    out, cur = [], "(file scope)"
    for i, text in enumerate(source_lines):
        if _FUNC_START_RE.match(text):
            head = _BOUNDS_RE.sub("", text)
            if "(" not in head and i + 1 < len(source_lines):
                head += " " + source_lines[i + 1]
            m = _NAME_RE.search(head)
            if m:
                cur = m.group(1)
        out.append(cur)
    return out


def by_function(by_line: dict, sources: dict) -> dict:
    """per_line's counts summed per enclosing function (file:function)."""
    funcs = {f: function_of_lines(lines) for f, lines in sources.items()}
    out = collections.defaultdict(collections.Counter)
    for (f, l), c in by_line.items():
        name = funcs[f][l - 1] if f in funcs and 0 < l <= len(funcs[f]) else "?"
        tgt = out[(f, name)]
        exec_ = c["exec"]
        tgt.update({k: v for k, v in c.items() if k != "exec"})
        tgt["exec"] = max(tgt["exec"], exec_)
    return out


def table(by: dict, top: int, sources: dict) -> str:
    def nonbar(c):
        return sum(v for k, v in c.items() if k.startswith("stall_") and k != "stall_barrier")
    tot = sum(nonbar(c) for c in by.values())
    bar = sum(c["stall_barrier"] for c in by.values())
    lines = [f"samples: {tot + bar} ({bar} at a barrier, {tot} not)",
             "file:line      nonbar  wait noinst  sel shortsb  br | barrier ninstr maxexec | source"]
    for (f, l), c in sorted(by.items(), key=lambda kv: -nonbar(kv[1]))[:top]:
        src = sources.get(f, [])
        if isinstance(l, str):  # by_function's keys: (file, function)
            head, text = f"{f[:10]}:{l}"[:30].ljust(30), ""
        else:
            head = f"{f[:10]}:{l:<5d}"
            text = src[l - 1].strip()[:70] if 0 < l <= len(src) else ""
        lines.append(f"{head} {nonbar(c):6d} " + " ".join(
            f"{c[k]:5d}" for k in SHOWN) + f" | {c['stall_barrier']:6d} {c['n']:6d} "
            f"{c['exec']:7d} | {text}")
    return "\n".join(lines)


def find_tool(name: str) -> str:
    """nvdisasm: on PATH, in CUDA_HOME/bin, or the copy triton's wheel bundles."""
    cands = [shutil.which(name), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                              "bin", name)]
    try:
        import triton  # its wheel bundles nvdisasm
        cands += glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                        "bin", name))
    except ImportError:
        pass
    for c in cands:
        if c and os.path.isfile(c):
            return c
    sys.exit(f"{name} not found (PATH, CUDA_HOME/bin, or triton's bundled tools)")


def build_cubin(arch: str, out_dir: str) -> str:
    """cuda_ext/tree_build.cu as one sm_<arch> cubin, with the extension's nvcc, includes and
    flags (its loader's), plus the C++ standard."""
    from torch.utils import cpp_extension

    from sglang_ddtree import tree_backend

    loader = tree_backend._loader()
    includes, _ = loader._toolkit_flags()
    cubin = os.path.join(out_dir, "tree_build.cubin")
    cmd = [os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), *loader._CUDA_CFLAGS, "-std=c++17",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", *[f"-I{i}" for i in includes],
           "-cubin", "-o", cubin, os.path.join(ROOT, "cuda_ext", "tree_build.cu")]
    subprocess.run(cmd, check=True)
    return cubin


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", required=True, help="ncu --page source --csv --print-source sass")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--cubin")
    src.add_argument("--build", action="store_true", help="compile cuda_ext/tree_build.cu")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--kernel", default="tree_build_kernelILi3E",
                    help="substring of the kernel's mangled name (ILi3E: deferred_warp)")
    ap.add_argument("--top", type=int, default=70)
    ap.add_argument("--by", choices=("line", "function"), default="line",
                    help="sum per source line, or per enclosing function (kernel bodies whole)")
    args = ap.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        rows = read_profile(f.read())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = args.cubin or build_cubin(args.arch, tmp)
        dis = subprocess.run([find_tool("nvdisasm"), "-g", "-c", cubin], check=True,
                             capture_output=True, text=True).stdout
    sass = parse_nvdisasm(dis, args.kernel)
    if not sass:
        sys.exit(f"no kernel matching {args.kernel!r} in the cubin")
    sources = {}
    for name in ("tree_build_kernel.cuh", "tree_build_params.h"):
        with open(os.path.join(ROOT, "cuda_ext", name)) as f:
            sources[name] = f.read().split("\n")
    by = per_line(rows, sass)
    if args.by == "function":
        by = by_function(by, sources)
    print(table(by, args.top, sources))


if __name__ == "__main__":
    main()
