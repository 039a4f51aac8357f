"""DDTree settings: where they come from, what is valid, and the verify width they imply.

One source of truth across SGLang's processes: environment variables. The launcher's CLI flags
(``--speculative-ddtree-budget``, ``--speculative-ddtree-topk``) are copied into them before
``ServerArgs`` is built (see :mod:`sglang_ddtree.hooks`), scheduler processes inherit them, and
``sglang.Engine(...)`` users set them directly.

Widths, for a drafter of block size B (one bonus token + B-1 drafted depths):

- ``budget``: draft nodes in the tree (excluding the root), 1..1024.
- verify width ``N = budget + 1``: tokens per request in the target's verify forward.
- ``speculative_num_draft_tokens`` (SGLang's own knob) is set to ``max(N, B)``: SGLang sizes
  per-request buffers (custom masks, KV index buffers) and the per-step KV reservation from it, so
  it must cover both the verify forward (N tokens) and the draft forward (B tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

ENV_BUDGET = "SGLANG_DDTREE_BUDGET"
ENV_TOPK = "SGLANG_DDTREE_TOPK"
ENV_ORACLE = "SGLANG_DDTREE_TEST_ORACLE"  # test-only oracle draft mode (see sglang_ddtree.oracle)
ENV_TIMERS = "SGLANG_DDTREE_TIMERS"
ENV_RANK_CHECK = "SGLANG_DDTREE_CHECK_RANKS"  # debug: compare tree hashes across TP ranks
ENV_SYNC_CHECK = "SGLANG_DDTREE_CHECK_SYNCS"  # debug: log host syncs inside the decode step
ENV_BLOCK_SIZE = "SGLANG_DDTREE_BLOCK_SIZE"  # internal: set by the launcher for its schedulers
ENV_VERIFY_BACKEND = "SGLANG_DDTREE_VERIFY_BACKEND"
ENV_KV_MOVE = "SGLANG_DDTREE_KV_MOVE"  # fused (kv_move.py, default) | sglang (per column)
ENV_COMMIT = "SGLANG_DDTREE_COMMIT"  # fused (default: triton_kernels/walk_commit.py) | ops

MIN_BUDGET = 1
MAX_BUDGET = 1024  # SGLang's tree kernels and our builders cap at 1024 nodes
DEFAULT_BUDGET = 32
AUTO_BUDGET = "auto"
ENV_AUTO_TABLE = "SGLANG_DDTREE_AUTO_TABLE"
# with --speculative-ddtree-budget auto: "table" (the batch-size table) or "online" (measured)
ENV_AUTO_MODE = "SGLANG_DDTREE_AUTO_MODE"
AUTO_MODES = ("table", "online")
INF_BS = 1 << 30
# Derived by `scripts/make_auto_table.py --bands 8` from the session-7 H200 budget sweep with the
# trained tiny pair (bench_results/bench_e2e_tiny_h200_sweep_s7.json, greedy, budgets 8-128
# interleaved with DFLASH): per batch-size band the budget with the best geometric-mean ratio to
# DFLASH over the band's concurrencies, budget 128 up to 8 (1.43x over c = 1/4/8) and 64 above
# (1.38x over c = 16/32/64). Checked in a second run (bench_results/bench_e2e_tiny_h200.json).
# On this host-bound model a bigger tree costs little; on a big model it does not
# (docs/auto_budget.md): measure your own pair with scripts/bench_e2e.py and derive yours.
DEFAULT_AUTO_TABLE = "8:128,inf:64"

ALGORITHM_NAME = "DDTREE"

# Target attention backends whose TARGET_VERIFY honours a FULL_MASK custom mask, by attention
# architecture. fa3 needs speculative_eagle_topk > 1 to take the mask; not wired yet.
TREE_VERIFY_BACKENDS = {
    "mha": ("triton", "flashinfer"),
    "mla": ("triton",),
}
# Which kernels run the target's verify forward (--speculative-ddtree-verify-backend):
# "native" = the target's own attention backend with the FULL_MASK custom mask (the backends
# above); "triton" = our Triton tree-attention kernels (sglang_ddtree/verify_backend.py) while
# prefill and decode keep the target's backend; "auto" (default) = triton where
# AUTO_PREFERS_TRITON_VERIFY lists the target's backend, else native where it can express a
# tree, else triton where it can sit behind that backend.
VERIFY_BACKENDS = ("auto", "native", "triton")
# Target backends that can express a tree natively but where "auto" still picks our kernels,
# because they verify faster: SGLang's triton MLA extend kernel on the Kimi K2.6 TP8-rank
# emulation, verify stage 13-28 % shorter at budget 32, batch 1 / 8 / 32 (session 8, H200,
# bench_results/cost_curves_kimi_timers_tv_h200_s8.json vs cost_curves_kimi_timers_h200_s8.json).
AUTO_PREFERS_TRITON_VERIFY = {
    "mha": (),
    "mla": ("triton",),
}
DEFAULT_VERIFY_BACKEND = "auto"
# Target attention backends (runtime names, as compat.attention_backend_name reports them) that
# the "triton" verify backend can sit behind: they keep SGLang's token-granular KV pools
# (MHATokenToKVPool [slots, H, D] / MLATokenToKVPool [slots, 1, rank + rope]).
TRITON_VERIFY_TARGET_BACKENDS = {
    "mha": ("triton", "flashinfer", "fa3"),
    "mla": ("triton", "flashinfer_mla", "flashmla", "cutlass_mla", "trtllm_mla", "fa3"),
}
# The same set as --attention-backend values (SGLang picks its MLA flashinfer backend for
# "flashinfer" on an MLA model).
TRITON_VERIFY_CLI_BACKENDS = ("triton", "flashinfer", "fa3", "flashmla", "cutlass_mla",
                              "trtllm_mla")
# Drafter attention backends we pin to (the drafter runs a block-causal TARGET_VERIFY forward).
DRAFT_BACKENDS = ("triton", "flashinfer")


class DDTreeConfigError(ValueError):
    """A DDTree setting is invalid; the message names the setting and the fix."""


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise DDTreeConfigError(f"{name}={raw!r} is not an integer.") from None


@dataclass(frozen=True)
class DDTreeConfig:
    budget: int  # draft nodes per tree, excluding the root (with auto: the largest one)
    topk: int  # per-depth candidates K (<= vocab)
    block_size: int  # drafter block size B: depths 1..B-1
    # --speculative-ddtree-budget auto: ((max batch size, budget), ...) by increasing batch size
    auto_table: Optional[Tuple[Tuple[int, int], ...]] = None

    def budget_for(self, bs: int) -> int:
        """The budget a step of ``bs`` requests uses (the fixed budget unless auto)."""
        if self.auto_table is None:
            return self.budget
        for max_bs, budget in self.auto_table:
            if bs <= max_bs:
                return budget
        return self.auto_table[-1][1]

    @property
    def budgets(self) -> Tuple[int, ...]:
        """Every budget this server can use, largest first."""
        if self.auto_table is None:
            return (self.budget,)
        return tuple(sorted({b for _, b in self.auto_table}, reverse=True))

    @property
    def verify_width(self) -> int:
        """N = budget + 1 tokens per request in the target verify forward."""
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        """D = B - 1 drafted depths."""
        return self.block_size - 1

    @property
    def num_draft_tokens(self) -> int:
        """Value for SGLang's ``speculative_num_draft_tokens``: covers verify and draft widths."""
        return max(self.verify_width, self.block_size)


