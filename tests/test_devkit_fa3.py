"""scripts/devkit_fa3.py: sgl_kernel's flash_ops cut into checked parts and put back together
on the device (a small stand-in wheel; every part staged in any order)."""
from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("devkit_fa3",
                                              HERE.parent / "scripts" / "devkit_fa3.py")
fa3 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fa3)


def _wheel(tmp_path, payload: bytes, member=fa3.MEMBER):
    whl = tmp_path / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, payload)
        z.writestr("sgl_kernel/__init__.py", "")
    return whl


def _kernel_package(site):
    """What the kit's sglang-kernel chunk leaves in the site directory."""
    (site / "sgl_kernel").mkdir(parents=True, exist_ok=True)
    (site / "sgl_kernel" / "__init__.py").write_text("")
    return site


def _payload(n=300_000):
    # compressible but not trivially: a repeating pattern with noise
    rnd = os.urandom(n // 4)
    return (b"sm90a cubin " * (n // 16))[: n - len(rnd)] + rnd


def test_parts_join_back_into_the_library(tmp_path):
    payload = _payload()
    out = tmp_path / "kit" / "fa3"
    manifest = fa3.build(_wheel(tmp_path, payload), out, part_bytes=30_000, preset=1)
    parts = [p["name"] for p in manifest["parts"]]
    assert len(parts) >= 3 and sum(p["bytes"] for p in manifest["parts"]) == manifest["xz_bytes"]
    assert all((out / p).stat().st_size <= 30_000 for p in parts)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    stage, site = tmp_path / "stage", tmp_path / "site"
    with pytest.raises(SystemExit, match="sglang-kernel chunk first"):
        fa3.install(out / parts[0], out / "manifest.json", stage, site)
    _kernel_package(site)
    order = parts[1:] + parts[:1]  # any order
    for i, name in enumerate(order):
        msg = fa3.install(out / name, out / "manifest.json", stage, site)
        if i < len(order) - 1:
            assert msg.startswith(f"staged {name}") and f"{i + 1} of {len(parts)}" in msg
            assert not (site / fa3.MEMBER).exists()
    assert msg.startswith("installed") and "sha256 checked" in msg
    assert (site / fa3.MEMBER).read_bytes() == payload
    assert not stage.exists()


def test_a_corrupt_or_foreign_part_is_refused(tmp_path):
    out = tmp_path / "fa3"
    fa3.build(_wheel(tmp_path, _payload()), out, part_bytes=50_000, preset=1)
    bad = out / "part_01"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    site = _kernel_package(tmp_path / "site")
    with pytest.raises(SystemExit, match="does not match its manifest"):
        fa3.install(bad, out / "manifest.json", tmp_path / "stage", site)
    stray = tmp_path / "part_99"
    stray.write_bytes(b"x")
    with pytest.raises(SystemExit, match="not in"):
        fa3.install(stray, out / "manifest.json", tmp_path / "stage", site)


def test_a_stripped_wheel_and_no_room_name_the_problem(tmp_path):
    whl = _wheel(tmp_path, b"x", member="sgl_kernel/other.so")
    with pytest.raises(SystemExit, match="no sgl_kernel/flash_ops"):
        fa3.build(whl, tmp_path / "fa3", part_bytes=1000)
    with pytest.raises(SystemExit, match="no room"):
        fa3.build(whl, tmp_path / "fa3", part_bytes=0)


def test_the_kits_kernel_version_is_read_from_its_wheel(tmp_path):
    (tmp_path / "w1b").mkdir()
    (tmp_path / "w1b" / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl").write_bytes(b"")
    assert fa3.kit_kernel_version(tmp_path) == "0.4.5"
    with pytest.raises(SystemExit, match="no sglang_kernel wheel"):
        fa3.kit_kernel_version(tmp_path / "w1b")


def test_without_pythons_lzma_the_xz_command_decompresses(tmp_path, monkeypatch):
    import shutil
    import sys

    if shutil.which("xz") is None:
        pytest.skip("no xz command")
    payload = _payload(100_000)
    out = tmp_path / "fa3"
    manifest = fa3.build(_wheel(tmp_path, payload), out, part_bytes=20_000, preset=1)
    monkeypatch.setitem(sys.modules, "lzma", None)  # import lzma -> ImportError
    _kernel_package(tmp_path / "s")
    for p in manifest["parts"]:
        msg = fa3.install(out / p["name"], out / "manifest.json", tmp_path / "st", tmp_path / "s")
    assert msg.startswith("installed")
    assert (tmp_path / "s" / fa3.MEMBER).read_bytes() == payload
