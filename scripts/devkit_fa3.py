#!/usr/bin/env python3
"""FlashAttention-3 for the offline kit: sgl_kernel's ``flash_ops`` in parts small enough to
travel with one device call each.

The kit's sglang-kernel wheel leaves out ``sgl_kernel/flash_ops.abi3.so`` (1.1 GB, 342 MB in
the wheel), so on the H200 neither SGLang's fa3 attention backend nor the fa3 column of
``scripts/bench_tree_verify.py`` (issue 4's "at least 1.0x fa3") could run. xz -9 takes it to
about 133 MB: four calls of at most 40 MiB beside this checkout (``--part-mib``).

On the development machine (network; xz -9 on two cores takes about 7 minutes):

    python3 scripts/devkit_fa3.py build --kit .devkit

writes ``.devkit/fa3/manifest.json`` and ``part_00``, ``part_01``, ... and prints the calls.
On the device, one call per part, back to back (the machine goes cold 30 s after a call), each
carrying the manifest and its part, after the kit's own chunks:

    python3 scripts/devkit_fa3.py install .devkit/fa3/part_00

Each part is checked against the manifest and staged in ``/tmp/fa3``; the call that brings the
last one joins them, decompresses into ``/tmp/site/sgl_kernel/flash_ops.abi3.so`` (checked
against the library's own sha256) and says so. Only the Python standard library runs there.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MEMBER = "sgl_kernel/flash_ops.abi3.so"
CHUNK = 1 << 22


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def kit_kernel_version(kit: Path) -> str:
    """The sglang-kernel version the kit installs (from its wheel's file name)."""
    found = sorted(glob.glob(str(kit / "w*" / "sglang_kernel-*.whl")))
    if not found:
        raise SystemExit(f"devkit_fa3: no sglang_kernel wheel under {kit}/w*; build the kit first")
    return os.path.basename(found[0]).split("-")[1]


def download_wheel(version: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
                    "--platform", "manylinux2014_x86_64", f"sglang-kernel=={version}",
                    "-d", str(dest)], check=True)
    return Path(sorted(glob.glob(str(dest / f"sglang_kernel-{version}-*.whl")))[0])


def compress(src: Path, dst: Path, preset: int = 9) -> None:
    """xz (the command, multi-threaded, where it exists; else Python's lzma): the same format."""
    if shutil.which("xz"):
        with open(dst, "wb") as out:
            subprocess.run(["xz", "-T0", f"-{preset}", "-c", str(src)], stdout=out, check=True)
        return
    import lzma

    with open(src, "rb") as f, lzma.open(dst, "wb", preset=preset) as out:
        for block in iter(lambda: f.read(CHUNK), b""):
            out.write(block)


