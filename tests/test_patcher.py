"""The patch engine and the shipped patches, on the real upstream wheels (CPU, needs PyPI once).

Wheels are fetched with ``pip download --no-deps`` into ``$SGLANG_DDTREE_WHEEL_CACHE`` (default
``~/.cache/sglang-ddtree-wheels``) and reused; a failed download fails the test (no skip). Only the
files a test needs are unpacked, into a temporary site-packages with the package's dist-info.
"""

from __future__ import annotations

import hashlib
import json
import os
import py_compile
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from sglang_ddtree import patcher

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"

# Every (package, version) the manifest knows; the wheels are pinned to CPython 3.11 manylinux so
# the same bytes come down everywhere (the .py files are identical across Python tags).
RELEASES = [("triton", "3.6.0"), ("triton", "3.8.0"), ("sglang", "0.5.17"), ("sglang", "0.5.23")]

# Text each patched file must contain, per patch id.
MARKERS = {
    "triton-python-headers": ["def _find_python_include_dir(", "-dev", "CPATH", "INCLUDEPY",
                              "py_include_dir = _find_python_include_dir(scheme, include_dirs)"],
    "sglang-vision-fa4-fallback": ["def _fa4_or_importable_fallback(",
                                   "backend = _fa4_or_importable_fallback()"],
    "sglang-tree-verify-graph-input": ["create_dummy_verify_input("],
}


# ------------------------------------------------------------------------------------------------
# wheels


def wheel_cache() -> Path:
    return Path(os.environ.get("SGLANG_DDTREE_WHEEL_CACHE",
                               Path.home() / ".cache" / "sglang-ddtree-wheels"))


def fetch_wheel(package: str, version: str) -> Path:
    """Path of the cached wheel, downloading it with pip on first use."""
    cache = wheel_cache()
    hits = sorted(cache.glob(f"{package}-{version}-*.whl"))
    if hits:
        return hits[0]
    cache.mkdir(parents=True, exist_ok=True)
    # Download into a private dir, then rename: a concurrent run never sees a partial wheel.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--implementation", "cp",
               "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
               "--platform", "manylinux_2_27_x86_64", "-d", tmp, f"{package}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{package}-{version}-*.whl"))
        if proc.returncode != 0 or not got:
            pytest.fail(f"could not download {package}=={version}:\n{proc.stdout}\n{proc.stderr}")
        os.replace(got[0], cache / got[0].name)
    return cache / got[0].name


def wheel_bytes(package: str, version: str, member: str) -> bytes:
    with zipfile.ZipFile(fetch_wheel(package, version)) as z:
        return z.read(member)


def make_site(root: Path, package: str, version: str, *, members: list[str] | None = None,
              siblings: bool = False, claim_version: str | None = None) -> Path:
    """A site-packages dir holding ``members`` of the wheel and a dist-info claiming
    ``claim_version`` (default: the real one). ``members`` defaults to every file the manifest
    lists for that release, ``["*"]`` unpacks the whole package; ``siblings`` adds the other
    files of the members' directories."""
    if members is None:
        members = manifest_files(package, version)
    site = root / "site-packages"
    with zipfile.ZipFile(fetch_wheel(package, version)) as z:
        names = z.namelist()
        if members == ["*"]:
            wanted = [n for n in names if n.startswith(f"{package}/")]
        else:
            dirs = {m.rsplit("/", 1)[0] + "/" for m in members}
            wanted = [n for n in names if n in members or (
                siblings and n.rsplit("/", 1)[0] + "/" in dirs)]
        for name in wanted:
            z.extract(name, site)
        meta = z.read(f"{package}-{version}.dist-info/METADATA").decode()
    claimed = claim_version or version
    info = site / f"{package}-{claimed}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", f"Version: {claimed}", meta))
    return site


def manifest() -> dict:
    return json.loads((PATCHES / "manifest.json").read_text())


def manifest_files(package: str, version: str, patch_id: str | None = None) -> list[str]:
    return [f for p in manifest()["patches"] if p["package"] == package
            and (patch_id is None or p["id"] == patch_id)
            for f in p["versions"].get(version, {}).get("files", {})]