def validate_budget(budget: int) -> int:
    if not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise DDTreeConfigError(
            f"--speculative-ddtree-budget must be in [{MIN_BUDGET}, {MAX_BUDGET}], got {budget}. "
            f"Pick e.g. {DEFAULT_BUDGET} (set the flag, or {ENV_BUDGET} for sglang.Engine)."
        )
    return budget


def is_auto_budget(environ=os.environ) -> bool:
    return environ.get(ENV_BUDGET, "").strip().lower() == AUTO_BUDGET


def read_budget(environ=os.environ) -> int:
    """The fixed budget, or with ``auto`` the largest budget of the auto table (it sets the verify
    width SGLang reserves KV slots and captures its own verify graphs for)."""
    raw = environ.get(ENV_BUDGET)
    if raw is None or raw == "":
        return DEFAULT_BUDGET
    if raw.strip().lower() == AUTO_BUDGET:
        return max(b for _, b in read_auto_table(environ))
    return validate_budget(_parse_int(ENV_BUDGET, raw))


def parse_auto_table(raw: str) -> Tuple[Tuple[int, int], ...]:
    """'1:32,inf:8' -> ((1, 32), (INF_BS, 8)): batches of up to 1 request use budget 32, larger
    ones 8. Batch-size bounds strictly increase and the last one is 'inf'."""
    rows = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise DDTreeConfigError(f"{ENV_AUTO_TABLE}: expected 'max_bs:budget,...', got "
                                    f"{part!r} in {raw!r}.")
        bs_raw, budget_raw = (x.strip() for x in part.split(":", 1))
        max_bs = INF_BS if bs_raw.lower() == "inf" else _parse_int(ENV_AUTO_TABLE, bs_raw)
        budget = validate_budget(_parse_int(ENV_AUTO_TABLE, budget_raw))
        if max_bs < 1 or (rows and max_bs <= rows[-1][0]):
            raise DDTreeConfigError(f"{ENV_AUTO_TABLE}: batch-size bounds must be >= 1 and "
                                    f"strictly increasing, got {raw!r}.")
        rows.append((max_bs, budget))
    if not rows or rows[-1][0] != INF_BS:
        raise DDTreeConfigError(f"{ENV_AUTO_TABLE}: the last entry must be 'inf:<budget>' (every "
                                f"batch size needs a budget), got {raw!r}.")
    return tuple(rows)


