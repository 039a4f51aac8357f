"""``scripts/gpu_session.sh`` checked on the CPU before device time is spent on it.

Device calls are few and short; a step that dies on a mistyped flag, a ``pytest -k`` that selects
nothing or a grid candidate that cannot tile the Kimi shapes costs a whole call. These tests read
the script's text: its steps match the list in its header, every ``python3 scripts/X.py`` call
passes only options that script accepts, every ``pytest -k`` selects at least one test, and every
fused-MoE ``--grid`` / ``--breakdown-down`` candidate (defaults of ``${VAR:-...}`` included)
builds a config that tiles the benchmark's shapes.
"""
from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def _joined() -> str:
    """The script with backslash-continued lines joined."""
    return re.sub(r"\\\n\s*", " ", SCRIPT.read_text())


def _defaults(text: str) -> str:
    """``${VAR:-default}`` / ``${VAR-default}`` -> ``default`` (one level, the script's only
    forms); ``${VAR:+...}`` and plain ``${VAR}`` / ``$VAR`` -> empty."""
    text = re.sub(r"\$\{\w+:?-([^{}]*)\}", r"\1", text)
    text = re.sub(r"\$\{\w+:\+[^{}]*\}", "", text)
    return re.sub(r"\$\{?\w+\}?", "", text)


def steps() -> dict[str, str]:
    """case label -> its body (up to ``;;``), continuation lines joined, comments dropped."""
    body = _joined().split("case $s in", 1)[1]
    out = {}
    for m in re.finditer(r"^ {4}([a-z0-9]+)\)(.*?);;", body, re.S | re.M):
        text = "\n".join(line.split("#", 1)[0] if line.lstrip().startswith("#") else line
                         for line in m.group(2).splitlines())
        out[m.group(1)] = text
    return out


def header_steps() -> list[str]:
    line = next(ln for ln in SCRIPT.read_text().splitlines() if "# steps:" in ln)
    return line.split("# steps:", 1)[1].split()


def _unrolled(text: str) -> list[str]:
    """``text`` once per combination of its ``for VAR in VALUES; do`` loops' values (defaults
    of ``${...:-...}`` lists), ``$VAR`` / ``${VAR}`` substituted."""
    loops = [(v, _defaults(vals).split())
             for v, vals in re.findall(r"\bfor (\w+) in ([^;]*?); do", text)]
    out = []
    for combo in itertools.product(*(vals for _, vals in loops)):
        t = text
        for (var, _), val in zip(loops, combo):
            t = re.sub(r"\$\{?" + var + r"\}?(?!\w)", val, t)
        out.append(t)
    return out


def script_calls() -> list[tuple[str, str, list[str]]]:
    """(step, script path, argv after it) for every ``python3 scripts/X.py`` call, argv with
    the ``${VAR:-default}`` defaults and the shell loops' values in place."""
    calls = []
    for name, text in ((n, u) for n, t in steps().items() for u in _unrolled(t)):
        for m in re.finditer(r"python3?\s+(?:-u\s+)?(scripts/[\w./-]+\.py)(.*?)(?=\bstep\s|\n|$)",
                             text):
            rest = m.group(2).split(">", 1)[0]  # a redirection ends the call (sh -c "... > f")
            rest = rest.rsplit('"', 1)[0] if rest.count('"') % 2 else rest
            try:
                argv = shlex.split(_defaults(rest))
            except ValueError:  # unbalanced quotes inside sh -c: fall back to whitespace
                argv = _defaults(rest).split()
            if (name, m.group(1), argv) not in calls:
                calls.append((name, m.group(1), argv))
    return calls


