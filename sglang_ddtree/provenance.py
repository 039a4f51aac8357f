"""Which code a measurement ran: a digest of the repository's source files.

A benchmark on the device machine runs in a copy of the working tree whose ``.git`` cannot be
trusted (session 6: a stale one reported a commit from hours earlier). So every benchmark JSON
records :func:`source_digest` of the checkout it ran in, and ``scripts/which_commit.py DIGEST``
names the commits whose tree has the same digest.

The digest covers the files under :data:`SOURCE_DIRS` with a suffix in :data:`SUFFIXES` (code,
kernels, the kernel config tables), by relative path and content, in path order.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, Tuple

SOURCE_DIRS = ("sglang_ddtree", "cuda_ext", "triton_kernels", "patches", "scripts")
SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h", ".sh", ".json")
DIGEST_CHARS = 16


def counts(path: str) -> bool:
    """Whether a repository-relative path (``/``-separated) is part of the digest."""
    parts = path.split("/")
    return (len(parts) > 1 and parts[0] in SOURCE_DIRS and "__pycache__" not in parts
            and path.endswith(SUFFIXES))


def digest_of(files: Iterable[Tuple[str, bytes]]) -> str:
    """Digest of (relative path, content) pairs; the order they come in does not matter."""
    h = hashlib.sha256()
    for path, data in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:DIGEST_CHARS]


def source_digest(root: str) -> str:
    """:func:`digest_of` the counted files under the checkout ``root``."""
    files = []
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                if counts(rel) and os.path.isfile(full):
                    with open(full, "rb") as f:
                        files.append((rel, f.read()))
    return digest_of(files)


def checkout_digest(script_file: str) -> str:
    """:func:`source_digest` of the checkout holding ``script_file`` (a file in ``scripts/``)."""
    return source_digest(os.path.dirname(os.path.dirname(os.path.abspath(script_file))))
