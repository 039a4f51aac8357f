"""scripts/sass_loop_mix.py on a hand-written cuobjdump listing: the loop found from its
backward branch, an explicit range, opcodes without modifiers or predicates, and only the
named function's instructions."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))

SASS = """
\t\tFunction : _Z5otherv
        /*0000*/                   MOV R1, c[0x0][0x28] ;      /* 0x00000a0000017a02 */
        /*0010*/                   BRA 0x0 ;                   /* 0xfffffffc00fc7947 */
\t\tFunction : _Z4mainv
        /*0000*/                   MOV R1, c[0x0][0x28] ;      /* 0x00000a0000017a02 */
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, R4, 0xf8, !PT ;   /* 0x0 */
        /*0020*/                   HFMA2.BF16_V2 R2, R2, R5, R6 ;   /* 0x0 */
        /*0030*/              @!P0 LOP3.LUT R7, R3, 0xf000f, R4, 0xf8, !PT ;   /* 0x0 */
        /*0040*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;   /* 0x0 */
        /*0050*/               @P1 BRA 0x10 ;                  /* 0xffffffec00a40947 */
        /*0060*/                   EXIT ;                      /* 0x000000000000794d */
"""


def test_loop_range_and_opcodes(tmp_path):
    import sass_loop_mix as m

    insns = m.function_instructions(SASS, "4main")
    assert [a for a, _ in insns] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    (loop,) = m.loops(insns)
    assert (loop["from"], loop["to"], loop["instructions"]) == ("0x10", "0x50", 5)
    assert loop["opcodes"] == {"LOP3": 2, "HFMA2": 1, "HMMA": 1, "BRA": 1}
    assert m.mix(insns, 0x20, 0x40)["instructions"] == 3
    path = tmp_path / "k.sass"
    path.write_text(SASS)
    out = tmp_path / "mix.json"
    assert m.main([str(path), "--function", "4main", "--range", "0x0", "0x10",
                   "--out", str(out)]) == 0
    assert '"instructions": 2' in out.read_text()