def read_auto_table(environ=os.environ) -> Tuple[Tuple[int, int], ...]:
    return parse_auto_table(environ.get(ENV_AUTO_TABLE, "") or DEFAULT_AUTO_TABLE)


def read_auto_mode(environ=os.environ) -> str:
    """SGLANG_DDTREE_AUTO_MODE: how ``--speculative-ddtree-budget auto`` picks a step's budget.
    ``table`` (default): by batch size from SGLANG_DDTREE_AUTO_TABLE; ``online``: among the
    table's budgets, by this server's measured throughput per batch-size bucket
    (``auto_online.py``; not with DP attention or pipeline parallelism)."""
    raw = environ.get(ENV_AUTO_MODE, "").strip().lower() or "table"
    if raw not in AUTO_MODES:
        raise DDTreeConfigError(f"{ENV_AUTO_MODE}={raw!r}: expected one of {', '.join(AUTO_MODES)}.")
    if raw == "online" and not is_auto_budget(environ):
        raise DDTreeConfigError(
            f"{ENV_AUTO_MODE}=online chooses among the budgets of --speculative-ddtree-budget "
            "auto; the budget is fixed here. Set --speculative-ddtree-budget auto, or unset "
            f"{ENV_AUTO_MODE}.")
    return raw


def online_auto_parallel_error(dp_attention: bool, pp_size: int = 1) -> Optional[str]:
    """The start-up refusal for online auto where ranks run different batches (None: fine):
    the ranks take rank 0's choice at points of a schedule they must share."""
    if not dp_attention and pp_size <= 1:
        return None
    what = "--enable-dp-attention" if dp_attention else f"pipeline parallel size {pp_size}"
    return (f"DDTREE: {ENV_AUTO_MODE}=online needs every rank to run the same batches, which "
            f"{what} does not. Use {ENV_AUTO_MODE}=table (the default) with a "
            f"{ENV_AUTO_TABLE}.")


def read_topk(environ=os.environ) -> Optional[int]:
    raw = environ.get(ENV_TOPK)
    if raw is None or raw == "":
        return None
    topk = _parse_int(ENV_TOPK, raw)
    if topk < 1:
        raise DDTreeConfigError(f"--speculative-ddtree-topk must be >= 1, got {topk}.")
    return topk


