"""Debug switch SGLANG_DDTREE_CHECK_SYNCS=1: find the host syncs of a decode step in a live server.

A step must never wait for the GPU (it breaks SGLang's overlap scheduling, and on a small model
the step is host-bound). ``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn at every
operation that synchronizes the host (``.item()``, ``.cpu()``, ``nonzero``, a blocking copy...),
also inside the SGLang code the step calls (verify preparation, the forward). ``SyncCheck`` runs
the step in that mode, keeps the warnings, and logs each distinct call site once, with the stack
outside torch, and a running count every ``every`` steps. Other warnings go to the handler
they went to before (Python's once-per-location registry is reset by each step's
``warnings.catch_warnings``, so under the check a repeated warning may show again). Off by
default.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
import warnings
from typing import Dict, Tuple

import torch

logger = logging.getLogger(__name__)

_SYNC_WARNING = "synchronizing"  # torch: "called a synchronizing CUDA operation"
# torch's one-time notice on entering the mode ("Synchronization debug mode is a prototype
# feature and does not yet detect all synchronizing operations") names no sync, but holds the
# word: the first GPU run that returned the log (session 63) listed it as a call site
_MODE_NOTICE = "debug mode is a prototype"


def _is_sync(message: str) -> bool:
    """Whether a warning's text reports a synchronizing operation (not the mode's notice)."""
    return _SYNC_WARNING in message and _MODE_NOTICE not in message


class SyncCheck:
    def __init__(self, enabled: bool, every: int = 200, max_sites: int = 20):
        self.enabled = enabled and torch.cuda.is_available()
        self.every, self.max_sites = every, max_sites
        self.steps = 0
        self.syncs = 0
        self.sites: Dict[Tuple[str, ...], int] = {}

    @contextlib.contextmanager
    def step(self):
        """Run one decode step under the check (a no-op when off)."""
        if not self.enabled:
            yield
            return
        caught = []
        shown = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            if _is_sync(str(message)):  # the stack now is the synchronizing call's
                caught.append((str(message), _site(filename, lineno, traceback.extract_stack())))
            else:  # anyone else's warning goes where it went before
                shown(message, category, filename, lineno, file, line)

        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            # every sync, not only the first per call site; other warnings keep their filters
            warnings.filterwarnings("always", message=f".*{_SYNC_WARNING}.*")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.record(caught)

    def record(self, caught) -> None:
        """Count one step's [(message, call site)]; log a site the first time it syncs."""
        self.steps += 1
        for message, site in caught:
            self.syncs += 1
            seen = self.sites.get(site)
            self.sites[site] = (seen or 0) + 1
            if seen is None and len(self.sites) <= self.max_sites:
                logger.warning("DDTREE sync check: the decode step synchronized the host at "
                               "%s: %s", " <- ".join(site), message)
        if self.steps % self.every == 0:
            logger.info("DDTREE sync check: %d host syncs in %d decode steps (%d call sites)",
                        self.syncs, self.steps, len(self.sites))


def _site(filename: str, lineno: int, stack) -> Tuple[str, ...]:
    """The line that synchronized, then up to three callers outside torch and this module."""
    def short(path, line):
        return f"{'/'.join(path.split('/')[-2:])}:{line}"

    where = short(filename, lineno)
    callers = [short(f.filename, f.lineno) for f in stack
               if "/torch/" not in f.filename and not f.filename.endswith("sync_check.py")
               and not f.filename.endswith("warnings.py")]
    if callers and callers[-1] == where:
        callers.pop()
    return (where, *callers[-3:][::-1])
