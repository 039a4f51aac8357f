#!/usr/bin/env python3
"""Host cost of a grammar-constrained speculative step: SGLang's grammar walk over the verify
tree (``GrammarTree`` + ``build_grammar_vocab_mask``, what DDTREE and DFLASH call each step), as
a function of the tree (DDTREE budgets, DFLASH's chain of block B) and the vocabulary.

This walk is host work that overlaps the target's verify forward; when it takes longer than the
forward, the step waits for it. It calls ``fill_next_token_bitmask`` once per tree node the
grammar admits, so its cost grows with the admitted nodes and with the vocabulary.

Trees: for each request, a reference continuation the grammar accepts (a seeded walk of the
grammar itself) stands in for the target's output; the drafter's per-depth candidates are that
continuation's token at each depth (rank 0) plus ``topk - 1`` others, a share of them
(``--valid-share``) drawn from the tokens the grammar allows after the reference prefix. So
every tree holds the reference path and a controllable number of grammar-valid siblings.
The chain is the reference path itself (DFLASH's best case: every node admitted).

Vocabularies: the tiny pair's tokenizer (4,096 tokens) and synthetic ones padded with random
byte strings to ``--vocab-sizes`` (the bitmask is vocab / 32 words a node; Kimi K2 has 163,840
tokens). CPU time on this machine, medians of ``--repeats``; it says nothing of a GPU.

    python scripts/bench_grammar_walk.py --out bench_results/grammar_walk_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_grammar import allowed_tokens  # noqa: E402


def padded_info(tok, vocab_size, seed=0):
    """xgrammar TokenizerInfo: the tokenizer's tokens, then random byte strings up to
    ``vocab_size`` entries (byte-level BPE strings, as the tokenizer's own)."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok),
                                              stop_token_ids=[tok.eos_token_id])
    decoded = list(base.decoded_vocab)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz_ .,:()[]{}\"'0123456789"
    seen = set(decoded)
    while len(decoded) < vocab_size:
        s = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9))).encode()
        if s not in seen:
            seen.add(s)
            decoded.append(s)
    return xgr.TokenizerInfo(decoded, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[tok.eos_token_id])


def reference_walk(compiled, vocab_size, length, rng):
    """(root token, continuation of ``length`` tokens the grammar accepts, the allowed set after
    each prefix); a seeded walk preferring non-stop tokens."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    allowed_root = allowed_tokens(m, vocab_size)
    root = rng.choice(allowed_root)
    m.accept_token(root)
    cont, sets = [], []
    for _ in range(length):
        allowed = allowed_tokens(m, vocab_size)
        sets.append(allowed)
        pick = rng.choice(allowed)
        if not m.accept_token(pick) or m.is_terminated():
            break
        cont.append(pick)
    return root, cont, sets


def make_trees(compiled, vocab_size, bs, block, topk, budget, valid_share, seed):
    """DDTREE trees (budget nodes from per-depth candidates around the reference path), the
    DFLASH chains (root + reference tokens), and the requests' matchers at the root."""
    import torch

    from sglang_ddtree.tree import build_tree

    rng = random.Random(seed)
    depth = block - 1
    roots, ids, chains = [], [], []
    for _ in range(bs):
        while True:
            root, cont, sets = reference_walk(compiled, vocab_size, depth, rng)
            if len(cont) == depth:
                break
        roots.append(root)
        chains.append([root] + cont)
        per_depth = []
        for d in range(depth):
            cands = [cont[d]]
            pool = [t for t in sets[d] if t != cont[d]]
            while len(cands) < topk:
                if pool and rng.random() < valid_share:
                    t = pool.pop(rng.randrange(len(pool)))
                else:
                    t = rng.randrange(vocab_size)
                if t not in cands:
                    cands.append(t)
            per_depth.append(cands)
        ids.append(per_depth)
    ids = torch.tensor(ids, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    logp = torch.sort(torch.log_softmax(2 * torch.randn(bs, depth, topk, generator=g), -1),
                      -1, descending=True).values  # rank 0 (the reference) most likely
    tree = build_tree(torch.tensor(roots), logp, ids, budget)
    return tree, torch.tensor(chains, dtype=torch.int64), roots


def unpinned_grammar(compiled, vocab_size):
    """SGLang's XGrammarGrammar over a fresh matcher, its bitmask allocated unpinned (the
    backend pins it, which needs a CUDA driver)."""
    import xgrammar as xgr
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    gr = XGrammarGrammar(xgr.GrammarMatcher(compiled), vocab_size, compiled, None)
    gr.allocate_vocab_mask = lambda vocab_size, batch_size, device: xgr.allocate_token_bitmask(
        batch_size, vocab_size)
    return gr


def walk_ms(compiled, vocab_size, roots, next_token, next_sibling, tokens, repeats):
    """(median ms of one build_grammar_vocab_mask over the batch, admitted nodes)."""
    from sglang_ddtree import compat

    sgl = compat.load()
    grammars = []
    for r in roots:
        gr = unpinned_grammar(compiled, vocab_size)
        gr.accept_token(int(r))
        grammars.append(gr)
    reqs = [types.SimpleNamespace(grammar=gr) for gr in grammars]
    info = types.SimpleNamespace(vocab_size=vocab_size, grammar_mask=None)
    times = []
    mask = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        tree = sgl.GrammarTree.from_host(next_token, next_sibling, tokens)
        mask = sgl.build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=info,
                                            device="cpu", barrier=None).vocab_mask
        times.append((time.perf_counter() - t0) * 1e3)
    admitted = int((mask != -1).any(dim=1).sum())  # rows the walk filled (a full row: rare)
    ms = statistics.median(times)
    return ms, admitted, round(ms * 1e3 / max(admitted, 1), 1)