def resolve(block_size: int, vocab_size: int, environ=os.environ) -> DDTreeConfig:
    """Build the config from the environment plus the drafter's block size and the vocab size."""
    if block_size < 2:
        raise DDTreeConfigError(
            f"DDTREE needs a drafter block_size >= 2 (one bonus + at least one drafted depth), "
            f"got {block_size}. Check block_size in the drafter's config.json."
        )
    budget = read_budget(environ)
    auto_table = read_auto_table(environ) if is_auto_budget(environ) else None
    topk = read_topk(environ)
    # K beyond the budget can never be used: a depth-1 node of rank >= budget has at least budget
    # better-ranked siblings.
    k = min(budget, vocab_size) if topk is None else min(topk, budget, vocab_size)
    return DDTreeConfig(budget=budget, topk=k, block_size=block_size, auto_table=auto_table)


def validate_verify_backend(name: str) -> str:
    if name not in VERIFY_BACKENDS:
        raise DDTreeConfigError(
            f"--speculative-ddtree-verify-backend must be one of {', '.join(VERIFY_BACKENDS)}, "
            f"got {name!r} (or set {ENV_VERIFY_BACKEND} for sglang.Engine)."
        )
    return name


def resolve_verify_backend(requested: str, backend: str, native_ok, triton_ok,
                           prefer_triton=()) -> str:
    """"native" or "triton" for the target attention backend ``backend``: ``requested`` unless it
    is "auto", which picks triton where ``backend`` is in ``prefer_triton`` (ours is faster),
    native where ``backend`` is in ``native_ok`` (it can express a tree) and triton where it is
    in ``triton_ok`` (ours can sit behind it). Anything else stays "native", whose checks then
    refuse the backend with the list of the ones that work."""
    if requested != "auto":
        return requested
    if backend in prefer_triton and backend in triton_ok:
        return "triton"
    if backend in native_ok:
        return "native"
    return "triton" if backend in triton_ok else "native"


ENV_MLA_PREFIX = "SGLANG_DDTREE_MLA_PREFIX"
MLA_PREFIX_CHOICES = ("triton", "flashmla", "auto")


def _prefix_setting(environ, env: str, choices: tuple, kernel: str) -> tuple:
    """(name, smallest batch) of a prefix setting ``auto`` (the default), ``triton``,
    ``<kernel>`` or ``<kernel>:B``."""
    raw = environ.get(env, "").strip().lower() or "auto"
    name, sep, arg = raw.partition(":")
    if name not in choices or (sep and (name != choices[1] or not arg.isdigit()
                                        or int(arg) < 1)):
        raise DDTreeConfigError(f"{env}: expected one of {', '.join(choices)} or "
                                f"{choices[1]}:B (B >= 1: {kernel} for verify batches of B "
                                f"requests and more), got {raw!r}")
    return name, int(arg) if sep else 1


def _mla_prefix_setting(environ) -> tuple:
    return _prefix_setting(environ, ENV_MLA_PREFIX, MLA_PREFIX_CHOICES, "FlashMLA")


def read_mla_prefix(environ=os.environ) -> str:
    """SGLANG_DDTREE_MLA_PREFIX: who attends the prefix in an MLA tree verify on DDTREE's Triton
    verify backend. ``auto`` (default): FlashMLA where it can serve the target (below), else
    our kernel, with the reason in the start-up log. ``triton``: our tree kernel alone, every
    arch and page size. ``flashmla``: FlashMLA's dense decode kernel over the prefix pages,
    our kernel for the tree keys, merged by log-sum-exp (``mla_prefix.py``; Hopper,
    ``--page-size 64``, bf16 KV cache, 576 / 512-dim latent rows, no logit cap; anything else
    stops start-up with the reason). ``flashmla:B``: the same for verify batches of B requests
    and more, our kernel alone below (each batch size is its own CUDA graph, so the choice is
    static per graph): see :func:`read_mla_prefix_min_batch`."""
    return _mla_prefix_setting(environ)[0]


