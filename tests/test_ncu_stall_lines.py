"""scripts/ncu_stall_lines.py: nvdisasm and ncu CSV parsing, the opcode check, per-line sums (CPU)."""
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "ncu_stall_lines.py")
_spec = importlib.util.spec_from_file_location("ncu_stall_lines", _PATH)
nsl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nsl)

DISASM = """\t.section\t.text._ZN6ddtree17tree_build_kernelILi0EEEvNS_15TreeBuildParamsE,"ax",@progbits
.text._ZN6ddtree17tree_build_kernelILi0EEEvNS_15TreeBuildParamsE:
\t//## File "/x/tree_build_kernel.cuh", line 5
        /*0000*/                   MOV R1, R2 ;
.text._ZN6ddtree17tree_build_kernelILi3EEEvNS_15TreeBuildParamsE:
\t//## File "/x/tree_build_kernel.cuh", line 925
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/x/tree_build_params.h", line 101
        /*0010*/                   ULDC.64 UR12, c[0x0][0x248] ;
        /*0020*/              @!P0 BRA 0x80 ;
.text._ZN6ddtree26tree_build_frontier_kernelILi9EEEvNS_15TreeBuildParamsE:
        /*0000*/                   EXIT ;
"""

CSV = """==PROF== Connected to process 1
"Kernel Name","void ddtree::tree_build_kernel<(int)3>(ddtree::TreeBuildParams)",
"Address","Source","Instructions Executed","stall_barrier","stall_wait","stall_no_inst","stall_wait (Not Issued)"
"0x7f0000000000","      LDC R1, c[0x0][0x28]","512","0","1","9","4"
"0x7f0000000010","      ULDC.64 UR12, c[0x0][0x248]","512","3","2","0","0"
"0x7f0000000020","      @!P0 BRA 0x7f0000000080","40","0","5","1","0"
"""


def test_disassembly_of_one_kernel_maps_offsets_to_lines():
    sass = nsl.parse_nvdisasm(DISASM, "tree_build_kernelILi3E")
    assert sass == {0x0: (("tree_build_kernel.cuh", 925), "LDC R1, c[0x0][0x28]"),
                    0x10: (("tree_build_params.h", 101), "ULDC.64 UR12, c[0x0][0x248]"),
                    0x20: (("tree_build_params.h", 101), "@!P0 BRA 0x80")}


def test_samples_sum_per_line_and_not_issued_columns_are_left_out():
    by = nsl.per_line(nsl.read_profile(CSV), nsl.parse_nvdisasm(DISASM, "ILi3E"))
    first = by[("tree_build_kernel.cuh", 925)]
    assert (first["stall_wait"], first["stall_no_inst"], first["n"]) == (1, 9, 1)
    params = by[("tree_build_params.h", 101)]
    assert (params["stall_wait"], params["stall_barrier"], params["n"], params["exec"]) == (7, 3, 2, 512)
    out = nsl.table(by, 5, {})
    assert "samples: 21 (3 at a barrier, 18 not)" in out


def test_different_code_is_refused():
    other = DISASM.replace("ULDC.64 UR12", "IMAD R3")
    with pytest.raises(ValueError, match="not the same code"):
        nsl.per_line(nsl.read_profile(CSV), nsl.parse_nvdisasm(other, "ILi3E"))


def test_a_csv_without_the_table_is_refused():
    with pytest.raises(ValueError, match="Address"):
        nsl.read_profile('"Kernel Name","x"\n')


def test_opcode_drops_the_predicate():
    assert nsl.opcode("      @!P0 BRA 0x80 ;") == "BRA"
    assert nsl.opcode("LDS.128 R4, [R2]") == "LDS.128"