@lru_cache(maxsize=None)
def _options(script: str) -> frozenset[str]:
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{script} --help failed:\n{r.stdout[-1500:]}{r.stderr[-1500:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", r.stdout))


def test_every_step_is_listed_in_the_header_and_every_listed_step_exists():
    cases, listed = set(steps()), header_steps()
    assert len(listed) == len(set(listed)), "a step is listed twice in the header"
    assert set(listed) == cases, (f"listed, no case: {sorted(set(listed) - cases)}; "
                                  f"case, not listed: {sorted(cases - set(listed))}")


def test_the_parser_sees_the_calls():
    """Guards the text parsing itself: known calls are found with their flags and defaults."""
    assert len({p for _, p, _ in script_calls()}) >= 10
    moepar = [argv for s, p, argv in script_calls() if s == "moepar"]
    assert len(moepar) == 3  # bm8 grid, half16 grid, down breakdown
    assert ["--grid-block-m", "16"] == moepar[1][moepar[1].index("--grid-block-m"):][:2]
    assert moepar[0][moepar[0].index("--ms") + 1:][:7] == "8 2 4 7 9 12 16".split()
    moestall = [argv for s, p, argv in script_calls() if s == "moestall"
                and p == "scripts/bench_fused_moe.py"]
    assert moestall and all("--profile-ms" in a and "--out" not in a for a in moestall)


@pytest.mark.parametrize("script", sorted({p for _, p, _ in script_calls()}))
def test_every_option_a_step_passes_is_one_the_script_accepts(script):
    assert (ROOT / script).is_file(), f"{script} does not exist"
    known = _options(script)
    bad = sorted({(step, a.split("=", 1)[0]) for step, p, argv in script_calls() if p == script
                  for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known})
    assert not bad, f"{script} --help lists no such option: {bad}"


def pytest_selections() -> list[tuple[str, list[str], str]]:
    """(step, test paths, -k expression) for every ``pytest ... -k EXPR`` call."""
    out = []
    for name, text in steps().items():
        for m in re.finditer(r"pytest(.*?)(?=\bstep\s|\n|$)", text):
            argv = shlex.split(_defaults(m.group(1)))
            if "-k" not in argv:
                continue
            expr = argv[argv.index("-k") + 1]
            paths = [a for a in argv if a.startswith("tests/")]
            out.append((name, paths, expr))
    return out


def test_every_pytest_selection_picks_tests():
    sel = pytest_selections()
    assert sel, "the parser found no pytest -k call"
    for step, paths, expr in sel:
        assert paths, f"{step}: pytest -k {expr!r} names no test file"
        for p in paths:
            assert (ROOT / p).exists(), f"{step}: {p} does not exist"
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                            "no:cacheprovider", *paths, "-k", expr], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        got = re.search(r"(\d+)(?:/\d+)? tests? collected", r.stdout)
        assert got and int(got.group(1)) > 0, (
            f"{step}: pytest {' '.join(paths)} -k {expr!r} selects nothing:\n{r.stdout[-800:]}")


def _grids():
    """(step, option, block_m, half_m, wide_halves, candidates, ms) for every fused-MoE bench
    call with --grid or --breakdown-down."""
    out = []
    for step, script, argv in script_calls():
        if script != "scripts/bench_fused_moe.py":
            continue

        def opt(flag, default=None, argv=argv):
            return argv[argv.index(flag) + 1] if flag in argv else default

        ms = []
        if "--ms" in argv:
            for a in argv[argv.index("--ms") + 1:]:
                if not a.isdigit():
                    break
                ms.append(int(a))
        for flag in ("--grid", "--breakdown-down"):
            spec = opt(flag)
            if spec is None:
                continue
            cands = [tuple(int(v) for v in c.split(",")) for c in spec.split(";") if c]
            half = opt("--grid-half-m", "0")  # the flag alone means 1 (nargs="?")
            wide = opt("--grid-wide-halves", "0")  # (likewise)
            out.append((step, flag, int(opt("--grid-block-m", "0")),
                        int(half) if half.isdigit() else 1, int(wide) if wide.isdigit() else 1,
                        cands, ms or [8, 16, 32, 64, 128]))
    return out


def test_every_moe_grid_candidate_tiles_the_kimi_shapes():
    from sglang_ddtree.triton_kernels import moe_config as mc

    grids = _grids()
    assert any(flag == "--grid" for _, flag, *_ in grids)
    assert any(flag == "--breakdown-down" for _, flag, *_ in grids)
    hidden, inter = 7168, 256  # bench_fused_moe.py's defaults; no step overrides them
    assert not any("--hidden" in a or "--inter" in a for _, _, a in script_calls())
    bad = []
    assert any(wide for _, flag, _, _, wide, *_ in grids if flag == "--grid")
    for step, flag, block_m, half_m, wide, cands, ms in grids:
        for m in ms:
            base = mc.select_config(m)
            for c in cands:
                try:
                    g = mc.GemmConfig(*c)
                    if flag == "--grid":
                        cfg = mc.MoeConfig(block_m or base.block_m, g, base.down, half_m=half_m,
                                           wide_halves=wide)
                    else:
                        cfg = mc.MoeConfig(base.block_m, base.gate_up, g, half_m=base.half_m)
                    mc._fitted(cfg, hidden, inter)
                except (TypeError, ValueError) as exc:
                    bad.append(f"{step} {flag} M={m} {c}: {exc}")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("mib,small", [(81559, True), (143771, False)])
def test_small_card_settings_follow_the_cards_memory(tmp_path, mib, small):
    # session 62 on an H100: four 8-layer Kimi servers at once died of memory at start-up; the
    # script adapts to the card (the 61-layer rank's --mem-fraction-static is
    # bench_cost_curves.default_mem_fraction's, tests/test_cost_curves.py)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {mib}\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), "DDTREE_SKIP_INSTALL": "1"}
    # an unknown step only logs itself: the log then shows the script ran past the card check
    subprocess.run(["bash", str(SCRIPT), "nosuchstep"], cwd=ROOT, env=env, capture_output=True)
    log = (out / "session.log").read_text()
    assert "unknown step nosuchstep" in log, log
    assert ("--max-servers 2" in log) == small, log


COSTS_MOE = "32:block_m=32,half_m=1"  # session 68's cost-curve A/B (gpu_session.sh widemlacosts)


def _variant_lines(text: str) -> list[str]:
    """A step's lines that write variant tables: ``scripts/moe_table_variant.py`` calls (also
    through ``$V``) and the plain assignments they use."""
    keep = []
    for line in text.splitlines():
        s = line.strip()
        if "moe_table_variant.py" in s or s.startswith("$V ") or (
                re.match(r"^[A-Z0-9_]+=", s) and "moe_ab" not in s and "step " not in s):
            keep.append(s)
    return keep


def test_every_variant_table_a_step_writes_loads(tmp_path):
    """Each step's ``moe_table_variant.py`` SPECs apply to the table and load: a band or field
    typo fails here instead of in the device call (the steps run the same lines)."""
    found = {name: _variant_lines(t) for name, t in steps().items()
             if "moe_table_variant.py" in t}
    assert {"moem8pdl", "moebm32", "moem16split", "moepdl", "moerows", "moem28"} <= set(found)
    from sglang_ddtree.triton_kernels import moe_config as mc
    for name, lines in found.items():
        out = tmp_path / name
        out.mkdir()
        script = "\n".join(['python3() { "$PY" "$@"; }', "set -e", *lines])
        r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PY": sys.executable,
                                "WIDEMLA_COSTS_MOE": COSTS_MOE},
                           timeout=300)
        assert r.returncode == 0, f"{name}:\n{script}\n{r.stderr[-1500:]}"
        written = sorted(out.glob("*.json"))
        assert len(written) == sum(ln.count(".json") for ln in lines), (name, written)
        for path in written:
            assert mc._config_table(str(path), None), path