def read_mla_prefix_min_batch(environ=os.environ) -> int:
    """The smallest verify batch whose prefix goes to FlashMLA under
    ``SGLANG_DDTREE_MLA_PREFIX=flashmla:B`` (1 for plain ``flashmla``). On the H200 (session
    33, ``bench_results/tree_verify_fa3_fmla_mla_h200_s33.json``, Kimi rank shapes) FlashMLA's
    prefix was 1.31-2.99x our kernel alone at batch 8 and 32 except batch 8 at 2,048 keys and
    budgets 8 / 16 (0.89-0.90x), while at batch 1 it was 1.62-2.41x at 65,536 keys but
    0.75-0.83x at 2,048: ``flashmla:8`` suits batched serving."""
    return _mla_prefix_setting(environ)[1]


ENV_MHA_PREFIX = "SGLANG_DDTREE_MHA_PREFIX"
MHA_PREFIX_CHOICES = ("triton", "fa3", "auto")


def _mha_prefix_setting(environ) -> tuple:
    return _prefix_setting(environ, ENV_MHA_PREFIX, MHA_PREFIX_CHOICES, "FA3")


def read_mha_prefix(environ=os.environ) -> str:
    """SGLANG_DDTREE_MHA_PREFIX: who attends the prefix in an MHA / GQA tree verify on DDTREE's
    Triton verify backend. ``auto`` (default): FA3 where it can serve the target (below), else
    our kernel, with the reason in the start-up log. ``triton``: our tree kernel alone, every
    arch. ``fa3``: FlashAttention 3's paged decode kernel (sgl_kernel's, non-causal) over the
    prefix, our kernel for the tree keys, merged by log-sum-exp in its epilogue
    (``mha_prefix.py``; Hopper, bf16 / fp16 KV cache, equal q / v head dims up to 256, no
    logit cap; anything else stops start-up with the reason). ``fa3:B``: the same for verify
    batches of B requests and more, our kernel alone below (static per CUDA graph). On the
    H200 (session 34, ``bench_results/tree_verify_fa3_prefix_mha_h200_s34.json``, Qwen3-8B
    shapes, issue 4's 36 points): 1.03-2.36x fa3's own tree verify at every point; against
    our kernel alone 0.78-0.87x at batch 1 with 2,048 keys, up to 2.1x at 65,536."""
    return _mha_prefix_setting(environ)[0]


def read_mha_prefix_min_batch(environ=os.environ) -> int:
    """The smallest verify batch whose prefix goes to FA3 under
    ``SGLANG_DDTREE_MHA_PREFIX=fa3:B`` (1 for plain ``fa3``)."""
    return _mha_prefix_setting(environ)[1]


ENV_DRAFT_ATTENTION = "SGLANG_DDTREE_DRAFT_ATTENTION"
DRAFT_ATTENTION_CHOICES = ("auto", "native", "triton")
# the drafter backends ``auto`` moves onto our kernel: SGLang's triton extend kernel, which walks
# the prefix serially with one program per (request, q head) (session 24, H200: our kernel 6.5x
# at 2k keys to 71x at 64k; the Kimi rank's draft stage at 32k prompt tokens 14.3 -> 0.90 ms)
DRAFT_ATTENTION_AUTO_BACKENDS = ("triton",)


def read_draft_attention(environ=os.environ) -> str:
    """SGLANG_DDTREE_DRAFT_ATTENTION: who runs the DFlash drafter's block attention (each block
    query attends the drafter's whole prefix KV and the block). ``auto`` (default): DDTREE's
    tree-attention kernel with the block's own mask (``draft_attention.install_draft``) where
    the drafter's SGLang backend is one of ``DRAFT_ATTENTION_AUTO_BACKENDS`` and the drafter is
    one the kernel can run, else the drafter's backend. ``triton``: our kernel whatever the
    drafter's backend (start-up fails, naming why, where it cannot). ``native``: the drafter's
    SGLang backend (``--speculative-draft-attention-backend``)."""
    raw = environ.get(ENV_DRAFT_ATTENTION, "").strip().lower() or "auto"
    if raw not in DRAFT_ATTENTION_CHOICES:
        raise DDTreeConfigError(f"{ENV_DRAFT_ATTENTION}: expected one of "
                                f"{', '.join(DRAFT_ATTENTION_CHOICES)}, got {raw!r}")
    return raw


ENV_MLA_SPLIT = "SGLANG_DDTREE_MLA_SPLIT"


