"""Train a tiny Python-code target (Qwen3 architecture) and a DFlash drafter for it.

Everything is written under ``--out`` (default ``bench_assets/tiny-code``):

    target/         config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json
    dflash-draft/   same files; config has block_size, num_target_layers, dflash_config
    eval_prompts.jsonl   held-out prompts: {"id", "source", "start_line", "text", "input_ids"}
    train_log.json       every number the model card quotes, plus loss curves
    README.md            model card generated from train_log.json

Steps: collect the running interpreter's stdlib sources (hold out ~1/40 of the files), train a
byte-level BPE tokenizer, train the target with a time budget, greedy-generate continuations with
the saved (bf16) target, train the drafter on the target's own hidden states and continuations,
then estimate greedy DFlash accept length offline on the held-out prompts.

H200 (one GPU, ~6 min wall; PYTHONPATH=/tmp/site = the devkit's transformers 5.12.1 / tokenizers
0.22.2, the versions SGLang loads these files with and the CPU tests use):
    PYTHONPATH=/tmp/site python3 scripts/train_tiny_pair.py --copy-to "$OUT"
    # back here: tar -xzf <files_at>/tiny-code.tar.gz -C bench_assets/
CPU smoke test (< 2 min on 2 cores):  python scripts/train_tiny_pair.py --smoke --out /tmp/tiny
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tiny_pair_data as data  # noqa: E402
import tiny_pair_target as tgt  # noqa: E402
from tiny_dflash import (  # noqa: E402
    DFlashDrafter, DraftShape, TargetFeatures, block_attention_mask, drafter_state_dict_for_sglang,
    make_blocks, position_weights, simulate_dflash_greedy,
)
from tiny_pair_card import write_model_card  # noqa: E402

SMOKE = dict(vocab_size=512, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16,
             draft_layers=1, draft_intermediate=128, seq_len=128, batch=8, target_steps=20,
             draft_steps=20, gen_prompt_min=24, gen_prompt_max=40, gen_len=48, gen_seqs=32,
             gen_batch=16, draft_batch=8, anchors=4,
             eval_prompts=4, prompt_tokens=40, eval_gen=32, max_train_files=40, eval_batches=2)
LOG_EVERY = 25  # steps per logged training-loss window (the mean over the window is logged)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--out", default="bench_assets/tiny-code")
    a("--copy-to", default=None,
      help="also write <out-name>.tar.gz + train_log.json + README.md here (e.g. $OUT)")
    a("--smoke", action="store_true", help="toy sizes and fixed small step counts (CPU test)")
    a("--max-minutes", type=float, default=5.5, help="wall budget for the whole run")
    a("--device", default="auto")
    a("--seed", type=int, default=0)
    a("--source-root", default=None, help="directory of .py files (default: the stdlib)")
    a("--max-train-files", type=int, default=None)
    a("--eval-modulus", type=int, default=40)
    # tokenizer + target
    a("--vocab-size", type=int, default=4096)
    a("--hidden", type=int, default=256)
    a("--intermediate", type=int, default=384)
    a("--layers", type=int, default=4)
    a("--heads", type=int, default=4)
    a("--kv-heads", type=int, default=2)
    a("--head-dim", type=int, default=64)
    a("--max-positions", type=int, default=2048)
    a("--rope-theta", type=float, default=10000.0)
    a("--seq-len", type=int, default=512)
    a("--batch", type=int, default=64)
    a("--lr", type=float, default=3e-3)
    a("--target-steps", type=int, default=100000, help="cap; the time budget usually ends first")
    a("--eval-batches", type=int, default=16)
    # drafter
    a("--draft-layers", type=int, default=2)
    a("--draft-intermediate", type=int, default=256)
    a("--block-size", type=int, default=16)
    a("--target-layer-ids", default=None, help="comma list; default evenly spaced in [0, L-2]")
    a("--gen-prompt-min", type=int, default=64, help="prompt windows of the drafter's data: their")
    a("--gen-prompt-max", type=int, default=256, help="length varies per generation batch, so that "
      "the drafter sees contexts as long as the benchmark's prompts + outputs")
    a("--gen-len", type=int, default=256)
    a("--gen-seqs", type=int, default=8192, help="cap on generated training sequences")
    a("--sampled-fraction", type=float, default=0.0,
      help="share of generation batches sampled at T=1 instead of greedy (default: greedy only)")
    a("--gen-batch", type=int, default=512)
    a("--draft-batch", type=int, default=64)
    a("--anchors", type=int, default=16, help="draft blocks trained per sequence per step")
    a("--draft-lr", type=float, default=2e-3)
    a("--gamma", type=float, default=7.0, help="position loss decay exp(-(k-1)/gamma)")
    a("--draft-steps", type=int, default=100000)
    # evaluation
    a("--eval-prompts", type=int, default=128)
    a("--prompt-tokens", type=int, default=160)
    a("--eval-gen", type=int, default=128)
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.max_minutes = min(args.max_minutes, 1.5)
    if args.target_layer_ids is None:
        k = min(3, args.layers - 1)
        args.target_layer_ids = sorted({round(i * (args.layers - 2) / max(k - 1, 1)) for i in range(k)})
    elif isinstance(args.target_layer_ids, str):
        args.target_layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
    if max(args.target_layer_ids) > args.layers - 2 or min(args.target_layer_ids) < 0:
        p.error(f"--target-layer-ids {args.target_layer_ids} must lie in [0, {args.layers - 2}]")
    if args.gen_len < args.block_size or args.eval_gen < args.block_size:
        p.error("--gen-len and --eval-gen must be >= --block-size")
    return args


class Clock:
    """Wall budget shared by the phases; ``progress`` drives the LR schedules."""

    def __init__(self, minutes: float):
        self.t0 = time.time()
        self.deadline = self.t0 + 60.0 * minutes

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.deadline - time.time()


def log(msg: str) -> None:
    print(msg, flush=True)


def autocast(device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=device.type == "cuda")


def train_target(model, stream: np.ndarray, args, device, seconds: float, rng) -> dict:
    opt = torch.optim.AdamW(tgt.param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if device.type == "cuda" else {}))
    stream_t = torch.from_numpy(stream.astype(np.int64))
    t0, step, curve, window = time.time(), 0, [], []
    model.train()
    while step < args.target_steps and time.time() - t0 < seconds:
        progress = max(step / args.target_steps, (time.time() - t0) / seconds)
        for g in opt.param_groups:
            g["lr"] = tgt.lr_at(progress, args.lr)
        starts = rng.integers(0, len(stream) - args.seq_len - 1, size=args.batch)
        x = torch.stack([stream_t[s: s + args.seq_len] for s in starts]).to(device, non_blocking=True)
        with autocast(device):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window.append(loss.detach())
        if step % LOG_EVERY == 0:
            val = float(torch.stack(window).mean())  # one host sync per window
            curve.append([step, round(time.time() - t0, 2), round(val, 4)])
            if step % (8 * LOG_EVERY) == 0:
                log(f"  target step {step:6d}  loss {val:.4f}  {time.time() - t0:6.1f}s")
            window = []
    model.eval()
    if window:
        curve.append([step, round(time.time() - t0, 2), round(float(torch.stack(window).mean()), 4)])
    return {"steps": step, "seconds": round(time.time() - t0, 1), "tokens": step * args.batch * args.seq_len,
            "final_train_loss": curve[-1][2] if curve else None, "curve": curve}


@torch.no_grad()
def stream_loss(model, stream: np.ndarray, args, device) -> float:
    """Mean next-token CE over up to ``eval_batches`` x batch consecutive held-out windows."""
    n_win = min(args.eval_batches * args.batch, (len(stream) - 1) // args.seq_len)
    losses = []
    for b in range(0, n_win, args.batch):
        idx = range(b, min(n_win, b + args.batch))
        x = torch.stack([torch.from_numpy(stream[i * args.seq_len:(i + 1) * args.seq_len].astype(np.int64))
                         for i in idx]).to(device)
        with autocast(device):
            losses.append(float(model(input_ids=x, labels=x).loss) * len(idx))
    return round(sum(losses) / max(n_win, 1), 4)


def generate_draft_data(model, stream: np.ndarray, args, device, seconds: float, rng):
    """The target's continuations of random training windows, one prompt length per batch;
    greedy, except a ``--sampled-fraction`` share of batches sampled at temperature 1.

    Returns a list of ``(seqs int64 [n, P + gen_len], P, temperature)``, one per batch.
    """
    out, t0, done = [], time.time(), 0
    while done < args.gen_seqs and (done == 0 or time.time() - t0 < seconds):
        n = min(args.gen_batch, args.gen_seqs - done)
        p_len = int(rng.integers(args.gen_prompt_min, args.gen_prompt_max + 1))
        starts = rng.integers(0, len(stream) - p_len, size=n)
        prompts = torch.from_numpy(np.stack([stream[s: s + p_len] for s in starts]).astype(np.int64))
        temp = 1.0 if rng.random() < args.sampled_fraction else 0.0
        with autocast(device):
            out.append((tgt.generate_equal(model, prompts.to(device), args.gen_len, temp), p_len, temp))
        done += n
    return out


def draft_loss(drafter, embed_w, feats, seqs, anchors, args, weights):
    ids, pos, labels = make_blocks(seqs, anchors, args.block_size, data.MASK_ID)
    mask = block_attention_mask(anchors, seqs.shape[1], args.block_size)
    ctx = drafter.project_context(feats)
    hidden = drafter(F.embedding(ids, embed_w), pos, ctx, mask)
    n, m = anchors.shape
    hidden = hidden.view(n, m, args.block_size, -1)[:, :, 1:]  # positions 1..B-1 propose tokens
    logits = hidden.float() @ embed_w.float().T  # [n, m, B-1, V]
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(n, m, -1)
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    acc = (logits.argmax(-1) == labels).float().mean((0, 1))  # per-position top-1 accuracy
    return loss, acc


def sample_anchors(n, m, lo, hi, device, gen):
    """m distinct anchors per row, uniform in [lo, hi]."""
    scores = torch.rand(n, hi - lo + 1, device=device, generator=gen)
    return scores.topk(m, dim=1).indices + lo


def train_drafter(drafter, feat_fn, embed_w, groups, args, device, seconds: float) -> dict:
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.01,
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    weights = position_weights(args.block_size, args.gamma, device)
    m = min(args.anchors, args.gen_len - args.block_size + 1)  # anchors in [P, P + gen_len - B]
    sizes = np.array([g[0].shape[0] for g in groups], dtype=np.float64)
    pick = np.random.default_rng(args.seed + 3)
    t0, step, curve, window, window_acc = time.time(), 0, [], [], []
    drafter.train()
    while step < args.draft_steps and time.time() - t0 < seconds:
        progress = max(step / args.draft_steps, (time.time() - t0) / seconds)
        for g in opt.param_groups:
            g["lr"] = tgt.lr_at(progress, args.draft_lr)
        seqs, p_len, _ = groups[int(pick.choice(len(groups), p=sizes / sizes.sum()))]
        lo, hi = p_len, seqs.shape[1] - args.block_size
        rows = torch.randint(0, seqs.shape[0], (args.draft_batch,), device=device, generator=gen)
        batch = seqs[rows]
        with torch.no_grad(), autocast(device):
            feats = feat_fn(batch)
        anchors = sample_anchors(len(rows), m, lo, hi, device, gen)
        with autocast(device):
            loss, acc = draft_loss(drafter, embed_w, feats, batch, anchors, args, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        window.append(loss.detach())
        window_acc.append(acc.detach())
        if step % LOG_EVERY == 0:
            val, a = float(torch.stack(window).mean()), torch.stack(window_acc).mean(0).cpu()
            curve.append([step, round(time.time() - t0, 2), round(val, 4)])
            if step % (8 * LOG_EVERY) == 0:
                log(f"  draft step {step:6d}  loss {val:.4f}  acc@1 {a[0]:.3f}  acc@{len(a)} {a[-1]:.3f}"
                    f"  {time.time() - t0:6.1f}s")
            last_acc, window, window_acc = a, [], []
    drafter.eval()
    if window:
        last_acc = torch.stack(window_acc).mean(0).cpu()
        curve.append([step, round(time.time() - t0, 2), round(float(torch.stack(window).mean()), 4)])
    return {"steps": step, "seconds": round(time.time() - t0, 1), "anchors_per_seq": m,
            "final_train_loss": curve[-1][2] if curve else None,
            "final_train_top1_acc_by_position": [round(float(x), 4) for x in last_acc] if curve else None,
            "curve": curve}


def main(argv=None) -> dict:
    args = parse_args(argv)
    clock = Clock(args.max_minutes)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    out = pathlib.Path(args.out)
    tdir, ddir = out / "target", out / "dflash-draft"
    for d in (tdir, ddir):
        if d.exists():
            shutil.rmtree(d)
    log(f"[tiny-pair] device={device} torch={torch.__version__} out={out} smoke={args.smoke}")

    corpus = data.collect_stdlib_sources(args.source_root, args.eval_modulus, args.max_train_files)
    log(f"[data] {corpus.root}: {len(corpus.train)} train files ({corpus.train_bytes / 1e6:.1f} MB), "
        f"{len(corpus.eval)} held-out ({corpus.eval_bytes / 1e6:.2f} MB)")
    tok = data.train_bpe_tokenizer((f.text for f in corpus.train), args.vocab_size)
    vocab = tok.get_vocab_size()
    for d in (tdir, ddir):
        data.save_tokenizer(tok, d, args.max_positions)
    train_stream = data.encode_stream(tok, corpus.train)
    eval_stream = data.encode_stream(tok, corpus.eval)
    prompts = data.make_eval_prompts(tok, corpus.eval, args.eval_prompts, args.prompt_tokens)
    if not prompts:
        raise RuntimeError("no evaluation prompts could be cut from the held-out files")
    if len(prompts) < args.eval_prompts:
        log(f"[warn] only {len(prompts)} of {args.eval_prompts} eval prompts: few or short held-out "
            f"files (hold out more with a smaller --eval-modulus)")
    data.write_jsonl(out / "eval_prompts.jsonl", prompts)
    log(f"[data] vocab {vocab}; {len(train_stream)} train / {len(eval_stream)} held-out tokens; "
        f"{len(prompts)} eval prompts; {clock.elapsed():.1f}s")

    tcfg = tgt.target_config(args, vocab)
    model = tgt.build_target(tcfg).to(device)
    n_target = tgt.count_params(model)
    reserve = 5.0 if args.smoke else 25.0  # final save + evaluation
    budget = max(1.0, clock.left() - reserve)
    log(f"[target] {n_target / 1e6:.2f}M params; budget {0.45 * budget:.0f}s")
    tstats = train_target(model, train_stream, args, device, 0.45 * budget, rng)
    tgt.save_model_dir(tdir, tcfg, tgt.target_state_dict(model))
    del model
    target = tgt.load_target(tdir, device)  # what SGLang will serve: bf16-rounded weights
    tstats["heldout_loss"] = stream_loss(target, eval_stream, args, device)
    log(f"[target] {tstats['steps']} steps, train loss {tstats['final_train_loss']}, "
        f"held-out loss {tstats['heldout_loss']}; {clock.elapsed():.1f}s")

    budget = max(1.0, clock.left() - reserve)
    groups = generate_draft_data(target, train_stream, args, device, 0.15 * budget, rng)
    n_gen = sum(g[0].shape[0] for g in groups)
    n_sampled = sum(g[0].shape[0] for g in groups if g[2] > 0)
    log(f"[gen] {n_gen} sequences ({n_sampled} sampled at T=1, the rest greedy) of "
        f"{args.gen_prompt_min}-{args.gen_prompt_max}+{args.gen_len} tokens; {clock.elapsed():.1f}s")

    shape = DraftShape(args.hidden, args.draft_intermediate, args.draft_layers, args.heads, args.kv_heads,
                       args.head_dim, len(args.target_layer_ids), args.rope_theta)
    drafter = DFlashDrafter(shape).to(device)
    for p_ in drafter.parameters():  # same init scale as the HF target
        if p_.ndim >= 2:
            torch.nn.init.normal_(p_, std=0.02)
    n_draft = sum(p_.numel() for p_ in drafter.parameters())
    features = TargetFeatures(target, args.target_layer_ids)
    embed_w = target.model.embed_tokens.weight
    budget = max(1.0, clock.left() - reserve)
    log(f"[draft] {n_draft / 1e6:.2f}M params, layers {args.target_layer_ids}; budget {budget:.0f}s")
    dstats = train_drafter(drafter, features.feats, embed_w, groups, args, device, budget)
    dcfg = tgt.drafter_config(args, vocab)
    tgt.save_model_dir(ddir, dcfg, drafter_state_dict_for_sglang(drafter))

    # Offline evaluation with the saved (bf16) weights, in fp32, on held-out prompts.
    drafter_eval = DFlashDrafter(shape).to(device)
    drafter_eval.load_state_dict({k: v.float() for k, v in tgt.load_tensors(ddir).items()})
    drafter_eval.eval()
    eval_seqs, starts, ends = tgt.greedy_generate_ragged(target, [p["input_ids"] for p in prompts],
                                                         args.eval_gen, device)
    with torch.no_grad():
        feats = features.feats(eval_seqs)
        sim = simulate_dflash_greedy(drafter_eval, embed_w, feats, eval_seqs, starts, ends,
                                     args.block_size, data.MASK_ID)
        m = args.anchors  # evenly spaced over each row's continuation, deterministic
        span = (ends - args.block_size - starts)[:, None]
        anchors = starts[:, None] + (torch.arange(m, device=device) * span) // max(m - 1, 1)
        eloss, eacc = draft_loss(drafter_eval, embed_w, feats, eval_seqs, anchors, args,
                                 position_weights(args.block_size, args.gamma, device))
    dstats["heldout_loss"] = round(float(eloss), 4)
    dstats["heldout_top1_acc_by_position"] = [round(float(x), 4) for x in eacc]
    log(f"[draft] {dstats['steps']} steps, train loss {dstats['final_train_loss']}, held-out loss "
        f"{dstats['heldout_loss']}; offline accept length {sim['mean_accept_length']:.3f} "
        f"(block {args.block_size}, {len(prompts)} prompts x {args.eval_gen} tokens)")

    sizes = {str(p_.relative_to(out)): p_.stat().st_size for p_ in sorted(out.rglob("*"))
             if p_.is_file() and p_.name not in ("README.md", "train_log.json")}
    import tokenizers
    import transformers
    report = {
        "command": " ".join([sys.executable, "scripts/train_tiny_pair.py"]
                            + list(sys.argv[1:] if argv is None else argv)), "args": vars(args),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or "cpu"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_seconds": round(clock.elapsed(), 1),
        "log_every": LOG_EVERY,
        "data": {"root": corpus.root, "train_files": len(corpus.train), "heldout_files": len(corpus.eval),
                 "train_bytes": corpus.train_bytes, "heldout_bytes": corpus.eval_bytes,
                 "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(eval_stream)),
                 "vocab_size": vocab, "eval_prompts": len(prompts),
                 "heldout_sources": sorted({f.relpath for f in corpus.eval})},
        "target": {"params": n_target, "config": tcfg, **tstats},
        "drafter": {"params": n_draft, "config": dcfg, "generated_sequences": n_gen,
                    "sampled_sequences": n_sampled,
                    "generated_prompt_lengths": sorted({g[1] for g in groups}), **dstats},
        "offline_accept_estimate": {"what": "this script's own PyTorch replay of greedy DFlash block "
                                    "drafting vs the target's greedy output (fp32, saved bf16 weights); "
                                    "tokens per draft step = accepted drafts + 1",
                                    "prompts": len(prompts), "gen_tokens_per_prompt": args.eval_gen,
                                    "block_size": args.block_size, **sim},
        "file_bytes": sizes,
    }
    (out / "train_log.json").write_text(json.dumps(report, indent=1) + "\n")
    write_model_card(out / "README.md", report)
    total = sum(p_.stat().st_size for p_ in out.rglob("*") if p_.is_file())
    log(f"[done] {total / 1e6:.2f} MB under {out} in {clock.elapsed():.1f}s")
    if total > 10_000_000:
        log(f"[warn] asset is {total / 1e6:.2f} MB, above the 10 MB limit: {sizes}")
    report["total_bytes"] = total
    if args.copy_to:
        export_results(out, pathlib.Path(args.copy_to))
    return report


def export_results(out: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Copy the run to ``dest`` as few files: ``<name>.tar.gz`` of the whole tree, plus
    ``train_log.json`` and ``README.md`` to read without unpacking (the device tool returns at
    most 8 files from $OUT, and the tree has 13)."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"{out.resolve().name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.resolve().name)
    for name in ("train_log.json", "README.md"):
        shutil.copy2(out / name, dest / name)
    log(f"[done] {archive} ({archive.stat().st_size / 1e6:.2f} MB); unpack with: "
        f"tar -xzf {archive.name} -C bench_assets/")
    return archive


if __name__ == "__main__":
    main()