@pytest.mark.parametrize("spec,served", [(COSTS_MOE, True), ("33:block_m=32", False)])
def test_costs_serve_the_variant_table_they_wrote(tmp_path, spec, served):
    """widemlacosts with WIDEMLA_COSTS_MOE: the variant table is written on the card and every
    server gets it; a spec the script refuses stops the step before any server starts."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")
    (fake / "python3").write_text(  # the cost curve only logs itself; the rest runs for real
        f'#!/bin/sh\ncase "$1" in scripts/bench_cost_curves.py) exit 0;; esac\n'
        f'PYTHONPATH= exec {sys.executable} "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), "DDTREE_SKIP_INSTALL": "1",
           "WIDEMLA_COSTS_MOE": spec}
    subprocess.run(["bash", str(SCRIPT), "widemlacosts"], cwd=ROOT, env=env,
                   capture_output=True, timeout=300)
    log = (out / "session.log").read_text()
    table = out / "moe_configs_costs.json"
    assert ("bench_cost_curves.py" in log) == served, log
    assert table.exists() == served, log
    if served:
        assert f"SGLANG_DDTREE_MOE_CONFIG={table}" in log, log
        from sglang_ddtree.triton_kernels import moe_config as mc
        cfg = mc.select_config(32, str(table), None)
        assert (cfg.block_m, cfg.half_m) == (32, 1)
    else:
        assert "no band max_m=33" in log and "refused" in log, log


@pytest.mark.parametrize("spec", ["", "48:gate_up.split_k=2"])
def test_costs_serve_another_cards_table(tmp_path, spec):
    """WIDEMLA_COSTS_MOE_DEVICE: the costs' table is that card's (here the H100's, whose M 28-32
    band has 32-row blocks since session 70), with WIDEMLA_COSTS_MOE's SPECs on top if given,
    and every server gets it; an unknown card's name gives the bands as written."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")
    (fake / "python3").write_text(
        f'#!/bin/sh\ncase "$1" in scripts/bench_cost_curves.py) exit 0;; esac\n'
        f'PYTHONPATH= exec {sys.executable} "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    from sglang_ddtree.triton_kernels import moe_config as mc
    for device, block_m in (("NVIDIA H100 80GB HBM3", 32), ("NVIDIA H200", 16)):
        out = tmp_path / f"out{block_m}"
        env = {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), "DDTREE_SKIP_INSTALL": "1",
               "WIDEMLA_COSTS_MOE_DEVICE": device, "WIDEMLA_COSTS_MOE": spec}
        subprocess.run(["bash", str(SCRIPT), "widemlacosts"], cwd=ROOT, env=env,
                       capture_output=True, timeout=300)
        log = (out / "session.log").read_text()
        table = out / "moe_configs_costs.json"
        assert f"SGLANG_DDTREE_MOE_CONFIG={table}" in log, log
        assert mc.select_config(30, str(table), None).block_m == block_m, device
        if spec:
            assert mc.select_config(48, str(table), None).gate_up.split_k == 2