def mla_split_enabled(environ=os.environ) -> bool:
    """SGLANG_DDTREE_MLA_SPLIT: ``1`` (default) hands a DeepSeek-family target's verify
    attention the query and latent parts as SGLang's split convention does (``mla_split``):
    behind backends such as triton, no ``[q_nope W_UK | q_pe]`` or ``[k_nope | k_pe]`` copy
    a layer. ``0``: the model's own convention for the backend (A/B runs)."""
    raw = environ.get(ENV_MLA_SPLIT, "").strip() or "1"
    if raw not in ("0", "1"):
        raise DDTreeConfigError(f"{ENV_MLA_SPLIT}: expected 0 or 1, got {raw!r}")
    return raw == "1"


def read_verify_backend(environ=os.environ) -> str:
    raw = environ.get(ENV_VERIFY_BACKEND)
    if raw is None or raw == "":
        return DEFAULT_VERIFY_BACKEND
    return validate_verify_backend(raw.strip().lower())


def oracle_enabled(environ=os.environ) -> bool:
    return environ.get(ENV_ORACLE, "") not in ("", "0")


def timers_skip(environ=os.environ) -> int:
    """SGLANG_DDTREE_TIMERS_SKIP: steps of each batch size left out of the stage times (default
    0): a batch size's first steps can carry one-time costs (a lazily captured graph, a kernel
    compiled on first use) that are not the step's per-step cost."""
    raw = environ.get(ENV_TIMERS + "_SKIP", "")
    return max(0, _parse_int(ENV_TIMERS + "_SKIP", raw)) if raw else 0


def timers_every(environ=os.environ) -> int:
    """SGLANG_DDTREE_TIMERS_EVERY: steps between two timer log lines (default 200)."""
    raw = environ.get(ENV_TIMERS + "_EVERY", "")
    return max(1, _parse_int(ENV_TIMERS + "_EVERY", raw)) if raw else 200


def timers_pad_us(environ=os.environ) -> int:
    """SGLANG_DDTREE_TIMERS_PAD_US (a diagnostic, ``gpu`` timers only; default 0 = off): after
    the tree stage, a GPU busy-wait of about this many microseconds, timed as its own stage
    ``pad``. While the GPU waits there, the host finishes issuing the verify, so the ``verify``
    stage that follows holds the target's forward alone, without the time the stream sat idle
    for the host (which the ``gpu`` timers charge to the stage the GPU waited in). The pad
    lengthens the step: for stage splits, not for TPOT."""
    raw = environ.get(ENV_TIMERS + "_PAD_US", "").strip()
    if not raw or raw == "0":
        return 0
    pad = _parse_int(ENV_TIMERS + "_PAD_US", raw)
    if pad < 0:
        raise DDTreeConfigError(f"{ENV_TIMERS}_PAD_US={raw!r}: want microseconds >= 0")
    if timers_mode(environ) != "gpu":
        raise DDTreeConfigError(
            f"{ENV_TIMERS}_PAD_US={raw} needs {ENV_TIMERS}=gpu (the pad splits the GPU stream's "
            f"stage times; it means nothing to host or synchronized timers): set "
            f"{ENV_TIMERS}=gpu or unset {ENV_TIMERS}_PAD_US")
    return pad


def timers_mode(environ=os.environ) -> str:
    """SGLANG_DDTREE_TIMERS: off (unset/0), ``cpu`` (host time per stage, no synchronization:
    what the step costs the scheduler thread), ``gpu`` (CUDA events at the stage boundaries,
    read once per log line: the time each stage holds the GPU's stream, no per-step sync),
    anything else: GPU-synchronized wall time (``sync``)."""
    raw = environ.get(ENV_TIMERS, "").strip().lower()
    if raw in ("", "0"):
        return "off"
    return raw if raw in ("cpu", "gpu") else "sync"


def sync_check_enabled(environ=os.environ) -> bool:
    """SGLANG_DDTREE_CHECK_SYNCS=1: run every decode step under torch's CUDA sync debug mode and
    log each call site that synchronized the host (debug only: the check itself slows the
    step)."""
    return environ.get(ENV_SYNC_CHECK, "") not in ("", "0")


