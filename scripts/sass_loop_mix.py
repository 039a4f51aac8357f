"""Instruction mix of a loop in ``cuobjdump -sass`` output: how many SASS instructions, and of
which opcodes, one iteration of a kernel's loop issues (statically, every instruction between
two addresses counted once).

    python scripts/sass_loop_mix.py FILE.sass --function NAME_PART            # every loop
    python scripts/sass_loop_mix.py FILE.sass --function NAME_PART --range 0x25a0 0x39d0

Without ``--range`` each backward branch of the function (``BRA`` to a lower address) is a
loop from its target to the branch. A loop whose body holds rarely taken code (an epilogue
behind a branch) overstates an iteration: give the iteration's straight-line path with
``--range`` instead. Opcodes are counted without their modifiers (``HMMA.16816.F32.BF16`` ->
``HMMA``) and predicates. JSON to ``--out`` (or stdout).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys

_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA\b(?:\s+!?U?P\w+,)?\s+(0x[0-9a-f]+)")


def function_instructions(sass: str, name_part: str) -> list[tuple[int, str]]:
    """(address, instruction text) of the first function whose name contains ``name_part``."""
    out, inside, found = [], False, False
    for line in sass.splitlines():
        if "Function :" in line:
            if found and inside:
                break
            inside = name_part in line
            found = found or inside
            continue
        if inside:
            m = _INSN.match(line)
            if m:
                out.append((int(m.group(1), 16), m.group(2)))
    if not found:
        raise SystemExit(f"no function containing {name_part!r}")
    return out


def cubin_sass(cubin: bytes) -> tuple[str, str]:
    """(``cuobjdump -sass`` text, ``--dump-resource-usage`` text) of a cubin, with the
    cuobjdump that Triton's wheel ships (no CUDA toolkit needed)."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], check=True, capture_output=True,
                              text=True).stdout
        usage = subprocess.run([tool, "--dump-resource-usage", path], check=True,
                               capture_output=True, text=True).stdout
    return sass, usage


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0].split(".")[0]


def mix(insns: list[tuple[int, str]], lo: int, hi: int) -> dict:
    body = [t for a, t in insns if lo <= a <= hi]
    ops = collections.Counter(opcode(t) for t in body)
    return {"from": hex(lo), "to": hex(hi), "instructions": len(body),
            "opcodes": dict(ops.most_common())}


def loops(insns: list[tuple[int, str]]) -> list[dict]:
    """One entry per backward branch: the loop from its target to the branch."""
    found = []
    for addr, text in insns:
        m = _BRA.search(text)
        if m and int(m.group(1), 16) < addr:
            found.append(mix(insns, int(m.group(1), 16), addr))
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass", help="cuobjdump -sass output")
    ap.add_argument("--function", required=True, help="part of the (mangled) function name")
    ap.add_argument("--range", nargs=2, metavar=("FROM", "TO"), default=None,
                    help="count this address range (hex, both ends included) instead of loops")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(args.sass) as f:
        insns = function_instructions(f.read(), args.function)
    if args.range:
        result = {"ranges": [mix(insns, int(args.range[0], 16), int(args.range[1], 16))]}
    else:
        result = {"loops": loops(insns)}
    result.update(command=" ".join([sys.executable] + sys.argv), function=args.function)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
