"""Versioned source patches for triton and SGLang: ``sglang-ddtree patch list|check|apply|revert|status``.

Each patch fixes one deployment failure (DESIGN.md section 3) in the installed files of one exact
upstream release. ``patches/manifest.json`` lists, per patch id and per known package version, the
patch file (``<package>/<version>/NNNN-name.patch``, a git-style unified diff whose header names
the upstream version) and the sha256 of every touched file before and after. The engine here is
pure Python (no ``patch`` or ``git`` binary) and strict:

- a file is patched only when its bytes hash to the manifest's *before*, and the result must hash
  to *after*; anything else is a conflict and nothing is written;
- ``apply`` is atomic per patch (all its files or none), idempotent (files at *after* are left as
  they are), keeps a backup of the original bytes, and refuses a package version the manifest does
  not know, listing the versions it does;
- ``revert`` restores the exact original bytes (from the backup, else by reversing the diff, and
  checks them against *before*);
- only files the manifest lists are modified; backups and records live in
  ``<site-packages>/.sglang-ddtree-patches/``.

The site-packages directory is, per package, the one the running interpreter finds it in, or the
directory given with ``--site-packages``. The installed version comes from the package's
``*.dist-info`` there.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

STATE_DIR = ".sglang-ddtree-patches"
ACTIONS = ("list", "check", "apply", "revert", "status")

# Per-patch states, as `check` and `status` print them.
APPLIES, APPLIED, UNKNOWN_VERSION, CONFLICT, NOT_INSTALLED = (
    "applies", "already applied", "not applicable (version)", "conflicts", "not installed")


class PatchError(Exception):
    """A patch file or manifest that is malformed, or a diff that does not fit its target."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based first line in the original file (for an empty range: the line before)
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[bytes, ...]  # each b" ", b"-" or b"+" followed by the line, newline included


@dataclass(frozen=True)
class FileDiff:
    path: str  # relative to site-packages, "/"-separated
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class VersionEntry:
    version: str
    patch: str  # patch file, relative to the patches directory
    files: dict  # path -> {"before": sha256 hex, "after": sha256 hex}


@dataclass(frozen=True)
class PatchSpec:
    id: str
    package: str
    title: str
    versions: dict  # version -> VersionEntry


# ------------------------------------------------------------------------------------------------
# unified diffs