def test_routercosts_runs_each_variant_with_its_switches(tmp_path):
    """routercosts: AR's decode alone, then DDTREE budget 31 as served, with the router's GEMM
    or the skinny kernel under PDL, or with SGLang's router GEMMs, each with no AR and to its
    own JSON (a repeated variant to _r2), in ROUTERCOSTS_VARIANTS' order; AR and the first
    DDTREE run get the cold-start time; an unknown variant is logged and skipped."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")
    (fake / "python3").write_text("#!/bin/sh\nexit 0\n")  # the cost curves only log themselves
    for f in fake.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), "DDTREE_SKIP_INSTALL": "1",
           "ROUTERCOSTS_VARIANTS": "ar served router_pdl bogus served skinny_pdl router_off"}
    r = subprocess.run(["bash", str(SCRIPT), "routercosts"], cwd=ROOT, env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    log = (out / "session.log").read_text()
    calls = [ln for ln in log.splitlines() if "bench_cost_curves.py" in ln]
    names = ("ar_r1", "served_r1", "router_pdl_r1", "served_r2", "skinny_pdl_r1", "router_off_r1")
    limits = (300, 300, 130, 130, 130, 130)
    assert len(calls) == len(names), log
    for call, name, limit in zip(calls, names, limits):
        stem = name if name == "ar_r1" else f"b31_{name}"
        assert f"cost_curves_kimi_l61_{stem}_h200.json" in call, call
        assert "SGLANG_DDTREE_FUSED_MOE=1" in call and f"(limit {limit}s)" in call, call
        assert ("--baselines=" in call) == (name != "ar_r1"), call
        assert ("--timer-budgets 31 " in call) == (name != "ar_r1"), call
    assert "--timer-budgets  --concurrency" in calls[0]  # AR alone: no DDTREE budget
    assert "SGLANG_DDTREE_ROUTER_GEMM=1" in calls[2] and "SGLANG_DDTREE_SKINNY_PDL=1" in calls[2]
    assert "SGLANG_DDTREE_SKINNY_GEMM=1" in calls[4] and "SGLANG_DDTREE_SKINNY_PDL=1" in calls[4]
    assert "SGLANG_DDTREE_ROUTER_GEMM=0" in calls[5] and "SKINNY" not in calls[5]
    assert all("SGLANG_DDTREE_SKINNY" not in c and "ROUTER" not in c for c in calls[:2] + calls[3:4])
    assert "unknown variant bogus" in log, log


def test_routercosts_names_files_by_budget(tmp_path):
    """ROUTERCOSTS_BUDGETS=15 times budget 15 and names its JSON b15 (session 75's call named
    budget 15's files b31); AR's file carries no budget."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")
    (fake / "python3").write_text("#!/bin/sh\nexit 0\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), "DDTREE_SKIP_INSTALL": "1",
           "ROUTERCOSTS_VARIANTS": "ar served router_pdl", "ROUTERCOSTS_BUDGETS": "15"}
    r = subprocess.run(["bash", str(SCRIPT), "routercosts"], cwd=ROOT, env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = [ln for ln in (out / "session.log").read_text().splitlines()
             if "bench_cost_curves.py" in ln]
    assert len(calls) == 3, calls
    assert "cost_curves_kimi_l61_ar_r1_h200.json" in calls[0], calls[0]
    for call, name in zip(calls[1:], ("served_r1", "router_pdl_r1")):
        assert f"cost_curves_kimi_l61_b15_{name}_h200.json" in call, call
        assert "--timer-budgets 15 " in call and "b31" not in call, call
