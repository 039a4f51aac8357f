"""TEST-ONLY oracle draft mode: plant the target's known greedy continuation in the draft.

With random or dummy weights a DFlash drafter accepts nothing, so a lossless suite would never
exercise long accepted paths, the KV move or the drafter-KV append. This mode (off unless
``SGLANG_DDTREE_TEST_ORACLE`` names a JSON file) rewrites the drafter's per-depth top-K so that
the target's own greedy continuation appears at chosen depths and ranks (not always rank 0), then
stops at a random depth: accepted paths range from 0 to B-1 tokens and go through non-first
children. It never changes what the target computes, so output must still equal plain greedy.

It reads GPU lengths on the host every step (a sync): never use it outside tests.

JSON: {"seed": int, "rank_probs": [p0, p1, ...], "q": float,
       "items": [{"prompt": [ids], "output": [ids]}, ...]}
"""

from __future__ import annotations

import json
import math
import os
import random

import torch

from .config import ENV_ORACLE


class OracleDraft:
    def __init__(self, items=None, seed=0, rank_probs=(0.6, 0.3, 0.1), q=0.15, path=None):
        """items: [{"prompt": ids, "output": ids}], or None with ``path``: a JSON file of
        {"items", "seed", "rank_probs", "q"} read at the first plant."""
        self.path = path
        self.table = None
        if items is not None:
            self._configure(items, seed, rank_probs, q)

    def _configure(self, items, seed, rank_probs, q) -> None:
        self.table = {tuple(it["prompt"]): list(it["output"]) for it in items}
        self.seed = int(seed)
        self.rank_probs = list(rank_probs)
        self.q = float(q)  # geometric draft distribution p_r = (1 - q) q^r over ranks

    @classmethod
    def from_env(cls):
        """The oracle named by the env var; the file is read at the first plant, so a test may
        start the server before it has the target's reference outputs to write there."""
        return cls(path=os.environ[ENV_ORACLE])

    def _load(self) -> None:
        with open(self.path) as f:
            data = json.load(f)
        self._configure(data["items"], data.get("seed", 0),
                        data.get("rank_probs", (0.6, 0.3, 0.1)), data.get("q", 0.15))

    def _rank(self, rng) -> int:
        return rng.choices(range(len(self.rank_probs)), weights=self.rank_probs)[0]

    def plant(self, batch, topk_logp: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Rewrite [bs, D, K] log-probs / ids in place for requests with a known continuation."""
        if self.table is None:
            if not os.path.exists(self.path):  # e.g. the server's own health check: plant nothing
                return
            self._load()
        bs, depths, k = topk_ids.shape
        prefix = batch.seq_lens.tolist()  # host sync: test-only mode
        ids = topk_ids.cpu()
        logp = topk_logp.cpu()
        geo = torch.tensor([math.log(1 - self.q) + r * math.log(self.q) for r in range(k)])
        for b, req in enumerate(batch.reqs[:bs]):
            out = self.table.get(tuple(req.origin_input_ids))
            if out is None:
                continue
            # keyed by (seed, prompt, length) only: the same request gets the same trees in
            # every run, whatever else shares its batch (a seeded T > 0 run is then reproducible)
            rng = random.Random(hash((self.seed, tuple(req.origin_input_ids), prefix[b])))
            start = prefix[b] - len(req.origin_input_ids)  # output index of the root token
            stop = rng.randint(0, depths)  # plant depths 1..stop
            for d in range(1, stop + 1):
                i = start + d
                if i >= len(out):
                    break
                tok = out[i]
                r = min(self._rank(rng), k - 1)
                row = ids[b, d - 1]
                hit = (row == tok).nonzero()
                if len(hit):  # keep ids distinct: swap the existing copy away
                    row[int(hit[0])] = row[r].clone()
                row[r] = tok
                logp[b, d - 1] = geo
        topk_ids.copy_(ids.to(topk_ids.device))
        topk_logp.copy_(logp.to(topk_logp.device))
