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


SOURCE = """// file scope
constexpr int k = 1;
__device__ __forceinline__ int count_above(float s, const float* lp) {
  return 0;
}
template <int MODE>
__global__ void __launch_bounds__(MODE == 0 ? 256 : 1024)
    tree_build_kernel(const TreeBuildParams p) {
  int x = 0;
}
__global__ void __launch_bounds__(kFrontierMaxThreads, 1) tree_build_frontier_kernel(const P p) {
  int y = 0;
}
""".split("\n")


def test_lines_map_to_their_enclosing_function():
    f = nsl.function_of_lines(SOURCE)
    assert f[0] == f[1] == "(file scope)"
    assert f[2] == f[3] == "count_above"
    # the template line still belongs to the previous function; the kernel's name is on the
    # line after its __launch_bounds__
    assert f[6] == f[7] == f[8] == "tree_build_kernel"
    assert f[10] == f[11] == "tree_build_frontier_kernel"


def test_per_function_sums_add_lines_and_keep_the_most_executions():
    by_line = {("k.cuh", 3): nsl.collections.Counter(stall_wait=2, n=1, exec=10),
               ("k.cuh", 4): nsl.collections.Counter(stall_wait=3, n=2, exec=7),
               ("k.cuh", 9): nsl.collections.Counter(stall_no_inst=5, n=1, exec=4)}
    by = nsl.by_function(by_line, {"k.cuh": SOURCE})
    assert by[("k.cuh", "count_above")] == nsl.collections.Counter(stall_wait=5, n=3, exec=10)
    assert by[("k.cuh", "tree_build_kernel")]["stall_no_inst"] == 5
    assert "k.cuh:count_above" in nsl.table(by, 5, {"k.cuh": SOURCE})