def snapshot(site: Path) -> dict:
    """path -> (bytes, mtime_ns) of every file outside the engine's state dir."""
    return {str(p.relative_to(site)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in site.rglob("*") if p.is_file() and patcher.STATE_DIR not in p.parts}


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = patcher.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_failed_download_fails_instead_of_skipping(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_WHEEL_CACHE", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="could not download"):
        fetch_wheel("sglang", "0.0.0.dev424242")


# ------------------------------------------------------------------------------------------------
# manifest and patch files (no download)


def test_manifest_and_patch_files_agree():
    specs = patcher.load_manifest(PATCHES)
    assert {s.id for s in specs} == set(MARKERS)
    known = {(s.package, v) for s in specs for v in s.versions}
    assert known == set(RELEASES)
    for spec in specs:
        for version, entry in spec.versions.items():
            assert re.fullmatch(rf"{spec.package}/{re.escape(version)}/\d{{4}}-[a-z0-9-]+\.patch",
                                entry.patch), entry.patch
            diffs = patcher.load_diffs(PATCHES, spec, entry)  # header pin + file list checked
            assert sorted(d.path for d in diffs) == sorted(entry.files)
            for hashes in entry.files.values():
                assert hashes["before"] != hashes["after"]


# ------------------------------------------------------------------------------------------------
# the full cycle on each real release


@pytest.mark.parametrize("package,version", RELEASES)
def test_check_apply_reapply_revert(tmp_path, capsys, package, version):
    site = make_site(tmp_path, package, version, members=manifest_files(package, version),
                     siblings=True)
    ids = [p["id"] for p in manifest()["patches"] if p["package"] == package]
    listed = manifest_files(package, version)
    upstream = {f: wheel_bytes(package, version, f) for f in listed}
    before = snapshot(site)
    for f in listed:  # the wheel is the exact upstream file the manifest was made from
        assert sha(upstream[f]) == _hashes(package, version, f)["before"]

    code, out = run_cli(capsys, "check", "--site-packages", site)
    assert code == 0, out
    for patch_id in ids:
        assert re.search(rf"^{patch_id} +{package} +{re.escape(version)} +applies$", out, re.M), out

    code, out = run_cli(capsys, "apply", "--site-packages", site)
    assert code == 0, out
    assert out.count("applied (") == len(ids), out
    after = snapshot(site)
    for f in listed:
        data = (site / f).read_bytes()
        assert sha(data) == _hashes(package, version, f)["after"]
        py_compile.compile(str(site / f), cfile=str(tmp_path / "c.pyc"), doraise=True)
    for patch_id in ids:
        text = "".join((site / f).read_text() for f in manifest_files(package, version, patch_id))
        for marker in MARKERS[patch_id]:
            assert marker in text, (patch_id, marker)
    unlisted = set(before) - set(listed)
    assert {f: after[f] for f in unlisted} == {f: before[f] for f in unlisted}

    code, out = run_cli(capsys, "apply", "--site-packages", site)  # second apply: a no-op
    assert code == 0 and out.count("already applied") == len(ids), out
    assert snapshot(site) == after  # same bytes, same mtimes: nothing was rewritten

    code, out = run_cli(capsys, "status", "--site-packages", site)
    assert code == 0 and out.count(f" applied  [{site.resolve()}]") == len(ids), out

    code, out = run_cli(capsys, "revert", "--site-packages", site)
    assert code == 0 and out.count("reverted (") == len(ids), out
    for f in listed:
        assert (site / f).read_bytes() == upstream[f]
    assert {f: b for f, (b, _) in snapshot(site).items()} == {f: b for f, (b, _) in before.items()}
    assert not (site / patcher.STATE_DIR).exists()
    code, out = run_cli(capsys, "revert", "--site-packages", site)
    assert code == 0 and out.count("not applied, nothing to do") == len(ids), out


def _hashes(package: str, version: str, path: str) -> dict:
    for p in manifest()["patches"]:
        if p["package"] == package and version in p["versions"]:
            if path in p["versions"][version]["files"]:
                return p["versions"][version]["files"][path]
    raise KeyError(path)


def test_revert_without_backup_reverses_the_diff(tmp_path, capsys):
    site = make_site(tmp_path, "sglang", "0.5.23")
    upstream = {f: wheel_bytes("sglang", "0.5.23", f) for f in manifest_files("sglang", "0.5.23")}
    assert run_cli(capsys, "apply", "--site-packages", site)[0] == 0
    for p in sorted((site / patcher.STATE_DIR).rglob("*"), key=lambda p: -len(p.parts)):
        p.unlink() if p.is_file() else p.rmdir()
    code, out = run_cli(capsys, "revert", "--site-packages", site)
    assert code == 0, out
    assert {f: (site / f).read_bytes() for f in upstream} == upstream


# ------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("package,version,claimed", [("sglang", "0.5.17", "0.5.99"),
                                                      ("triton", "3.6.0", "3.7.1")])
