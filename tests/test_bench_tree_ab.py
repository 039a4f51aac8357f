"""scripts/bench_tree_ab.py: point parsing and the per-round summary (CPU; the timing needs a GPU)."""
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_tree_ab.py")
_spec = importlib.util.spec_from_file_location("bench_tree_ab", _PATH)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def test_points_parse_in_order():
    assert ab.parse_points("peaked:64:64,random:8:32") == [("peaked", 64, 64), ("random", 8, 32)]
    with pytest.raises(ValueError):
        ab.parse_points("peaked:64")


def test_summary_is_median_and_range_per_variant():
    rows = [
        {"variant": "base", "us": {"p": 20.0}},
        {"variant": "new", "us": {"p": 19.0}},
        {"variant": "base", "us": {"p": 22.0}},
        {"variant": "new", "us": {"p": 19.5}},
        {"variant": "base", "us": {"p": 19.9}},
        {"variant": "new", "us": {"p": 30.0}},
    ]
    s = ab.summarize(rows)
    assert s["base"]["p"] == dict(median=20.0, min=19.9, max=22.0, rounds=3)
    # one slow round moves the range, not the median
    assert s["new"]["p"] == dict(median=19.5, min=19.0, max=30.0, rounds=3)