def chain_links(chains):
    import torch

    bs, n = chains.shape
    nxt = torch.full((bs, n), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, n)
    return nxt, torch.full((bs, n), -1, dtype=torch.int64)


FIELDS = ("ms", "admitted", "us_per_admitted_node")  # of walk_ms, per tree kind in a row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_results/grammar_walk_cpu.json")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab-sizes", default="4096,32768,163840")
    ap.add_argument("--constraints", default="json,regex")
    ap.add_argument("--valid-share", type=float, default=0.5,
                    help="share of each depth's non-reference candidates the grammar allows")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import sglang
    import torch
    import xgrammar as xgr

    from transformers import AutoTokenizer

    from e2e_grammar import ASSETS, compile_constraint
    from sglang_ddtree.provenance import checkout_digest

    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "target"))
    budgets = [int(b) for b in args.budgets.split(",") if b]
    result = {
        "what": "CPU ms of SGLang's grammar walk over one step's verify trees (a batch of "
                f"{args.batch} requests), DDTREE trees vs DFLASH's chain; host work only",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(["python", "scripts/" + os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "source_digest": checkout_digest(__file__),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "versions": {"sglang": sglang.__version__, "torch": torch.__version__,
                     "xgrammar": getattr(xgr, "__version__", None) or _dist_version("xgrammar")},
        "block": args.block, "topk": args.topk, "batch": args.batch,
        "valid_share": args.valid_share, "repeats": args.repeats, "rows": [],
    }
    for vocab_size in [int(v) for v in args.vocab_sizes.split(",") if v]:
        info = padded_info(tok, max(vocab_size, len(tok)))
        compiler = xgr.GrammarCompiler(info)
        for name in [c for c in args.constraints.split(",") if c]:
            compiled = compile_constraint(compiler, name)
            row = {"vocab": info.vocab_size, "constraint": name}
            for b in budgets:  # seeded alike: every budget's trees around the same references
                tree, chains, roots = make_trees(compiled, info.vocab_size, args.batch,
                                                 args.block, args.topk, b, args.valid_share,
                                                 seed=1)
                row[f"ddtree_b{b}"] = dict(zip(FIELDS, walk_ms(
                    compiled, info.vocab_size, roots, tree.retrive_next_token,
                    tree.retrive_next_sibling, tree.tokens, args.repeats)))
            nxt, sib = chain_links(chains)
            row["dflash_chain"] = dict(zip(FIELDS, walk_ms(
                compiled, info.vocab_size, roots, nxt, sib, chains, args.repeats)))
            result["rows"].append(row)
            print(json.dumps(row))
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            json.dump(result, open(args.out, "w"), indent=1)


def _dist_version(name):
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