def test_unknown_version_is_refused(tmp_path, capsys, package, version, claimed):
    site = make_site(tmp_path, package, version, claim_version=claimed)
    before = snapshot(site)
    known = ", ".join(sorted({v for p, v in RELEASES if p == package}))
    code, out = run_cli(capsys, "check", "--site-packages", site)
    assert code == 1 and "not applicable (version)" in out and f"known versions: {known}" in out
    code, out = run_cli(capsys, "apply", "--site-packages", site)
    assert code == 1 and "refused" in out and f"known versions: {known}" in out, out
    assert snapshot(site) == before


def test_files_of_another_release_conflict(tmp_path, capsys):
    # dist-info says 0.5.17 but the files are 0.5.23's: the hashes catch it.
    site = make_site(tmp_path, "sglang", "0.5.23", claim_version="0.5.17",
                     members=manifest_files("sglang", "0.5.17"))
    before = snapshot(site)
    code, out = run_cli(capsys, "check", "--site-packages", site)
    assert code == 1 and out.count(" conflicts") == 2 and "matches neither" in out, out
    assert run_cli(capsys, "apply", "--site-packages", site)[0] == 1
    assert snapshot(site) == before


def test_hand_modified_file_is_a_conflict_and_untouched(tmp_path, capsys):
    site = make_site(tmp_path, "sglang", "0.5.17")
    edited = "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py"
    with open(site / edited, "a") as f:
        f.write("# local operator edit\n")
    fix3 = manifest_files("sglang", "0.5.17", "sglang-tree-verify-graph-input")
    before = {f: (site / f).read_bytes() for f in fix3}
    code, out = run_cli(capsys, "check", "--site-packages", site)
    assert code == 1, out
    assert re.search(r"^sglang-tree-verify-graph-input .* conflicts$", out, re.M), out
    assert f"{edited}: modified" in out
    assert re.search(r"^sglang-vision-fa4-fallback .* applies$", out, re.M), out
    code, out = run_cli(capsys, "apply", "--site-packages", site)
    assert code == 1 and "refused, files left untouched" in out, out
    assert {f: (site / f).read_bytes() for f in fix3} == before  # all three, not just the edited
    assert "already applied" in run_cli(capsys, "check", "--site-packages", site)[1]  # fix 2 went in
    code, out = run_cli(capsys, "revert", "--site-packages", site, "--only",
                        "sglang-tree-verify-graph-input")
    assert code == 1 and {f: (site / f).read_bytes() for f in fix3} == before


def test_apply_is_all_or_nothing_when_a_write_fails(tmp_path, capsys, monkeypatch):
    site = make_site(tmp_path, "sglang", "0.5.17")
    fix3 = manifest_files("sglang", "0.5.17", "sglang-tree-verify-graph-input")
    before = {f: (site / f).read_bytes() for f in fix3}
    real_write, writes = patcher._atomic_write, []

    def flaky_write(path, data):
        if patcher.STATE_DIR not in path.parts:
            writes.append(path)
            if len(writes) == 2:
                raise OSError(28, "No space left on device (simulated)")
        real_write(path, data)

    monkeypatch.setattr(patcher, "_atomic_write", flaky_write)
    code, out = run_cli(capsys, "apply", "--site-packages", site, "--only",
                        "sglang-tree-verify-graph-input")
    assert code == 1 and "No space left" in out, out
    assert len(writes) >= 3  # the first file was written, then put back
    assert {f: (site / f).read_bytes() for f in fix3} == before


