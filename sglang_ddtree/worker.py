"""The DDTREE spec-v2 worker: draft, build tree, verify, accept, commit -- one GPU step.

Reuses SGLang's DFlash worker for what is identical (drafter loading, prefill, drafter-KV
materialisation from target hidden states, idle batches) and replaces the decode step. Nothing
in the step reads a GPU value on the host: the tree is built with fixed shapes, the accept walk
is SGLang's ``verify_tree_greedy`` kernel, and new lengths reach the scheduler via
``on_publish`` as device tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import time

import torch

from . import config as cfg
from .budget_stats import BudgetAcceptStats
from .draft_topk import DraftTopKHead
from .sampling import (checked_row_draw, host_max_top_k, make_flashinfer_row_draw,
                       sample_per_node)
from .step_graph import AcceptCommitGraphs
from .step_prep import StepPrep
from .step_timers import StepTimers
from .sync_check import SyncCheck
from .tree_graph import TreeBuildGraphs
from .verify import full_mask_numel_bound
from .verify_backend import attach_tree_mask

logger = logging.getLogger(__name__)

_WORKER_CLASS = None


def get_worker_class():
    """Build the worker class once per process against the installed SGLang."""
    global _WORKER_CLASS
    if _WORKER_CLASS is None:
        from . import compat

        _WORKER_CLASS = _make_worker_class(compat.load())
    return _WORKER_CLASS


def _make_worker_class(sgl):
    class DDTreeWorker(sgl.DFlashWorkerV2):
        def __init__(self, *args, **kwargs):
            # the constructor's parameters differ between SGLang versions: bind by name
            bound = inspect.signature(sgl.DFlashWorkerV2.__init__).bind(self, *args, **kwargs)
            server_args = bound.arguments["server_args"]
            self._check_target(server_args, bound.arguments["target_worker"])
            super().__init__(*args, **kwargs)
            sgl.check_drafter_variant(self)
            draft_cfg = sgl.parse_dflash_draft_config(
                draft_hf_config=self.draft_model_runner.model_config.hf_config
            )
            block = draft_cfg.resolve_block_size(default=None)
            if block is None:
                raise cfg.DDTreeConfigError("DDTREE: the drafter config has no block_size.")
            vocab = int(self.model_runner.model_config.vocab_size)
            self.tree_cfg = cfg.resolve(int(block), vocab)
            num_draft_tokens = sgl.resolved_arg(server_args, "speculative_num_draft_tokens")
            if self.tree_cfg.num_draft_tokens != int(num_draft_tokens):
                raise cfg.DDTreeConfigError(
                    "DDTREE: speculative_num_draft_tokens="
                    f"{num_draft_tokens} disagrees with budget "
                    f"{self.tree_cfg.budget} / block {block}; was {cfg.ENV_BUDGET} changed "
                    "after startup?"
                )
            self._check_deepep(server_args)
            # DFlash's constructor sized its block state from speculative_num_draft_tokens
            # (our wider max(budget+1, block)); the drafter block is the config's.
            self.block_size = int(block)
            self.speculative_num_draft_tokens = int(block)
            sgl.set_draft_block_size(self, int(block))
            self._block_pos_offsets = sgl.build_block_pos_offsets(length=int(block),
                                                                  device=self.device)
            self._draft_block_spec_info = sgl.make_draft_block_spec_info(
                draft_token_num=int(block), device=self.device
            )
            self._draft_head = None
            self._eager_head = None
            # the step's KV slots, drafter block ids and positions: one launch on CUDA
            self._step_prep = StepPrep(self.tree_cfg.num_draft_tokens, int(block),
                                       int(self._mask_token_id), self.device)
            pool = getattr(self.model_runner, "req_to_token_pool", None)
            if pool is not None and getattr(pool, "req_to_token", None) is not None:
                self._step_prep.self_check(pool.req_to_token)  # start-up only (it syncs)
            # one tree builder per budget this server uses (one unless --...-budget auto); a
            # smaller budget reads the first K' = min(K, budget) columns of the sorted top-K
            self._tree_builders = {
                b: TreeBuildGraphs(
                    b, self.tree_cfg.max_depth, min(self.tree_cfg.topk, b), self.device,
                    builder=_tree_builder(self.tree_cfg, self.device, budget=b),
                    use_graphs=sgl.decode_graphs_enabled(server_args),
                )
                for b in self.tree_cfg.budgets
            }
            self._tree_builder = self._tree_builders[self.tree_cfg.budget]
            self._verify_states = {}  # budget -> (attention backend, verify graph runner)
            self._graphs_enabled = sgl.decode_graphs_enabled(server_args)
            timers_mode = cfg.timers_mode()
            # with the timers on, also count the accept length of every smaller budget
            self._budget_stats = (BudgetAcceptStats(self.tree_cfg.budget, self.device)
                                  if timers_mode != "off" and self.tree_cfg.auto_table is None
                                  else None)
            self._accept_commit = AcceptCommitGraphs(
                int(block), sgl.tree_greedy_walk,
                use_graphs=sgl.decode_graphs_enabled(server_args), device=self.device,
                stats=self._budget_stats, fused=cfg.commit_fused())
            self._tree_verify = None  # the triton verify backend, set in init_attention_backends
            self._oracle = None
            if cfg.oracle_enabled():
                from .oracle import OracleDraft

                self._oracle = OracleDraft.from_env()
            self._timers = StepTimers(mode=timers_mode, every=cfg.timers_every(),
                                      skip=cfg.timers_skip(), pad_us=cfg.timers_pad_us())
            self._sync_check = SyncCheck(cfg.sync_check_enabled(), every=cfg.timers_every())
            # T > 0 nodes draw as this server's Sampler does: with flashinfer, its own kernels
            self._row_draw = None
            if sgl.sampling_backend() == "flashinfer":
                self._row_draw = checked_row_draw(
                    make_flashinfer_row_draw(sgl.sampler_module()), self.device)
            kv_move = "fused" if cfg.kv_move_fused() else "sglang"  # a bad value fails here
            tp = sgl.get_tp_group()
            self._tp_group = tp if tp.world_size > 1 else None
            # SGLANG_DDTREE_AUTO_MODE=online: the budget from measured throughput
            self._online = None
            if self.tree_cfg.auto_table is not None and cfg.read_auto_mode() == "online":
                msg = cfg.online_auto_parallel_error(
                    bool(sgl.resolved_arg(server_args, "enable_dp_attention")),
                    int(sgl.resolved_arg(server_args, "pp_size") or 1))
                if msg:
                    raise cfg.DDTreeConfigError(msg)
                from .auto_online import OnlineBudgetController

                agree = None
                if self._tp_group is not None:  # every rank takes rank 0's choice
                    agree = functools.partial(self._tp_group.broadcast_object, src=0)
                self._online = OnlineBudgetController(self.tree_cfg.budgets, agree=agree)
            self._rank_check = RankConsistencyCheck(self._tp_group, cfg.rank_check_interval())
            if sgl.tp_rank(self) == 0:
                logger.info(
                    "DDTREE worker ready: budget=%d topk=%d block=%d verify_width=%d "
                    "kv_move=%s oracle=%s", self.tree_cfg.budget, self.tree_cfg.topk, block,
                    self.tree_cfg.verify_width, kv_move, self._oracle is not None,
                )
                self._log_verify_memory(vocab)

        def _check_deepep(self, server_args):
            """Refuse at start-up a DeepEP low-latency setup the verify forward would overflow
            (it fails inside DeepEP mid-serving otherwise)."""
            a2a = sgl.resolved_arg(server_args, "moe_a2a_backend")
            if a2a != "deepep":
                return
            pool = getattr(self.model_runner, "req_to_token_pool", None)
            max_bs = int(getattr(pool, "size", 0)
                         or sgl.resolved_arg(server_args, "max_running_requests") or 0)
            mode = sgl.resolved_arg(server_args, "deepep_mode")
            msg = cfg.deepep_verify_tokens_error(a2a, getattr(mode, "value", mode), max_bs,
                                                 self.tree_cfg.verify_width)
            if msg:
                raise cfg.DDTreeConfigError(msg)

        def _log_verify_memory(self, vocab):
            """The memory the tree's verify width costs at the largest captured batch: a big
            budget x batch x vocabulary is where a server runs out (Kimi: vocab 163840, width
            65, batch 48 -> ~2 GB of verify logits)."""
            try:
                max_bs = sgl.max_capture_bs()
                context = int(self.model_runner.model_config.context_len)
            except (AttributeError, RuntimeError, ValueError) as e:  # no captured batch sizes
                logger.info("DDTREE: no verify memory estimate (%s)", e)
                return
            est = cfg.verify_memory_bytes(max_bs, self.tree_cfg.verify_width, vocab, context)
            logger.info(
                "DDTREE verify width %d at batch %d: ~%.2f GiB of fp32 verify logits, FULL_MASK "
                "up to %.2f GiB (context %d); lower --speculative-ddtree-budget or "
                "--cuda-graph-max-bs if memory is short", self.tree_cfg.verify_width, max_bs,
                est["verify_logits"] / 2**30, est["full_mask_bound"] / 2**30, context)

        @staticmethod
        def _check_target(server_args, target_worker):
            from .plugin import check_hooks_applied

            missing = check_hooks_applied()
            if missing:
                raise RuntimeError(
                    "DDTREE: SGLang's HookRegistry did not apply "
                    f"{missing}; the verify CUDA graph would run without the tree mask. See the "
                    "log lines above from sglang.srt.plugins.hook_registry."
                )
            mr = target_worker.model_runner
            if sgl.is_hybrid_linear_target(mr.model_config):
                raise cfg.DDTreeConfigError(
                    "DDTREE does not support mamba / hybrid-linear-attention targets (their "
                    "recurrent state cannot branch over a tree). Use DFLASH for this model."
                )
            if sgl.resolved_arg(server_args, "speculative_draft_window_size") is not None:
                raise cfg.DDTreeConfigError(
                    "DDTREE does not support --speculative-draft-window-size yet; remove it."
                )

        def init_attention_backends(self):
            super().init_attention_backends()
            sgl.check_kv_layout(self)
            # the drafter's backend exists now; its CUDA graphs are captured after this
            from .draft_attention import choose_draft_attention

            self._draft_attention = choose_draft_attention(
                cfg.read_draft_attention(), self.draft_model_runner, self.block_size, sgl)
            # the target's backends exist from here on (SGLang builds them after the spec worker)
            mr = self.model_runner
            arch = "mla" if sgl.is_mla(mr.model_config) else "mha"
            backend = sgl.attention_backend_name(mr)
            requested = cfg.read_verify_backend()
            cfg.mla_split_enabled()  # a bad SGLANG_DDTREE_MLA_SPLIT stops start-up on any target
            verify = cfg.resolve_verify_backend(requested, backend, cfg.TREE_VERIFY_BACKENDS[arch],
                                                cfg.TRITON_VERIFY_TARGET_BACKENDS[arch],
                                                cfg.AUTO_PREFERS_TRITON_VERIFY[arch])
            self._tree_verify = None
            # a prefix kernel named explicitly runs inside our Triton verify backend only
            for env, name, setting in ((cfg.ENV_MLA_PREFIX, "flashmla", cfg.read_mla_prefix()),
                                       (cfg.ENV_MHA_PREFIX, "fa3", cfg.read_mha_prefix())):
                if setting == name and verify != "triton":
                    raise cfg.DDTreeConfigError(
                        f"DDTREE: {env}={name} runs inside DDTREE's Triton verify backend, but "
                        f"this target verifies on '{backend}' (--speculative-ddtree-verify-"
                        f"backend {requested}). Add --speculative-ddtree-verify-backend "
                        f"triton, or unset {env}.")
            if verify == "triton" and requested == "auto":  # one line per rank, at start-up
                if backend in cfg.TREE_VERIFY_BACKENDS[arch]:
                    logger.info("DDTREE: verifying with DDTREE's Triton tree-attention kernels, "
                                "faster than the target's attention backend '%s' on %s targets "
                                "(prefill and decode stay on '%s'; --speculative-ddtree-verify-"
                                "backend native verifies on '%s' too)", backend, arch.upper(),
                                backend, backend)
                else:
                    logger.info("DDTREE: the target's attention backend '%s' cannot express a "
                                "tree; verifying with DDTREE's Triton tree-attention kernels "
                                "(prefill and decode stay on '%s')", backend, backend)
            if verify == "triton":
                allowed = cfg.TRITON_VERIFY_TARGET_BACKENDS[arch]
                if backend not in allowed:
                    raise cfg.DDTreeConfigError(
                        f"DDTREE: --speculative-ddtree-verify-backend triton does not run "
                        f"behind the target's attention backend '{backend}' ({arch.upper()} "
                        f"model); supported: {', '.join(allowed)}."
                    )
                from .verify_backend import install

                # before SGLang captures the target's verify graphs (init_cuda_graphs)
                self._tree_verify = install(mr, self.tree_cfg.verify_width, sgl)
                return
            allowed = cfg.TREE_VERIFY_BACKENDS[arch]
            if backend not in allowed:
                hint = (" Or keep it and add --speculative-ddtree-verify-backend triton."
                        if backend in cfg.TRITON_VERIFY_TARGET_BACKENDS[arch] else "")
                raise cfg.DDTreeConfigError(
                    f"DDTREE: the target's attention backend '{backend}' cannot verify a tree "
                    f"for an {arch.upper()} model. Use --attention-backend "
                    f"{' or '.join(allowed)}.{hint}"
                )

        def init_cuda_graphs(self):
            super().init_cuda_graphs()
            if self.tree_cfg.auto_table is not None:
                self._build_verify_states()
            self._prewarm_step_graphs()

        def _prewarm_step_graphs(self):
            """Capture the step's own graphs (tree build where it is a graph, accept/commit) for
            every batch size up to the largest CUDA-graph batch size, at start-up. Captured
            lazily instead, each new batch size stalled its first step by 50-400 ms on the H200
            (bench_e2e stage timers, session 5), which a serving latency should never see."""
            if not self._graphs_enabled:
                return
            try:
                max_bs = min(sgl.max_capture_bs(), sgl.max_running_requests(self))
            except (AttributeError, RuntimeError, ValueError) as e:  # no captured batch sizes
                logger.info("DDTREE: step graphs not prewarmed (%s); captured on first use", e)
                return
            t0 = time.perf_counter()
            pool = self.model_runner.token_to_kv_pool
            captured = 0
            for bs in range(1, max_bs + 1):
                # online auto can pick any budget at any batch size; otherwise one per size
                budgets = (self.tree_cfg.budgets if self._online is not None
                           else (self.tree_cfg.budget_for(bs),))
                # the step-prep buffers of this batch size: the graph reads a step's slots and
                # prefix lengths where that kernel wrote them (two copies fewer per step)
                prep = self._step_prep.buffers(bs)
                in_place = {} if prep is None else {"slots": prep[0], "prefix": prep[3]}
                for b in budgets:
                    tree = self._tree_builders[b].static_tree(bs)
                    if tree is not None:
                        captured += self._accept_commit.prewarm(
                            tree, self.tree_cfg.num_draft_tokens, pool, **in_place)
            if torch.device(self.device).type == "cuda":
                torch.cuda.current_stream().synchronize()  # start-up only
            if sgl.tp_rank(self) == 0:
                logger.info("DDTREE: step graphs for batch sizes 1..%d captured in %.1f s (%d "
                            "accept/commit graphs, commit path: %s)", max_bs,
                            time.perf_counter() - t0, captured,
                            "fused" if self._accept_commit.fused else "ops")

        def _build_verify_states(self):
            """--speculative-ddtree-budget auto: the target's verify graphs exist for the widest
            tree (SGLang captured them); build an attention backend and verify graphs for every
            smaller budget of the table (SGLang's adaptive-EAGLE construction)."""
            mr = self.model_runner
            largest = self.tree_cfg.budget
            self._verify_states = {largest: (mr.attn_backend, mr.decode_cuda_graph_runner)}
            with_graphs = self._graphs_enabled and mr.decode_cuda_graph_runner is not None
            wrap_backend = None
            if self._tree_verify is not None:  # each width's backend behind its own wrapper
                from .verify_backend import wrap as wrap_backend
            for b in self.tree_cfg.budgets[1:]:
                t0 = time.perf_counter()
                wrap = None if wrap_backend is None else functools.partial(
                    wrap_backend, model_runner=mr, num_tree_tokens=b + 1, sgl=sgl)
                try:
                    self._verify_states[b] = sgl.build_verify_state(mr, b + 1, with_graphs,
                                                                    wrap=wrap)
                except Exception as e:
                    mr.attn_backend, mr.decode_cuda_graph_runner = self._verify_states[largest]
                    raise cfg.DDTreeConfigError(
                        f"DDTREE --speculative-ddtree-budget auto: building the verify backend "
                        f"and CUDA graphs for budget {b} failed ({type(e).__name__}: {e}). They "
                        "are built after SGLang sized its KV pool: leave memory for them (lower "
                        "--mem-fraction-static), shorten SGLANG_DDTREE_AUTO_TABLE, or use a fixed "
                        "budget.") from e
                if sgl.tp_rank(self) == 0:
                    logger.info("DDTREE auto budget: verify state for budget %d (width %d) built "
                                "in %.1f s (graphs: %s)", b, b + 1, time.perf_counter() - t0,
                                with_graphs)
            mr.attn_backend, mr.decode_cuda_graph_runner = self._verify_states[largest]

        # --- drafter head (folded into the drafter's CUDA graph) ---------------------------
        def _maybe_build_draft_sampler(self):
            self._draft_head = self._build_head(max_bs=sgl.max_capture_bs())
            return self._draft_head

        def _build_head(self, max_bs):
            lm_head = self.model_runner.model.lm_head
            tp_group = sgl.get_tp_group()
            shard = getattr(lm_head, "shard_indices", None)
            if shard is None:
                if tp_group.world_size != 1:
                    raise RuntimeError("DDTREE: tp>1 needs a vocab-parallel lm_head with shards.")
                num_org, start = int(lm_head.weight.shape[0]), 0
            else:
                if int(shard.num_added_elements) != 0:
                    raise RuntimeError("DDTREE: lm_head with added vocab is not supported.")
                num_org, start = int(shard.num_org_elements), int(shard.org_vocab_start_index)
            if not torch.is_floating_point(lm_head.weight):
                raise RuntimeError("DDTREE: quantized lm_head is not supported by the draft head.")
            return DraftTopKHead(
                weight=lm_head.weight, block_size=self.block_size, topk=self.tree_cfg.topk,
                num_org=num_org, org_vocab_start=start, max_bs=max_bs,
                tp_group=tp_group if tp_group.world_size > 1 else None,
            )

        # --- one decode step ------------------------------------------------------------------
        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None,
                                     **kwargs):
            if (batch.forward_mode.is_extend() or batch.is_extend_in_batch
                    or batch.forward_mode.is_idle() or batch.spec_info is None):
                if self._online is not None:
                    self._online.other_forward()  # not a decode step's interval
                return super().forward_batch_generation(batch, on_publish, grammar_barrier,
                                                        **kwargs)
            if not self._sync_check.enabled:  # the default: no context manager per step
                return self._decode_step(batch, on_publish, grammar_barrier)
            with self._sync_check.step():  # SGLANG_DDTREE_CHECK_SYNCS=1
                return self._decode_step(batch, on_publish, grammar_barrier)

        def _decode_step(self, batch, on_publish, grammar_barrier=None):
            t = self._timers
            t.start()
            if batch.seq_lens.is_cuda:
                batch.seq_lens.record_stream(torch.cuda.current_stream())
            bs = len(batch.seq_lens)
            tc = self.tree_cfg
            budget = self._budget_for(batch, bs)  # host-side: fixed, table or online
            n, block = budget + 1, self.block_size
            prefix = batch.seq_lens
            draft_input = batch.spec_info
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            # the KV slots SGLang reserves for the widest tree (tc.num_draft_tokens positions),
            # the drafter block's ids and positions: one launch
            slots, block_ids, draft_pos, prefix64 = self._step_prep(
                req_to_token, batch.req_pool_indices, prefix, draft_input.bonus_tokens)
            seq_bound = self._host_seq_bound(batch, draft_input)  # drafter and verify share it

            # 1) draft: one block [root, MASK x (B-1)] through the drafter
            topk_logp, topk_ids = self._draft(batch, prefix, block_ids, draft_pos,
                                              slots[:, :block], bs, seq_bound)
            if self._oracle is not None:
                self._oracle.plant(batch, topk_logp, topk_ids)
            t.mark("draft")

            # 2) tree: the budget best nodes, prefix-closed, static shapes
            if budget != tc.budget:  # auto: a smaller tree reads the first K' candidates
                k = self._tree_builders[budget].topk
                topk_logp, topk_ids = topk_logp[:, :, :k], topk_ids[:, :, :k]
            # with the fused kernel, one launch writes the tree and its verify layout: the
            # positions and, for the target's own backend, the FULL_MASK it reads
            mask = None
            if self._tree_verify is None:
                mask = self._mask_buffer(full_mask_numel_bound(n, seq_bound[1], bs))
            tree, positions = self._tree_builders[budget].build_with_layout(
                draft_input.bonus_tokens.to(torch.int64), topk_logp, topk_ids, prefix, mask)
            # grammar-constrained requests: the tree's links and tokens start their copy to the
            # host before the verify launch, as DFLASH's chain does (SGLang's GrammarTree)
            grammar_tree = None
            if batch.has_grammar:
                grammar_tree = sgl.GrammarTree.from_device(
                    tree.retrive_next_token, tree.retrive_next_sibling, tree.tokens)
            t.mark("tree")
            t.pad()  # SGLANG_DDTREE_TIMERS_PAD_US: a diagnostic busy-wait, else nothing

            # 3) verify all N tokens in one target forward with the ancestor mask
            verify_input = sgl.DFlashVerifyInput(
                draft_token=tree.tokens.reshape(-1),
                positions=positions.reshape(-1),
                draft_token_num=n,
                custom_mask=mask,
                capture_hidden_mode=sgl.CaptureHiddenMode.FULL,
            )
            if self._tree_verify is not None:  # our Triton kernels read the [bs, N, N] tree
                attach_tree_mask(verify_input, tree.ancestor_mask)
            batch.out_cache_loc = slots[:, :n].reshape(-1)
            backup = (batch.seq_lens_cpu, batch.seq_lens_sum)
            if seq_bound[0] is not None:
                batch.seq_lens_cpu, batch.seq_lens_sum = seq_bound
            with self._verify_state(budget):  # auto: this width's backend and verify graphs
                try:
                    verify_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
                finally:
                    batch.seq_lens_cpu, batch.seq_lens_sum = backup
                target_out = self.target_worker.forward_batch_generation(
                    batch=None, forward_batch=verify_batch, is_verify=True,
                    skip_attn_backend_init=True,
                )
            logits_output = target_out.logits_output
            t.mark("verify")

            # 4) accept: the target's token at every node, then walk the tree
            logits = sgl.verify_logits(self, logits_output)  # [bs * N, V]
            sampling_info = batch.sampling_info
            grammar_mask = None
            if grammar_tree is not None:
                # host work while the target verifies: advance each request's grammar over its
                # last committed tokens (the scheduler's barrier), then walk the tree with it: a
                # node the grammar admits gets the bitmask of the tokens allowed after its path
                grammar_mask = sgl.build_grammar_vocab_mask(
                    reqs=batch.reqs, tree=grammar_tree, sampling_info=sampling_info,
                    device=logits.device, barrier=grammar_barrier)
            if sampling_info is not None:
                sgl.apply_verify_logits_adjustments(logits, sampling_info, n)
            if grammar_mask is not None:
                # every node's target token, greedy or sampled, is one its path's grammar allows
                grammar_mask.apply(logits)
            if sampling_info is None or sampling_info.is_all_greedy:
                # straight into the accept/commit graph's input buffer when it has one
                buf = self._accept_commit.predicted_buffer(
                    tree, slots, prefix64, self.model_runner.token_to_kv_pool)
                if buf is not None:
                    predicted = torch.argmax(logits, dim=-1, out=buf.view(-1)).view(bs, n)
                else:
                    predicted = torch.argmax(logits, dim=-1).view(bs, n)
            else:
                predicted = sample_per_node(
                    logits, sampling_info, n, positions=positions.reshape(-1),
                    seeded_fns=(sgl.multinomial_with_seed, sgl.seeded_filtered_sampler),
                    request_seeds=self._request_seeds(batch),
                    max_top_k=host_max_top_k(batch.reqs, logits.shape[-1]),
                    row_draw=self._row_draw,
                ).view(bs, n)
            if self._tp_group is not None:
                if sampling_info is not None and not sampling_info.is_all_greedy:
                    # sample once, on rank 0: every rank must walk the same path
                    self._tp_group.broadcast(predicted, src=0)
                self._rank_check.step(tree, predicted)
            t.mark("accept")

            # 5) walk the tree, commit: accepted KV contiguous (one graph replay per step),
            # publish lengths, drafter KV from the accepted nodes' target hidden states
            # prefix64: the step-prep snapshot of the lengths, read in place by the graph
            done = self._accept_commit(tree, predicted, slots, prefix64,
                                       self.model_runner.token_to_kv_pool)
            step = done.step
            if getattr(batch, "return_logprob", False):  # admitted only where SGLang has them
                # emitted token j = the target's token at accepted node j, from that node's row
                sgl.spec_logprobs(batch, logits_output, predicted.reshape(-1),
                                  done.hidden_rows.view(bs, block))
            t.mark("commit")
            if on_publish is not None:  # SGLang's scheduler callback (DFLASH calls it too)
                on_publish(step.new_seq_lens)
            t.mark("publish")
            # DFlash's drafter KV append (the same call DFLASH makes every step)
            hidden = logits_output.hidden_states.index_select(0, done.hidden_rows)
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hidden,
                cache_loc=slots[:, :block].reshape(-1),
                cache_loc_2d=slots[:, :block],
                positions=draft_pos.reshape(-1),
                commit_lens=step.commit_lens,
            )
            logits_output.hidden_states = None
            t.mark("draft_kv")
            t.finish(bs)
            if self._budget_stats is not None and t.steps % t.every == 0:
                by_budget = self._budget_stats.report()  # values of the previous report: no sync
                if by_budget:
                    logger.info("DDTREE accept length by budget (this server's trees): %s",
                                json.dumps(by_budget))

            return sgl.GenerationBatchResult(
                logits_output=logits_output,
                next_token_ids=step.out_tokens.reshape(-1),
                accept_lens=step.commit_lens,
                can_run_cuda_graph=target_out.can_run_cuda_graph,
                next_draft_input=sgl.make_draft_input_v2(
                    bonus_tokens=step.bonus, new_seq_lens=step.new_seq_lens
                ),
                speculative_num_draft_tokens=block,
                new_seq_lens=step.new_seq_lens,
            )

        def _budget_for(self, batch, bs):
            """This step's budget: the fixed one, the auto table's for ``bs``, or (online
            mode) the controller's, fed with the time and the tokens the scheduler emitted."""
            if self._online is None:
                return self.tree_cfg.budget_for(bs)
            o = self._online
            budget = o.step(bs, o.emitted_since_last(batch.reqs), time.perf_counter())
            if o.steps and o.steps % self._timers.every == 0 and sgl.tp_rank(self) == 0:
                logger.info("DDTREE online auto budget (by batch-size bucket): %s",
                            json.dumps(o.report()))
            return budget

        @contextlib.contextmanager
        def _verify_state(self, budget):
            """With --speculative-ddtree-budget auto: the target's attention backend and verify
            graph runner of ``budget``'s width for the verify forward, the widest tree's after."""
            state = self._verify_states.get(budget)
            if state is None:  # a fixed budget (or the widest tree): SGLang's own state
                yield
                return
            mr = self.model_runner
            main = (mr.attn_backend, mr.decode_cuda_graph_runner)
            mr.attn_backend, mr.decode_cuda_graph_runner = state
            try:
                yield
            finally:
                mr.attn_backend, mr.decode_cuda_graph_runner = main

        def _request_seeds(self, batch):
            """[bs] int64 per-request ``sampling_seed`` (-1: none), copied without a sync."""
            seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
            if all(s is None for s in seeds):
                return None
            host = torch.tensor([-1 if s is None else int(s) for s in seeds], dtype=torch.int64,
                                pin_memory=True)
            return host.to(self.device, non_blocking=True)

        def _host_seq_bound(self, batch, draft_input):
            """(host seq_lens upper bound, its sum): the CPU view lags the GPU by one step."""
            if batch.seq_lens_cpu is not None:
                bound = batch.seq_lens_cpu + self.block_size
                return bound, int(bound.sum())
            reserved, reserved_sum = sgl.reserved_kv_lens(draft_input)
            if reserved is not None:
                return reserved, int(reserved_sum)
            return None, int(len(batch.seq_lens) * self.model_runner.model_config.context_len)

        def _mask_buffer(self, numel):
            buf = getattr(self, "_mask_buf", None)
            if buf is None or buf.numel() < numel:
                # grows to the largest step seen; reused afterwards (no per-step allocation)
                self._mask_buf = buf = torch.empty(max(numel, 1 << 20), dtype=torch.bool,
                                                   device=self.device)
            return buf[:numel]

        def _draft(self, batch, prefix, block_ids, positions, block_slots, bs, seq_bound=None):
            """Run the drafter on the block ``block_ids`` ([bs, B]: root, MASK x (B-1)) at
            ``positions`` ([bs, B]), both from the step's prep; return per-depth top-K
            log-probs / ids. ``seq_bound``: the step's ``_host_seq_bound`` (computed here if not
            given)."""
            block = self.block_size
            embed = sgl.draft_block_embeddings(self, block_ids)
            if seq_bound is None:
                seq_bound = self._host_seq_bound(batch, batch.spec_info)
            seq_lens_cpu, seq_sum = seq_bound
            if seq_lens_cpu is None:
                seq_lens_cpu = prefix.cpu()  # only without any host length: not in overlap mode
            draft_out = sgl.run_draft_block(
                self, batch, block_size=block,
                forward_mode=sgl.ForwardMode.TARGET_VERIFY,
                batch_size=bs,
                input_ids=block_ids.reshape(-1),
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix,
                out_cache_loc=block_slots.reshape(-1),
                seq_lens_sum=seq_sum,
                seq_lens_cpu=seq_lens_cpu.to(torch.int32),
                positions=positions.reshape(-1),
                input_embeds=embed.view(-1, embed.shape[-1]),
                spec_algorithm=sgl.SpeculativeAlgorithm.DFLASH,  # the drafter runs DFLASH's block
                spec_info=self._draft_block_spec_info,
                capture_hidden_mode=sgl.CaptureHiddenMode.NULL,
            )
            if self._draft_head is not None and draft_out.can_run_graph:
                return self._draft_head.read(bs)
            if self._eager_head is None:
                self._eager_head = self._build_head(max_bs=sgl.max_running_requests(self))
            self._eager_head(draft_out.logits_output.hidden_states)
            return self._eager_head.read(bs)

    DDTreeWorker.__qualname__ = DDTreeWorker.__name__ = "DDTreeWorker"
    return DDTreeWorker