_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(data: bytes) -> tuple[list[bytes], list[FileDiff]]:
    """Split a git-style patch into its header lines and per-file diffs (strictly validated)."""
    lines = _split_lines(data)
    i, header = 0, []
    while i < len(lines) and not lines[i].startswith(b"diff --git "):
        header.append(lines[i])
        i += 1
    diffs = []
    while i < len(lines):
        if not lines[i].startswith(b"diff --git "):
            raise PatchError(f"expected 'diff --git' at line {i + 1}, got {lines[i][:60]!r}")
        i += 1
        while i < len(lines) and not lines[i].startswith(b"--- "):
            i += 1  # "index ..." and mode lines carry nothing we use
        if i + 1 >= len(lines) or not lines[i + 1].startswith(b"+++ "):
            raise PatchError(f"missing '---'/'+++' file lines near line {i + 1}")
        old, new = lines[i][4:].strip(), lines[i + 1][4:].strip()
        if not (old.startswith(b"a/") and new.startswith(b"b/") and old[2:] == new[2:]):
            raise PatchError(f"patch must modify a file in place, got {old!r} -> {new!r}")
        path = old[2:].decode("utf-8")
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith(b"@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"no hunks for {path}")
        diffs.append(FileDiff(path, tuple(hunks)))
    return header, diffs


def _parse_hunk(lines: list[bytes], i: int) -> tuple[Hunk, int]:
    m = _HUNK_RE.match(lines[i])
    if m is None:
        raise PatchError(f"bad hunk header at line {i + 1}: {lines[i]!r}")
    a, b, c, d = (int(g) if g is not None else 1 for g in m.groups())
    body, n_old, n_new = [], 0, 0
    i += 1
    while n_old < b or n_new < d:
        if i >= len(lines):
            raise PatchError(f"hunk {m.group(0)!r} ends early")
        line = lines[i]
        if line == b"\n":  # some editors strip the space of an empty context line
            line = b" \n"
        tag = line[:1]
        if tag not in (b" ", b"-", b"+"):
            raise PatchError(f"bad hunk line {i + 1}: {line[:60]!r}")
        n_old += tag in (b" ", b"-")
        n_new += tag in (b" ", b"+")
        body.append(line)
        i += 1
        if i < len(lines) and lines[i].startswith(b"\\"):  # "\ No newline at end of file"
            body[-1] = body[-1][:-1]
            i += 1
    if n_old != b or n_new != d:
        raise PatchError(f"hunk {m.group(0)!r} line counts do not match its body")
    return Hunk(a, b, c, d, tuple(body)), i


def apply_hunks(original: bytes, hunks: tuple[Hunk, ...], reverse: bool = False) -> bytes:
    """Apply (or un-apply) hunks at their exact line numbers; PatchError if any context differs."""
    lines = _split_lines(original)
    out, pos = [], 0
    for h in hunks:
        take, give = (b" +", b" -") if reverse else (b" -", b" +")
        src = [line[1:] for line in h.lines if line[:1] in take]
        dst = [line[1:] for line in h.lines if line[:1] in give]
        start, length = (h.new_start, h.new_len) if reverse else (h.old_start, h.old_len)
        start = start if length == 0 else start - 1
        if start < pos or lines[start:start + len(src)] != src:
            raise PatchError(f"hunk @@ -{h.old_start},{h.old_len} +{h.new_start},{h.new_len} @@ "
                             "does not match the file")
        out += lines[pos:start] + dst
        pos = start + len(src)
    return b"".join(out + lines[pos:])


def render_patch(header: str, changes: list[tuple[str, bytes, bytes]], context: int = 3) -> bytes:
    """Write a patch file: ``header`` then one git-style diff per ``(path, before, after)``.

    This is how the files under ``patches/`` are made (from a pristine and an edited copy of the
    upstream file); ``parse_patch`` + ``apply_hunks`` read them back.
    """
    out = [header.rstrip("\n").encode("utf-8") + b"\n"]
    for path, before, after in changes:
        p = path.encode("utf-8")
        out.append(b"diff --git a/%s b/%s\n" % (p, p))
        for line in difflib.diff_bytes(difflib.unified_diff, _split_lines(before),
                                       _split_lines(after), b"a/" + p, b"b/" + p, n=context):
            out.append(line if line.endswith(b"\n") else line + b"\n\\ No newline at end of file\n")
    return b"".join(out)


def _split_lines(data: bytes) -> list[bytes]:
    # Split on b"\n" only: bytes.splitlines would also split on \r, \f and friends.
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------------
# manifest


def default_patches_dir() -> Path:
    """``patches/`` of this checkout, or the installed ``sglang_ddtree/patches``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "patches", here.parent / "patches"):
        if (candidate / "manifest.json").is_file():
            return candidate
    raise PatchError(f"no patches/manifest.json next to {here}")


def load_manifest(patches_dir: Path) -> list[PatchSpec]:
    """Read and validate ``manifest.json``."""
    raw = json.loads((patches_dir / "manifest.json").read_text())
    if raw.get("format") != 1:
        raise PatchError(f"manifest format: expected 1, got {raw.get('format')!r}")
    specs, seen_ids, owner = [], set(), {}
    for p in raw["patches"]:
        if p["id"] in seen_ids:
            raise PatchError(f"duplicate patch id {p['id']}")
        seen_ids.add(p["id"])
        versions = {}
        for version, v in p["versions"].items():
            for path, hashes in v["files"].items():
                # Hashes before/after are per file, so two patches must not share a file.
                key = (p["package"], version, path)
                if key in owner:
                    raise PatchError(f"{path} is listed by both {owner[key]} and {p['id']}")
                owner[key] = p["id"]
                if set(hashes) != {"before", "after"}:
                    raise PatchError(f"{p['id']} {version} {path}: need 'before' and 'after'")
            versions[version] = VersionEntry(version, v["patch"], dict(v["files"]))
        specs.append(PatchSpec(p["id"], p["package"], p["title"], versions))
    return specs


def load_diffs(patches_dir: Path, spec: PatchSpec, entry: VersionEntry) -> list[FileDiff]:
    """Parse a version's patch file and check it against the manifest entry."""
    header, diffs = parse_patch((patches_dir / entry.patch).read_bytes())
    pin = f"{spec.package}=={entry.version}".encode()
    if not any(pin in line for line in header):
        raise PatchError(f"{entry.patch}: header does not name {pin.decode()}")
    if sorted(d.path for d in diffs) != sorted(entry.files):
        raise PatchError(f"{entry.patch}: files {sorted(d.path for d in diffs)} differ from the "
                         f"manifest's {sorted(entry.files)}")
    return diffs


# ------------------------------------------------------------------------------------------------
# installed packages


def find_installed(package: str, site_packages: str | None) -> tuple[Path, str] | None:
    """(site-packages dir, version) of ``package``, or None if it is not installed there.

    Without ``site_packages``: the first directory on ``sys.path`` holding its dist-info, as the
    running interpreter's import would find it.
    """
    want = _normalize(package)
    kwargs = {"path": [site_packages]} if site_packages is not None else {}
    site, versions = None, set()
    for dist in metadata.distributions(**kwargs):
        if _normalize(dist.metadata["Name"] or "") != want:
            continue
        location = Path(dist.locate_file("")).resolve()
        if site is None:
            site = location
        if location == site:
            versions.add(dist.version)
    if site is None:
        return None
    if len(versions) > 1:
        raise PatchError(f"{package}: several versions installed in {site}: "
                         f"{', '.join(sorted(versions))}")
    return site, versions.pop()


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_key(version: str) -> tuple:
    # Numeric parts compare as numbers (3.10 after 3.9); anything else as text, after numbers.
    return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"[.+-]", version))