def test_only_selects_patches_and_rejects_unknown_ids(tmp_path, capsys):
    site = make_site(tmp_path, "sglang", "0.5.17")
    vision = "sglang/srt/layers/attention/vision.py"
    code, out = run_cli(capsys, "apply", "--site-packages", site, "--only",
                        "sglang-vision-fa4-fallback")
    assert code == 0 and out.count("applied (") == 1, out
    assert sha((site / vision).read_bytes()) == _hashes("sglang", "0.5.17", vision)["after"]
    for f in manifest_files("sglang", "0.5.17", "sglang-tree-verify-graph-input"):
        assert (site / f).read_bytes() == wheel_bytes("sglang", "0.5.17", f)
    code, out = run_cli(capsys, "apply", "--site-packages", site, "--only",
                        "triton-python-headers")  # named, but triton is not there
    assert code == 1 and "not installed" in out
    assert patcher.main(["check", "--only", "no-such-patch"]) == 2
    assert "known: triton-python-headers" in capsys.readouterr().err


def test_default_site_packages_is_where_the_interpreter_finds_the_package(
        tmp_path, capsys, monkeypatch):
    site = make_site(tmp_path, "sglang", "0.5.23")
    monkeypatch.syspath_prepend(str(site))  # found before any installed sglang
    code, out = run_cli(capsys, "apply", "--only", "sglang-vision-fa4-fallback")
    assert code == 0 and "applied (" in out and str(site.resolve()) in out, out
    code, out = run_cli(capsys, "status", "--only", "sglang-vision-fa4-fallback")
    assert f"0.5.23   applied  [{site.resolve()}]" in out, out


def test_cli_subcommand_and_shell_script_run_the_same_code(tmp_path, capsys):
    from sglang_ddtree import cli

    site = make_site(tmp_path, "triton", "3.8.0")
    assert cli.main(["patch", "check", "--site-packages", str(site)]) == 0
    via_cli = capsys.readouterr().out
    proc = subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), "check",
                           "--site-packages", str(site)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == via_cli
    assert "triton-python-headers" in via_cli and "applies" in via_cli


# ------------------------------------------------------------------------------------------------
# the diff engine on synthetic files (no download)


def test_render_parse_apply_roundtrip_on_awkward_files():
    before = b"first\n" + b"".join(b"line %d\n" % i for i in range(40)) + b"form\x0cfeed\rcr\nlast"
    after = (b"new first\nfirst\n" + b"".join(b"line %d\n" % i for i in range(40) if i != 20)
             + b"form\x0cfeed\rcr\nlast changed")
    text = patcher.render_patch("Upstream-Version: demo==1.0\n", [("pkg/mod.py", before, after)])
    header, diffs = patcher.parse_patch(text)
    assert header == [b"Upstream-Version: demo==1.0\n"]
    assert [d.path for d in diffs] == ["pkg/mod.py"] and len(diffs[0].hunks) == 3
    assert b"\\ No newline at end of file" in text
    assert patcher.apply_hunks(before, diffs[0].hunks) == after
    assert patcher.apply_hunks(after, diffs[0].hunks, reverse=True) == before
    with pytest.raises(patcher.PatchError):
        patcher.apply_hunks(before.replace(b"line 19\n", b"line 19 edited\n"), diffs[0].hunks)
    with pytest.raises(patcher.PatchError):
        patcher.apply_hunks(after, diffs[0].hunks)  # already applied: context differs


def test_malformed_patches_are_rejected():
    good = patcher.render_patch("h", [("a.py", b"x\ny\n", b"x\nz\n")])
    with pytest.raises(patcher.PatchError, match="line counts|ends early"):
        patcher.parse_patch(good.rsplit(b"\n", 2)[0] + b"\n")
    with pytest.raises(patcher.PatchError, match="in place"):
        patcher.parse_patch(good.replace(b"+++ b/a.py", b"+++ b/other.py"))
