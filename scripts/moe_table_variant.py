"""Write a variant of the fused MoE's config table, to time against the served one.

The base is the table as this card serves it (``moe_config.table_json``: the shipped table, or
``SGLANG_DDTREE_MOE_CONFIG``, with this device's overrides merged and the ``devices`` section
dropped), or ``--base PATH``. Each SPEC changes fields of one or more bands::

    python3 scripts/moe_table_variant.py OUT.json "8:down.n_per_cta=512"
    python3 scripts/moe_table_variant.py OUT.json \\
        "32,48:block_m=32,half_m=1,gate_up.par_acc=0,gate_up.num_stages=2"

``BANDS:FIELD=VALUE[,FIELD=VALUE...]``: BANDS the ``max_m`` of each band to change (comma
separated), FIELD a band field (``MoeConfig``'s: ``block_m``, ``half_m``, ...) or
``gate_up.F`` / ``down.F`` (``GemmConfig``'s), VALUE an integer. SPECs apply in order. A band
the table lacks, a field neither dataclass has, or a table that then fails to load (the
loader's own checks) is refused before anything is written: a typo costs a CPU second here
rather than a device call. ``--device NAME`` takes that card's overrides instead of the
current CUDA device's ("" for the bands as written), for checking a step's SPECs on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

from sglang_ddtree.triton_kernels import moe_config

_BAND_FIELDS = {f.name for f in dataclasses.fields(moe_config.MoeConfig)} - {"gate_up", "down"}
_GEMM_FIELDS = {f.name for f in dataclasses.fields(moe_config.GemmConfig)}


def parse_spec(spec: str) -> tuple[list[int], list[tuple[str | None, str, int]]]:
    """``"32,48:block_m=32,gate_up.par_acc=0"`` -> ([32, 48], [(None, "block_m", 32),
    ("gate_up", "par_acc", 0)]). ValueError naming the spec for any part that is not one."""
    bands, sep, assigns = spec.partition(":")
    if not sep or not bands.strip() or not assigns.strip():
        raise ValueError(f"{spec!r}: want BANDS:FIELD=VALUE[,FIELD=VALUE...]")
    try:
        max_ms = [int(b) for b in bands.split(",")]
    except ValueError:
        raise ValueError(f"{spec!r}: the bands before ':' are max_m integers") from None
    changes = []
    for assign in assigns.split(","):
        key, eq, value = assign.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"{spec!r}: {assign!r} is not FIELD=VALUE")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: {key}'s value {value!r} is not an integer") from None
        gemm, dot, field = key.rpartition(".")
        if dot:
            if gemm not in ("gate_up", "down"):
                raise ValueError(f"{spec!r}: {key!r}: only gate_up.F and down.F have a '.'")
            if field not in _GEMM_FIELDS:
                raise ValueError(f"{spec!r}: {field!r} is not a GemmConfig field "
                                 f"({', '.join(sorted(_GEMM_FIELDS))})")
            changes.append((gemm, field, number))
        else:
            if field not in _BAND_FIELDS:
                raise ValueError(f"{spec!r}: {field!r} is not a band field "
                                 f"({', '.join(sorted(_BAND_FIELDS))}; tile fields take "
                                 "gate_up. or down.)")
            changes.append((None, field, number))
    return max_ms, changes


def apply_specs(table: dict, specs: list[str]) -> dict:
    """A copy of ``table`` with each spec applied in order (ValueError for a missing band)."""
    table = json.loads(json.dumps(table))
    for spec in specs:
        max_ms, changes = parse_spec(spec)
        for max_m in max_ms:
            band = next((b for b in table["bands"] if b["max_m"] == max_m), None)
            if band is None:
                have = [b["max_m"] for b in table["bands"]]
                raise ValueError(f"{spec!r}: the table has no band max_m={max_m} (it has {have})")
            for gemm, field, value in changes:
                (band[gemm] if gemm else band)[field] = value
    return table


def check_loads(table: dict) -> None:
    """The loader's checks on ``table`` (removed options, dataclass fields): ValueError /
    TypeError as serving it would raise them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "table.json")
        with open(path, "w") as f:
            json.dump(table, f)
        moe_config._config_table(path, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where to write the variant table (JSON)")
    ap.add_argument("specs", nargs="*", metavar="SPEC",
                    help="BANDS:FIELD=VALUE[,FIELD=VALUE...] (none: the table as --device's card "
                         "is served it, written out whole)")
    ap.add_argument("--base", default=None,
                    help="the table to start from (default: SGLANG_DDTREE_MOE_CONFIG, else the "
                         "shipped one)")
    ap.add_argument("--device", default=None,
                    help="merge this card's overrides (default: the current CUDA device's; "
                         "'' for none)")
    args = ap.parse_args(argv)
    device = moe_config._AUTO if args.device is None else (args.device or None)
    try:
        table = apply_specs(moe_config.table_json(args.base, device), args.specs)
        check_loads(table)
    except (OSError, ValueError, TypeError) as e:
        print(f"moe_table_variant: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
