"""scripts/devkit_chunks.py: the kit's wheel chunks re-cut so that each device call (chunk +
checkout + kit extras) stays under the carry limit (sparse files stand in for wheels)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("devkit_chunks",
                                              HERE.parent / "scripts" / "devkit_chunks.py")
dc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dc)
MIB = dc.MIB


def _kit(tmp_path, chunks):
    kit = tmp_path / ".devkit"
    kit.mkdir()
    (kit / "install.sh").write_text("#!/bin/bash\n")
    (kit / "serve.sh").write_text("#!/bin/bash\n")
    (kit / "models").mkdir()
    (kit / "models" / "config.json").write_text("{}")
    for name, wheels in chunks.items():
        (kit / name).mkdir()
        for w, mib in wheels.items():
            with open(kit / name / w, "wb") as f:
                f.truncate(int(mib * MIB))  # sparse: the size is what counts
    return kit


def test_a_chunk_that_fits_is_left_alone(tmp_path):
    kit = _kit(tmp_path, {"w1": {"a.whl": 20, "b.whl": 20}, "w2": {"c.whl": 40}})
    entries = dc.plan(kit, checkout=10 * MIB)
    assert [(e["chunk"], e["fits"], e["last"]) for e in entries] == [("w1", True, False),
                                                                      ("w2", True, True)]
    assert dc.apply(kit, entries) == [("w1", False), ("w2", True)]
    assert sorted(p.name for p in kit.iterdir() if p.name.startswith("w")) == ["w1", "w2"]


def test_a_chunk_too_big_for_the_checkout_is_cut_into_parts_that_fit(tmp_path):
    # session 32: w1 of 47 MiB beside an 18 MiB checkout
    kit = _kit(tmp_path, {"w1": {"sglang.whl": 21.3, "kernel.whl": 17.4, "zstd.whl": 5.3,
                                 "tvm.whl": 2.6, "small.whl": 0.5},
                          "w2": {"rest.whl": 44.3}})
    checkout = int(18.4e6)
    entries = dc.plan(kit, checkout)
    assert not entries[0]["fits"] and entries[1]["fits"]
    parts = entries[0]["parts"]
    assert sorted(w for p in parts for w in p) == sorted(os.listdir(kit / "w1"))
    room = dc.LIMIT - checkout - (kit / "install.sh").stat().st_size - dc.MARGIN
    for p in parts:
        assert sum((kit / "w1" / w).stat().st_size for w in p) <= room
    calls = dc.apply(kit, entries)
    assert calls == [("w1a", False), ("w1b", False), ("w2", True)]
    for name, wheels in zip(("w1a", "w1b"), parts):
        assert sorted(os.listdir(kit / name)) == sorted(wheels)
        for w in wheels:  # the same file, not a copy
            assert os.path.samefile(kit / name / w, kit / "w1" / w)
    # the parts now stand for w1: a second run finds them and changes nothing
    again = dc.plan(kit, checkout)
    assert [e["chunk"] for e in again] == ["w1a", "w1b", "w2"] and all(e["fits"] for e in again)


def test_the_last_call_counts_the_kit_extras(tmp_path):
    kit = _kit(tmp_path, {"w1": {"a.whl": 10}, "w2": {"b.whl": 15, "c.whl": 15}})
    with open(kit / "models" / "big.bin", "wb") as f:
        f.truncate(5 * MIB)
    entries = dc.plan(kit, checkout=10 * MIB, limit=44 * MIB)
    assert entries[0]["fits"]  # 10 + 10: the models travel with the last call only
    assert not entries[1]["fits"]  # 30 + 10 + 5 > 44
    assert entries[1]["parts"] == [["b.whl"], ["c.whl"]]
    assert dc.apply(kit, entries) == [("w1", False), ("w2a", False), ("w2b", True)]


def test_a_wheel_larger_than_the_room_names_the_fix(tmp_path):
    kit = _kit(tmp_path, {"w1": {"huge.whl": 50}})
    with pytest.raises(SystemExit, match="shrink the checkout"):
        dc.plan(kit, checkout=20 * MIB)


def test_the_checkout_is_measured_as_git_sees_it(tmp_path):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git")
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "tracked.txt").write_bytes(b"x" * 1000)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"y" * 5000)
    (repo / "new.txt").write_bytes(b"z" * 300)  # untracked, not ignored: it travels
    subprocess.run(["git", "-C", str(repo), "add", "tracked.txt", ".gitignore"], check=True)
    assert dc.checkout_bytes(repo) == sum(dc.counted(n) for n in (1000, 300, len("ignored/\n")))


def test_fa3_parts_are_listed_with_whether_they_fit(tmp_path):
    import json

    kit = _kit(tmp_path, {"w1": {"a.whl": 10}})
    assert dc.fa3_calls(kit, checkout=10 * MIB) == []
    (kit / "fa3").mkdir()
    for name, mib in (("part_00", 40), ("part_01", 5)):
        with open(kit / "fa3" / name, "wb") as f:
            f.truncate(int(mib * MIB))
    (kit / "fa3" / "manifest.json").write_text(json.dumps({"parts": [
        {"name": "part_00", "bytes": 40 * MIB}, {"name": "part_01", "bytes": 5 * MIB}]}))
    calls = dc.fa3_calls(kit, checkout=20 * MIB)
    assert [c[0][1] for c in calls] == [".devkit/fa3/part_00", ".devkit/fa3/part_01"]
    assert calls[0][1] == "python3 scripts/devkit_fa3.py install .devkit/fa3/part_00"
    assert [c[2] for c in calls] == [True, True]
    assert [c[2] for c in dc.fa3_calls(kit, checkout=30 * MIB)] == [False, True]


def test_files_count_in_whole_blocks(tmp_path):
    """Session 61: a call the sizes put at 63.7 MiB was refused as over 64 MiB; each file
    counts for whole 4 KiB blocks (806 small checkout files: 1.6 MiB more than their sizes),
    the wheels and the kit's extras too."""
    assert [dc.counted(n) for n in (0, 1, 4096, 4097, 20 * MIB)] == [0, 4096, 4096, 8192,
                                                                      20 * MIB]
    kit = _kit(tmp_path, {"w1": {f"s{i}.whl": 1 / MIB for i in range(10)}})
    # ten 1-byte wheels and the extras (install.sh, serve.sh, models/config.json): 13 blocks
    (entry,) = dc.plan(kit, checkout=dc.counted(5))
    assert entry["carried_bytes"] == 14 * dc.BLOCK