# ------------------------------------------------------------------------------------------------
# evaluating, applying, reverting


@dataclass
class Target:
    """One patch against one installed package: where, which version, and the files' state."""

    spec: PatchSpec
    state: str
    detail: str = ""
    site: Path | None = None
    version: str | None = None
    entry: VersionEntry | None = None
    current: dict | None = None  # path -> bytes of the installed file (None if missing)
    revertible: bool = False  # every file is at either before or after (so revert can finish)


def evaluate(spec: PatchSpec, site_packages: str | None) -> Target:
    """Read the installed files of ``spec.package`` and classify them against the manifest."""
    found = find_installed(spec.package, site_packages)
    if found is None:
        where = site_packages or "this interpreter's sys.path"
        return Target(spec, NOT_INSTALLED, f"{spec.package} is not installed in {where}")
    site, version = found
    entry = spec.versions.get(version)
    if entry is None:
        known = ", ".join(sorted(spec.versions, key=_version_key))
        return Target(spec, UNKNOWN_VERSION, f"{spec.package} {version} (in {site}) is not a version "
                      f"this patch was made for; known versions: {known}", site, version)
    current = {}
    for path in entry.files:
        try:
            current[path] = (site / path).read_bytes()
        except FileNotFoundError:
            current[path] = None
    hashes = {path: sha256(data) if data is not None else None for path, data in current.items()}
    at_before = [p for p, h in hashes.items() if h == entry.files[p]["before"]]
    at_after = [p for p, h in hashes.items() if h == entry.files[p]["after"]]
    target = Target(spec, CONFLICT, "", site, version, entry, current)
    if len(at_after) == len(hashes):
        target.state, target.revertible = APPLIED, True
    elif len(at_before) == len(hashes):
        target.state = APPLIES
    else:
        target.revertible = len(at_before) + len(at_after) == len(hashes)
        target.detail = "; ".join(
            f"{p}: " + ("missing" if h is None else "at upstream" if p in at_before else
                        "patched" if p in at_after else f"modified (sha256 {h[:12]}... matches "
                        f"neither upstream {spec.package} {version} nor the patched file)")
            for p, h in hashes.items())
    return target


def apply(target: Target, patches_dir: Path) -> str:
    """Apply one evaluated patch atomically; return what happened. Raises PatchError to refuse."""
    if target.state == APPLIED:
        return "already applied, nothing to do"
    if target.state != APPLIES:
        raise PatchError(f"{target.state}: {target.detail}")
    entry, site = target.entry, target.site
    new = {}
    for diff in load_diffs(patches_dir, target.spec, entry):
        data = apply_hunks(target.current[diff.path], diff.hunks)
        if sha256(data) != entry.files[diff.path]["after"]:
            raise PatchError(f"{entry.patch}: result for {diff.path} does not hash to the manifest")
        new[diff.path] = data
    backup = _backup_dir(site, target.spec, entry)
    for path in new:
        _atomic_write(backup / path, target.current[path])
    _write_all(site, new, target.current)
    record = {"id": target.spec.id, "package": target.spec.package, "version": entry.version,
              "patch": entry.patch, "files": entry.files}
    _atomic_write(backup / "record.json", json.dumps(record, indent=1).encode())
    return f"applied ({len(new)} file(s); originals backed up in {backup})"