def build(wheel: Path, out: Path, part_bytes: int, preset: int = 9) -> dict:
    """Extract ``flash_ops`` from ``wheel``, compress it, cut it into parts of at most
    ``part_bytes``; write them and ``manifest.json`` into ``out``; return the manifest."""
    if part_bytes <= 0:
        raise SystemExit("devkit_fa3: no room for a part beside the checkout; shrink it first")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part_*"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            if MEMBER not in z.namelist():
                raise SystemExit(f"devkit_fa3: {wheel} has no {MEMBER} (a stripped wheel?)")
            so = Path(z.extract(MEMBER, tmp))
        xz = Path(tmp) / "flash_ops.abi3.so.xz"
        compress(so, xz, preset)
        manifest = {"member": MEMBER, "wheel": wheel.name, "so_bytes": so.stat().st_size,
                    "so_sha256": sha256_file(so), "xz_bytes": xz.stat().st_size, "parts": []}
        with open(xz, "rb") as f:
            for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
                name = f"part_{i:02d}"
                (out / name).write_bytes(block)
                manifest["parts"].append({"name": name, "bytes": len(block),
                                          "sha256": hashlib.sha256(block).hexdigest()})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _decompress(parts: list, dst: Path) -> str | None:
    """The joined xz ``parts`` decompressed into ``dst``; the output's sha256, or None where
    the stream was incomplete. Python's lzma where this Python has it (hashed as it is
    written: the library is read once), else the xz command."""
    try:
        import lzma
    except ImportError:
        lzma = None
    if lzma is None:
        cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
        with open(dst, "wb") as out:
            rc = subprocess.run(["xz", "-dc"], stdin=cat.stdout, stdout=out).returncode
        cat.wait()
        return sha256_file(dst) if rc == 0 else None
    dec = lzma.LZMADecompressor()
    h = hashlib.sha256()
    with open(dst, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    data = dec.decompress(block)
                    h.update(data)
                    out.write(data)
    return h.hexdigest() if dec.eof else None


def install(part: Path, manifest_path: Path, stage: Path, site: Path) -> str:
    """Stage ``part`` (checked); when every part is staged, join and decompress them into
    ``site``. Returns what it did, in a line."""
    if not (site / "sgl_kernel" / "__init__.py").is_file():
        # pip --target --upgrade replaces the whole package: the library must come after it
        raise SystemExit(f"devkit_fa3: no sgl_kernel in {site}: install the kit's sglang-kernel "
                         "chunk first (scripts/devkit_chunks.py lists the calls in order)")
    manifest = json.loads(manifest_path.read_text())
    sizes = {p["name"]: p["bytes"] for p in manifest["parts"]}
    entry = next((p for p in manifest["parts"] if p["name"] == part.name), None)
    if entry is None:
        raise SystemExit(f"devkit_fa3: {part.name} is not in {manifest_path}")
    if sha256_file(part) != entry["sha256"]:
        raise SystemExit(f"devkit_fa3: {part} does not match its manifest entry (corrupt or "
                         "from another build); rebuild the parts")
    stage.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, stage / part.name)
    names = list(sizes)
    have = [n for n in names if (stage / n).is_file() and (stage / n).stat().st_size == sizes[n]]
    if len(have) < len(names):
        missing = ", ".join(n for n in names if n not in have)
        return (f"staged {part.name} ({len(have)} of {len(names)} parts in {stage}; still "
                f"needed: {missing})")
    dst = site / manifest["member"]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    if _decompress([stage / n for n in names], tmp) != manifest["so_sha256"]:
        tmp.unlink()
        raise SystemExit("devkit_fa3: the joined parts do not decompress to the library the "
                         "manifest names; rebuild the parts")
    os.replace(tmp, dst)
    shutil.rmtree(stage, ignore_errors=True)
    return f"installed {dst} ({manifest['so_bytes']} bytes, sha256 checked)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="development machine: download, compress, cut")
    b.add_argument("--kit", default=".devkit")
    b.add_argument("--repo", default=".")
    b.add_argument("--wheel", help="an sglang-kernel wheel with flash_ops (default: download "
                                   "the kit's version)")
    b.add_argument("--limit-mib", type=float, default=64.0)
    b.add_argument("--part-mib", type=float, default=40.0,
                   help="at most this per part (room for the checkout to grow between the "
                        "build and the calls), and never more than the carry limit leaves")
    b.add_argument("--preset", type=int, default=9)
    i = sub.add_parser("install", help="device: stage one part, install when all are there")
    i.add_argument("part")
    i.add_argument("--manifest", help="default: manifest.json beside the part")
    i.add_argument("--stage", default="/tmp/fa3")
    i.add_argument("--site", default="/tmp/site")
    args = ap.parse_args(argv)
    if args.cmd == "install":
        part = Path(args.part)
        manifest = Path(args.manifest) if args.manifest else part.with_name("manifest.json")
        print(install(part, manifest, Path(args.stage), Path(args.site)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from devkit_chunks import MARGIN, MIB, checkout_bytes

    kit = Path(args.kit)
    out = kit / "fa3"
    # what a part's call carries besides the part: the checkout, the manifest (small)
    room = int(args.limit_mib * MIB) - checkout_bytes(Path(args.repo)) - MARGIN - 64 * 1024
    room = min(room, int(args.part_mib * MIB))
    wheel = Path(args.wheel) if args.wheel else download_wheel(
        kit_kernel_version(kit), kit / "fa3_download")
    manifest = build(wheel, out, room, args.preset)
    print(f"{MEMBER}: {manifest['so_bytes'] / MIB:.0f} MiB, xz {manifest['xz_bytes'] / MIB:.1f} "
          f"MiB in {len(manifest['parts'])} parts; the calls, back to back after the kit's:")
    for p in manifest["parts"]:
        carry = [f"{kit.name}/fa3/manifest.json", f"{kit.name}/fa3/{p['name']}"]
        print(f"  carry {json.dumps(carry)}: python3 scripts/devkit_fa3.py install "
              f"{kit.name}/fa3/{p['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
