"""scripts/moe_variant_sass.py: the dependent-HMMA chain count on synthetic SASS and the programs
an SM each resource allows (CPU)."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "moe_variant_sass.py")
_spec = importlib.util.spec_from_file_location("moe_variant_sass", _PATH)
mvs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mvs)


def body(*lines):
    return [(16 * i, t) for i, t in enumerate(lines)]


def test_one_accumulator_chains_every_mma():
    assert mvs.hmma_chain(body(
        "HMMA.16816.F32.BF16 R32, R4, R8, R32",
        "LOP3.LUT R4, R5, 0xf, RZ, 0xc0, !PT",
        "HMMA.16816.F32.BF16 R32, R4, R10, R32",
        "HMMA.16816.F32.BF16 R40, R12, R14, R32",  # renamed output, still the chain
        "HMMA.16816.F32.BF16 R40, R16, R18, R40")) == 4


def test_two_accumulators_halve_the_chain_and_a_rewrite_breaks_it():
    assert mvs.hmma_chain(body(
        "HMMA.16816.F32.BF16 R32, R4, R8, R32",
        "HMMA.16816.F32.BF16 R48, R4, R8, R48",
        "HMMA.16816.F32.BF16 R32, R6, R8, R32",
        "HMMA.16816.F32.BF16 R48, R6, R8, R48")) == 2
    assert mvs.hmma_chain(body(
        "HMMA.16816.F32.BF16 R32, R4, R8, R32",
        "MOV R32, RZ",  # a fresh accumulator
        "@P0 STS [R2], R32",  # a store does not write its register operand
        "HMMA.16816.F32.BF16 R32, R6, R8, R32")) == 1
    assert mvs.hmma_chain(body("HGMMA.64x8x16.F32.BF16 R24, gdesc[UR4], R24")) == 0


def test_programs_an_sm_take_the_tightest_resource():
    # 4 warps: 128 registers fit 4 programs, 130 (rounded up to 136) only 3
    assert mvs.programs_per_sm(128, 57344, 4)["programs"] == 4
    assert mvs.programs_per_sm(130, 57344, 4) == {"registers": 3, "shared_memory": 4,
                                                  "warps": 16, "programs": 3}
    # shared memory with 1 KB reserved a program: 48 KB allows 4, 36 KB 6
    assert mvs.programs_per_sm(80, 49152, 4)["programs"] == 4
    assert mvs.programs_per_sm(79, 36864, 4)["programs"] == 6
    # warps: 2-warp programs stop at 32 a SM
    assert mvs.programs_per_sm(32, 1024, 2)["programs"] == 32