def test_recut_plans_from_the_kit_own_chunks_once_the_checkout_shrank(tmp_path, capsys):
    """Cut beside a 25 MiB checkout (w1 into two parts, w2 into three, one part cut again);
    beside a slim one (scripts/slim_checkout.py hide) ``--recut`` drops those parts and each
    of the kit's chunks takes one call."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git")
    kit = _kit(tmp_path, {"w1": {"sglang.whl": 21.3, "kernel.whl": 17.4, "zstd.whl": 5.3},
                          "w2": {"flashinfer.whl": 14.3, "transformers.whl": 10.6,
                                 "jedi.whl": 4.7, "rest.whl": 13.0}})
    assert [c for c, _ in dc.apply(kit, dc.plan(kit, checkout=25 * MIB))] != ["w1", "w2"]
    for name, wheels in (("w2a", ["flashinfer.whl", "transformers.whl"]),  # a part cut again
                         ("w2aa", ["flashinfer.whl"]), ("w2ab", ["transformers.whl"])):
        (kit / name).mkdir(exist_ok=True)
        for w in wheels:
            if not (kit / name / w).exists():
                os.link(kit / "w2" / w, kit / name / w)
    assert [d.name for d in dc.chunk_dirs(kit, own=True)] == ["w1", "w2"]
    entries = dc.plan(kit, checkout=12 * MIB, own=True)
    assert [(e["chunk"], e["fits"]) for e in entries] == [("w1", True), ("w2", True)]
    repo = tmp_path / "slim"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    assert dc.main(["--kit", str(kit), "--repo", str(repo), "--recut", "--dry-run"]) == 0
    assert any(p.name == "w1a" for p in kit.iterdir())  # a dry run changes nothing
    capsys.readouterr()
    assert dc.main(["--kit", str(kit), "--repo", str(repo), "--recut"]) == 0
    out = capsys.readouterr().out
    assert "dropped the parts earlier runs cut: " in out
    assert sorted(p.name for p in kit.iterdir() if p.name.startswith("w")) == ["w1", "w2"]
    assert sorted(os.listdir(kit / "w2")) == ["flashinfer.whl", "jedi.whl", "rest.whl",
                                              "transformers.whl"]  # the wheels stay
    calls = [ln for ln in out.splitlines() if ln.startswith("  carry ")]
    assert len(calls) == 2 and calls[-1].endswith('device_call.sh "STEPS"')
