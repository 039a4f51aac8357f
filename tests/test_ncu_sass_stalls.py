"""scripts/ncu_sass_stalls.py: launches split, samples per reason / opcode / loop (CPU)."""
import importlib.util
import json
import os

import pytest

_SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
_spec = importlib.util.spec_from_file_location(
    "ncu_sass_stalls", os.path.join(_SCRIPTS, "ncu_sass_stalls.py"))
nss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nss)

HEADER = ('"Address","Source","Instructions Executed","stall_long_sb","stall_selected",'
          '"stall_wait","stall_wait (Not Issued)"')
# a loop 0x10-0x30 (the branch back at 0x30), then an exit
LAUNCH = """"Kernel Name","{name}",
""" + HEADER + """
"0x7f0000000000","      MOV R1, R2","64","0","1","0","9"
"0x7f0000000010","      LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]","640","0","2","3","0"
"0x7f0000000020","      HMMA.16816.F32.BF16 R8, R12, R16, R8","640","10","4","6","0"
"0x7f0000000030","      @P0 BRA 0x7f0000000010","640","0","1","1","0"
"0x7f0000000040","      EXIT","64","0","0","2","0"
"""


def test_one_launch_by_reason_opcode_and_loop():
    text = "==PROF== Connected to process 1\n" + LAUNCH.format(name="_gate_up_kernel")
    (name, part), = nss.split_launches(text)
    assert name == "_gate_up_kernel"
    rep = nss.summarize(nss.read_profile(part), top=2)
    assert rep["samples"] == 30 and rep["instructions"] == 5
    assert rep["issuing_share"] == pytest.approx(8 / 30, abs=1e-4)
    # reasons sorted by samples; the "(Not Issued)" columns are not counted again
    assert rep["reasons"] == [["stall_wait", round(12 / 30, 4)],
                              ["stall_long_sb", round(10 / 30, 4)],
                              ["stall_selected", round(8 / 30, 4)]]
    ops = {o["opcode"]: o for o in rep["opcodes"]}
    assert ops["HMMA"]["samples"] == 20 and ops["HMMA"]["reasons"][0] == ["stall_long_sb", 0.5]
    assert ops["MOV"]["samples"] == 1  # predicates and modifiers dropped: "@P0 BRA" -> BRA
    assert ops["BRA"]["samples"] == 2
    (loop,) = rep["loops"]
    assert (loop["from"], loop["to"], loop["instructions"]) == ("0x10", "0x30", 3)
    assert loop["samples"] == 27 and loop["share"] == pytest.approx(0.9)
    assert [t["offset"] for t in rep["top_instructions"]] == ["0x20", "0x10"]


def test_several_launches_in_one_file_and_the_cli(tmp_path):
    text = LAUNCH.format(name="_gate_up_kernel") + LAUNCH.format(name="_down_loop_kernel")
    parts = nss.split_launches(text)
    assert [n for n, _ in parts] == ["_gate_up_kernel", "_down_loop_kernel"]
    csv_path = tmp_path / "two.csv"
    csv_path.write_text(text)
    out = tmp_path / "s.json"
    assert nss.main([str(csv_path), "--out", str(out)]) == 0
    launches = json.loads(out.read_text())["launches"]
    assert [x["kernel"] for x in launches] == ["_gate_up_kernel", "_down_loop_kernel"]
    assert all(x["samples"] == 30 for x in launches)


def test_count_cells_with_separators_or_none():
    row = {"a": "1,234", "b": "-", "c": "", "d": None, "e": "7"}
    assert [nss.samples(row, k) for k in "abcdef"] == [1234, 0, 0, 0, 7, 0]


def test_a_file_without_a_kernel_line_is_one_launch():
    (name, part), = nss.split_launches(HEADER + '\n"0x10","      EXIT","1","0","1","0","0"\n')
    assert name == "?" and nss.summarize(nss.read_profile(part))["samples"] == 1


def test_session_13_profile():
    """The real ncu table in bench_results: every sample counted once, the shares add up."""
    path = os.path.join(os.path.dirname(__file__), "..", "bench_results",
                        "ncu_tree_build_h200_s13_sass.csv.gz")
    rows = nss.read_profile(nss.read(path))
    rep = nss.summarize(rows)
    assert rep["samples"] == sum(nss.samples(r, "Warp Stall Sampling (All Samples)")
                                 for r in rows) == 11540
    assert sum(v for _, v in rep["reasons"]) == pytest.approx(1.0, abs=1e-3)
    assert rep["opcodes"][0]["opcode"] == "LDS"
    assert rep["reasons"][0][0] == "stall_barrier"