def kv_move_fused(environ=os.environ) -> bool:
    """SGLANG_DDTREE_KV_MOVE: ``fused`` (default) relocates the accepted path's KV with
    kv_move.py's one launch for every layer and path column (a pool layout it does not know
    still gets SGLang's move); ``sglang`` forces SGLang's ``move_kv_cache`` per path column --
    for an MLA pool a gather and a scatter per layer per column, 1,830 captured kernels per step
    at Kimi's 61 layers. The fused mover served the lossless suite on the H200 (session 4)."""
    raw = environ.get(ENV_KV_MOVE, "fused").strip().lower() or "fused"
    if raw not in ("sglang", "fused"):
        raise DDTreeConfigError(f"{ENV_KV_MOVE}: expected sglang or fused, got {raw!r}")
    return raw == "fused"


def commit_fused(environ=os.environ) -> bool:
    """SGLANG_DDTREE_COMMIT: ``fused`` (default) does the accept walk and all of the commit
    bookkeeping in one Triton launch (``triton_kernels/walk_commit.py``; served losslessly on the
    H200 in session 15, commit stage 0.02-0.055 ms per step on the GPU's stream against
    0.086-0.14 ms for the op path); ``ops`` walks the tree with SGLang's ``verify_tree_greedy``
    and does the bookkeeping in PyTorch ops (about forty kernels in the accept/commit graph). If
    the fused kernel cannot run (no Triton backend for the device, a compile error), the worker
    logs why and serves the op path."""
    raw = environ.get(ENV_COMMIT, "fused").strip().lower() or "fused"
    if raw not in ("ops", "fused"):
        raise DDTreeConfigError(f"{ENV_COMMIT}: expected ops or fused, got {raw!r}")
    return raw == "fused"


def rank_check_interval(environ=os.environ) -> int:
    """Steps between TP rank-consistency checks (0: off)."""
    raw = environ.get(ENV_RANK_CHECK, "")
    return _parse_int(ENV_RANK_CHECK, raw) if raw else 0


def verify_memory_bytes(max_bs: int, width: int, vocab: int, context_len: int) -> dict:
    """What the verify width costs in memory at the largest captured batch (an estimate to log
    at start-up; SGLang allocates these, sized by the width): the fp32 logits of every tree node
    (max_bs x width x vocab x 4 B) and the bound of the FULL_MASK custom mask the tree writes for
    the target's own backend (max_bs x width x (context + width) bytes)."""
    return {"verify_logits": int(max_bs) * width * vocab * 4,
            "full_mask_bound": int(max_bs) * width * (context_len + width)}


ENV_DEEPEP_LL_TOKENS = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"  # SGLang's, default 128


def deepep_verify_tokens_error(a2a_backend, deepep_mode, max_bs: int, width: int,
                               environ=os.environ) -> Optional[str]:
    """The start-up refusal for DeepEP low-latency dispatch that a verify forward would overflow
    (None: fine). Low-latency dispatch (``--deepep-mode low_latency``, and ``auto`` outside
    prefill) sends at most SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK tokens per rank (default
    128, at most 1024); a tree verify sends batch x (budget + 1), so the default already fails
    at budget 32 with 4 requests -- mid-serving, in DeepEP, unless refused here."""
    if a2a_backend != "deepep" or str(deepep_mode) not in ("low_latency", "auto"):
        return None
    limit = _parse_int(ENV_DEEPEP_LL_TOKENS, environ.get(ENV_DEEPEP_LL_TOKENS, "128"))
    need = int(max_bs) * int(width)
    if need <= limit:
        return None
    fix = (f"set {ENV_DEEPEP_LL_TOKENS}={need} (DeepEP allows up to 1024), or "
           if need <= 1024 else "")
    return (f"DDTREE: DeepEP low-latency dispatch takes at most {limit} tokens per rank "
            f"({ENV_DEEPEP_LL_TOKENS}), but a verify of {max_bs} requests x {width} tree tokens "
            f"(budget + 1) sends {need}. Fix: {fix}lower --max-running-requests to "
            f"{max(limit // width, 1)} or --speculative-ddtree-budget to {max(limit // max_bs - 1, 1)}"
            f", or use --deepep-mode normal.")