def revert(target: Target, patches_dir: Path) -> str:
    """Restore the exact upstream bytes of one evaluated patch; return what happened."""
    if target.state == APPLIES:
        return "not applied, nothing to do"
    if not target.revertible:
        raise PatchError(f"{target.state}: {target.detail}")
    entry, site = target.entry, target.site
    backup = _backup_dir(site, target.spec, entry)
    diffs = {d.path: d for d in load_diffs(patches_dir, target.spec, entry)}
    old = {}
    for path, hashes in entry.files.items():
        if sha256(target.current[path]) != hashes["after"]:
            continue  # already at upstream
        saved = backup / path
        data = saved.read_bytes() if saved.is_file() else b""
        if sha256(data) != hashes["before"]:  # no usable backup: undo the diff instead
            data = apply_hunks(target.current[path], diffs[path].hunks, reverse=True)
        if sha256(data) != hashes["before"]:
            raise PatchError(f"cannot rebuild upstream {path}: reversed diff does not hash right")
        old[path] = data
    _write_all(site, old, target.current)
    for path in entry.files:
        (backup / path).unlink(missing_ok=True)
    (backup / "record.json").unlink(missing_ok=True)
    _prune_empty_dirs(backup, stop=site / STATE_DIR)
    return f"reverted ({len(old)} file(s) restored to upstream {target.spec.package} {entry.version})"


def _backup_dir(site: Path, spec: PatchSpec, entry: VersionEntry) -> Path:
    return site / STATE_DIR / spec.id / entry.version


def _write_all(site: Path, new: dict, originals: dict) -> None:
    # All files or none: on any failure put back the ones already replaced.
    done = []
    try:
        for path, data in new.items():
            _atomic_write(site / path, data)
            done.append(path)
    except BaseException:
        for path in done:
            _atomic_write(site / path, originals[path])
        raise


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prune_empty_dirs(start: Path, stop: Path) -> None:
    for d in sorted((p for p in start.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    d = start
    while d.is_dir() and not any(d.iterdir()) and stop in (d, *d.parents):
        d.rmdir()
        d = d.parent


# ------------------------------------------------------------------------------------------------
# command line


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS, help="what to do (list needs no installed package)")
    parser.add_argument("--site-packages", metavar="DIR", default=None,
                        help="patch the packages installed in DIR (default: where the running "
                             "interpreter finds each package)")
    parser.add_argument("--only", metavar="ID", action="append", default=None,
                        help="restrict to this patch id (repeatable; see `list`)")
    parser.add_argument("--patches-dir", metavar="DIR", default=None, help=argparse.SUPPRESS)


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add the ``patch`` subcommand to an argparse subparsers object (used by the CLI)."""
    parser = subparsers.add_parser(
        "patch", help="list / check / apply / revert / status of the versioned deployment fixes",
        description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run one action; exit status 0 on success, 1 if a selected patch was refused or conflicts."""
    patches_dir = Path(args.patches_dir) if args.patches_dir else default_patches_dir()
    specs = load_manifest(patches_dir)
    if args.only:
        wanted = [i for item in args.only for i in item.split(",") if i]
        unknown = sorted(set(wanted) - {s.id for s in specs})
        if unknown:
            print(f"unknown patch id(s) {', '.join(unknown)}; known: "
                  f"{', '.join(s.id for s in specs)}", file=sys.stderr)
            return 2
        specs = [s for s in specs if s.id in wanted]
    if args.action == "list":
        for s in specs:
            print(f"{s.id:34s} {s.package:8s} {s.title}")
            for v in sorted(s.versions, key=_version_key):
                print(f"    {s.package}=={v:10s} {s.versions[v].patch}")
        return 0
    failed = False
    for s in specs:
        try:
            target = evaluate(s, args.site_packages)
        except PatchError as e:
            target = Target(s, CONFLICT, str(e))
        version = target.version or "-"
        prefix = f"{s.id:34s} {s.package:8s} {version:8s}"
        bad = target.state in (UNKNOWN_VERSION, CONFLICT) or (
            target.state == NOT_INSTALLED and bool(args.only))
        if args.action in ("check", "status"):
            state = target.state
            if args.action == "status":
                state = {APPLIED: "applied", APPLIES: "not applied"}.get(state, state)
                if target.site is not None:
                    state += f"  [{target.site}]"
            print(f"{prefix} {state}")
            if target.detail:
                print(f"    {target.detail}")
            failed |= bad and args.action == "check"
            continue
        if target.state == NOT_INSTALLED:
            print(f"{prefix} skipped: {target.detail}")
            failed |= bad
            continue
        try:
            print(f"{prefix} {(apply if args.action == 'apply' else revert)(target, patches_dir)}")
        except (PatchError, OSError) as e:
            print(f"{prefix} refused, files left untouched: {e}")
            failed = True
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-ddtree patch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