def _tree_builder(tc, device, budget=None):
    """The fused CUDA kernel when it builds and matches ``build_tree`` on this step's shapes,
    else ``build_tree`` (SGLANG_DDTREE_TREE_BACKEND=auto|cuda|torch; see tree_backend.py)."""
    from .tree_backend import verified_tree_builder

    budget = tc.budget if budget is None else budget
    return verified_tree_builder(budget, tc.max_depth, min(tc.topk, budget), device)


class RankConsistencyCheck:
    """Debug switch (SGLANG_DDTREE_CHECK_RANKS=N): every N steps, all TP ranks compare a hash of
    their tree and target tokens and raise if any differs. Off by default: it syncs the host."""

    def __init__(self, tp_group, interval: int):
        self.tp_group, self.interval, self.steps = tp_group, interval, 0

    def step(self, tree, predicted):
        if self.tp_group is None or self.interval <= 0:
            return
        self.steps += 1
        if self.steps % self.interval:
            return
        h = tree_hash(tree, predicted).view(1)
        gathered = torch.empty(self.tp_group.world_size, dtype=h.dtype, device=h.device)
        self.tp_group.all_gather_into_tensor(gathered, h)
        values = gathered.tolist()  # host sync: debug mode only
        if len(set(values)) != 1:
            raise RuntimeError(
                f"DDTREE rank consistency check failed at step {self.steps}: per-rank tree "
                f"hashes {values}. Ranks built different trees or saw different target tokens."
            )


def tree_hash(tree, predicted) -> torch.Tensor:
    """A [] int64 fingerprint of (tree tokens, parents, target tokens), on device."""
    n = tree.tokens.shape[1]
    w = torch.arange(1, n + 1, device=tree.tokens.device, dtype=torch.int64) * 1000003
    parts = (tree.tokens * w, (tree.parents + 2) * (w + 7), predicted * (w + 13))
    return sum(p.sum() for p in parts) % (2**61 - 1)
