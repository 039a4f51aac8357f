"""scripts/tree_build_clocks.py: decoding of the driver's clock records (the GPU run itself is a
diagnostic on the H200)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
clocks = pytest.importorskip("tree_build_clocks")


def _raw(blocks, us):
    per = 2 * clocks.PAIRS + 1
    arr = np.zeros((clocks.MAX_BLOCKS, per), np.int64)
    for b, marks in enumerate(blocks):
        arr[b, 0] = len(marks)
        for i, (m, c) in enumerate(marks):
            arr[b, 1 + 2 * i], arr[b, 2 + 2 * i] = m, c
    return arr.tobytes() + np.array([us], np.float32).tobytes()


def test_parse_and_summarize():
    blocks_in = [[(0, 1000), (100, 1100), (9009, 1500)],
                 [(0, 50), (100, 250), (101, 300), (9009, 1050)]]
    blocks, us = clocks.parse(_raw(blocks_in, 12.5), bs=2)
    assert us == pytest.approx(12.5)
    assert blocks[0] == [(0, 0), (100, 100), (9009, 400)]
    assert blocks[1] == [(0, 0), (100, 200), (101, 50), (9009, 750)]
    s = clocks.summarize(blocks)
    assert s["mean_cycles_per_mark"] == {"100": 150.0, "101": 50.0, "9009": 575.0}
    assert s["blocks_per_mark"] == {"100": 2, "101": 1, "9009": 2}
    assert s["total_cycles_max"] == 1000 and s["slowest_block"] == 1


def test_parse_ignores_blocks_beyond_batch():
    blocks, _ = clocks.parse(_raw([[(0, 5), (9009, 9)]] * 3, 1.0), bs=2)
    assert len(blocks) == 2
