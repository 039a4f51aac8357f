"""What ``pip install sglang-ddtree`` installs: a wheel built from this checkout holds every
tracked source and data file of the package (the fused MoE's config table, the CUDA sources the
tree kernel JIT-builds from, the versioned patches), declares the SGLang plugin entry point and
the ``sglang-ddtree`` command, and works installed outside the checkout (no editable paths)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the checkout's folders and where the wheel puts them (pyproject.toml's package-dir)
_PACKAGE_DIRS = {
    "sglang_ddtree": "sglang_ddtree",
    "triton_kernels": "sglang_ddtree/triton_kernels",
    "cuda_ext": "sglang_ddtree/cuda_ext",
    "patches": "sglang_ddtree/patches",
}
_NOT_SHIPPED = {"patches/README.md"}  # how a patch is made: for contributors, not users


def _git_files(*paths: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.split()


def _tracked() -> list[str]:
    return [p for p in _git_files(*_PACKAGE_DIRS) if p not in _NOT_SHIPPED]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tracked files (a checkout's own build/ folder would hand
    setuptools files that pyproject.toml no longer ships)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for path in _git_files("pyproject.toml", "README.md", *_PACKAGE_DIRS):
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / path, src / path)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    if proc.returncode and "No module named" in proc.stderr and "setuptools" in proc.stderr:
        pytest.skip("setuptools is not installed here")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (whl,) = out.glob("sglang_ddtree-*.whl")
    return whl


def test_wheel_holds_every_tracked_package_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = set()
    for path in _tracked():
        top, rest = path.split("/", 1)
        want.add(f"{_PACKAGE_DIRS[top]}/{rest}")
    assert "sglang_ddtree/triton_kernels/moe_w4a16_configs.json" in want  # the list is real
    assert not want - names, sorted(want - names)
    # and nothing at the top level but our package (sglang-kernel ships a `triton_kernels`)
    tops = {n.split("/", 1)[0] for n in names} - {"sglang_ddtree"}
    assert len(tops) == 1 and tops.pop().endswith(".dist-info"), names


def test_wheel_declares_the_plugin_and_the_command(wheel):
    zf = zipfile.ZipFile(wheel)
    (ep,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = zf.read(ep).decode()
    assert "[sglang.srt.plugins]" in text and "ddtree = sglang_ddtree.plugin:register" in text
    assert "[console_scripts]" in text and "sglang-ddtree = sglang_ddtree.cli:main" in text


def test_installed_wheel_works_outside_the_checkout(wheel, tmp_path):
    """Unpacked as pip would (a plain site directory, run from elsewhere): the config table,
    the CUDA sources and the patch manifest are found beside the installed modules."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import os, sglang_ddtree as p\n"
        f"assert p.__file__.startswith({str(site)!r}), p.__file__\n"
        "from sglang_ddtree.triton_kernels import moe_config\n"
        "assert moe_config.select_config(8).block_m >= 8\n"
        "from sglang_ddtree import cuda_ext\n"
        "d = os.path.dirname(cuda_ext.__file__)\n"
        "assert os.path.exists(os.path.join(d, 'tree_build_kernel.cuh'))\n"
        "from sglang_ddtree import patcher\n"
        "pd = patcher.default_patches_dir()\n"
        f"assert str(pd).startswith({str(site)!r}), pd\n"
        "specs = patcher.load_manifest(pd)\n"
        "n = sum(len(patcher.load_diffs(pd, s, e)) for s in specs for e in s.versions.values())\n"
        "print('OK', len(specs), n)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
