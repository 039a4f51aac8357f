"""The compat layer against the installed SGLang's real API (CPU; runners and groups mocked).

- every supported version has a compat module, and all of them expose the same names;
- the DDTREE worker class builds against the installed ``DFlashWorkerV2`` and its constructor runs
  through SGLang's own ``DFlashWorkerV2.__init__`` (drafter bundle, parallel context, KV pools
  mocked: nothing here needs a GPU or a model);
- the tree-verify kernel resolves to the version's entry point, and ``tree_greedy_walk`` turns
  that kernel's outputs into the accepted path exactly like the pure-Python accept walk.
"""

import ast
import contextlib
import inspect
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang_ddtree import compat  # noqa: E402
from sglang_ddtree import config as cfg  # noqa: E402

VERSION = compat.installed_sglang_version()
COMPAT_DIR = Path(compat.__file__).parent


def _lazy_common_names() -> set:
    for node in ast.parse((COMPAT_DIR / "_common.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LAZY_COMMON":
            return {k.value for k in node.value.keys}
    raise AssertionError("_common.py has no LAZY_COMMON table")


def _public_names(path: Path) -> set:
    """Top-level public names of a compat module, lazy ``_LAZY`` names included (read, not
    imported: a module for another SGLang version need not import here)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "_LAZY":
                        for k in node.value.keys:
                            # ``**LAZY_COMMON``: the entries shared through _common.py
                            names |= _lazy_common_names() if k is None else {k.value}
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names |= {a.asname or a.name for a in node.names}
    return {n for n in names if not n.startswith("_")}


def test_compat_modules_expose_the_same_names():
    assert tuple(compat._MODULES) == compat.SUPPORTED_VERSIONS
    names = {ver: _public_names(COMPAT_DIR / f"{mod}.py") for ver, mod in compat._MODULES.items()}
    reference = names[compat.SUPPORTED_VERSIONS[0]]
    assert {"tree_greedy_walk", "handle_dflash_server_args", "DFlashWorkerV2"} <= reference
    for ver, got in names.items():
        assert got == reference, f"compat for {ver} differs in {sorted(got ^ reference)}"


def test_installed_version_loads_its_module():
    sgl = compat.load()
    assert sgl.VERSION == VERSION
    assert sgl.__name__.endswith(compat._MODULES[VERSION])
    with pytest.raises(compat.UnsupportedSGLangVersion, match="0.5.17, 0.5.23"):
        compat.check_version("0.5.20")


# --- tree kernels ----------------------------------------------------------------------------

# version -> (module of verify_tree_greedy_func, the CUDA op it dispatches to)
KERNEL_ENTRY = {
    "0.5.17": ("sglang.srt.speculative.eagle_utils", "from sgl_kernel import verify_tree_greedy"),
    "0.5.23": ("sglang.kernels.ops.speculative.spec_tree",
               "from sglang.kernels.ops.speculative.tree import verify_tree_greedy"),
}


def test_tree_kernels_resolve_to_the_versions_entry_points():
    sgl = compat.load()
    module, cuda_import = KERNEL_ENTRY[VERSION]
    func = sgl.verify_tree_greedy_func
    assert func.__module__ == module
    assert cuda_import in inspect.getsource(func)
    assert tuple(inspect.signature(func).parameters)[:8] == (
        "predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index",
        "retrieve_next_token", "retrieve_next_sibling", "target_predict")
    if VERSION == "0.5.23":
        # the JIT op imports on CPU (it compiles on first call, on a GPU)
        from sglang.kernels.ops.speculative.tree import verify_tree_greedy

        assert tuple(inspect.signature(verify_tree_greedy).parameters) == (
            "predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
            "retrive_next_token", "retrive_next_sibling", "target_predict")


def _sglang_verify_tree_greedy(*, predicts, accept_index, accept_token_num, candidates,
                               retrieve_index, retrieve_next_token, retrieve_next_sibling,
                               target_predict, topk=-1):
    """SGLang's greedy tree-verify kernel, transcribed from its Triton version (one request per
    program): flat node ids through ``retrieve_index``, first child / next sibling links."""
    bs, n = candidates.shape
    width = accept_index.shape[1]
    for b in range(bs):
        last = int(retrieve_index[b, 0])
        accept_index[b, 0] = last
        num, cur = 0, 0
        for _ in range(1, width):
            cur = int(retrieve_next_token[b, cur])
            target = int(target_predict.view(-1)[last])
            matched = False
            while cur != -1:
                if int(candidates[b, cur]) == target:
                    predicts[last] = target
                    num += 1
                    accept_index[b, num] = int(retrieve_index[b, cur])
                    last = int(retrieve_index[b, cur])
                    matched = True
                    break
                cur = int(retrieve_next_sibling[b, cur])
            if not matched:
                break
        accept_token_num[b] = num
        predicts[last] = int(target_predict.view(-1)[last])


def test_tree_greedy_walk_matches_the_accept_walk(monkeypatch):
    from sglang_ddtree.accept import accept_walk_reference
    from sglang_ddtree.tree import build_tree
    from tests._tree_inputs import random_inputs

    sgl = compat.load()
    monkeypatch.setattr(sgl, "verify_tree_greedy_func", _sglang_verify_tree_greedy)
    g = torch.Generator().manual_seed(5)
    for trial in range(12):
        bs, depth, k, budget = 1 + trial % 4, [2, 4, 7][trial % 3], [1, 3, 6][trial % 3], \
            [3, 9, 24, 40][trial % 4]
        roots, lp, ids = random_inputs(bs, depth, k, 10, g, scale=1.0)
        tree = build_tree(roots, lp, ids, budget)
        n = tree.tokens.shape[1]
        # the target mostly follows an existing child, so paths get long
        predicted = torch.randint(0, 10, (bs, n), generator=g)
        for b in range(bs):
            for i in range(n):
                kids = (tree.parents[b] == i).nonzero().view(-1)
                if len(kids) and torch.rand(1, generator=g).item() < 0.8:
                    pick = kids[torch.randint(len(kids), (1,), generator=g)]
                    predicted[b, i] = tree.tokens[b, pick]
        want = accept_walk_reference(tree, predicted, depth)
        got = sgl.tree_greedy_walk(tree, predicted, depth + 1)
        for w, x, name in zip(want, got, ("accept_len", "accepted_nodes", "bonus")):
            assert torch.equal(w, x.cpu()), (trial, name, w, x)


# --- the worker constructor ------------------------------------------------------------------

BLOCK, BUDGET, VOCAB, HIDDEN, MASK_ID = 8, 12, 1000, 16, 5


def _draft_hf_config():
    return {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "block_size": BLOCK,
            "vocab_size": VOCAB,
            "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2]}}


def _model_config(hf_config, vocab):
    from sglang.srt.configs.model_config import AttentionArch

    return types.SimpleNamespace(hf_config=hf_config, vocab_size=vocab, context_len=4096,
                                 attention_arch=AttentionArch.MHA, is_draft_model=False,
                                 linear_attn_registry_result=None)


class _TargetModel(torch.nn.Module):
    """Embedding + lm_head: what DFLASH's drafter borrows from the target."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
            self.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))

    def get_input_embeddings(self):
        return self.embed


def _kv_translator(rows, cols):
    """The installed SGLang's KV id translator for a plain (non-unified) pool, if it has one."""
    try:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    except ImportError:  # 0.5.17: slot ids are used as they are
        return None
    return KVIndexTranslator(req_to_token=torch.zeros(rows, cols, dtype=torch.int32),
                             token_to_kv_pool_allocator=object(), token_to_kv_pool=object(),
                             page_size=1, device="cpu")


def _target_worker():
    from transformers import LlamaConfig

    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     architectures=["LlamaForCausalLM"])
    runner = types.SimpleNamespace(
        model_config=_model_config(hf, VOCAB), model=_TargetModel(), device="cpu",
        spec_algorithm=mock.MagicMock(name="spec_algorithm"),
        spec_aux_config=types.SimpleNamespace(draft_model_config=None),
        req_to_token_pool=types.SimpleNamespace(size=64), kv_index_translator=_kv_translator(8, 64),
    )
    return types.SimpleNamespace(model_runner=runner, device="cpu")


class _DraftRunner:
    """The drafter's model runner: records the ForwardBatch; the 'drafter' returns its input
    embeddings plus a position term as hidden states (so every depth differs)."""

    def __init__(self):
        self.model_config = _model_config(_draft_hf_config(), None)
        self.model = types.SimpleNamespace(candidate_selector=None, lilicorr=None,
                                           block_size=BLOCK, block_sizes_set=[])

        def set_block_size(b):  # 0.5.23's DFlashDraftModel API
            self.model.block_size = b
            self.model.block_sizes_set.append(b)

        self.model.set_block_size = set_block_size
        self.kv_index_translator = _kv_translator(8, 64)
        self.calls = []

    def forward(self, forward_batch):
        self.calls.append(forward_batch)
        hidden = forward_batch.input_embeds + 0.25 * forward_batch.positions[:, None].float()
        return types.SimpleNamespace(can_run_graph=False,
                                     logits_output=types.SimpleNamespace(hidden_states=hidden))


def _draft_bundle():
    runner = _DraftRunner()
    draft_model = runner.model
    return types.SimpleNamespace(draft_worker=mock.MagicMock(name="draft_tp_worker"),
                                 draft_model_runner=runner, draft_model=draft_model,
                                 resolved_attention_backend="triton")


def _server_args(tmp_path):
    return types.SimpleNamespace(
        speculative_num_draft_tokens=BUDGET + 1, speculative_draft_window_size=None,
        speculative_draft_model_path=str(tmp_path), page_size=1, disable_cuda_graph=True,
        speculative_domino_candidate_pool_size=0, speculative_use_block_verification=False,
        # SGLang's defaults
        moe_a2a_backend="none", deepep_mode="auto", enable_dp_attention=False, pp_size=1,
    )


@contextlib.contextmanager
def _fake_sglang_process(server_args):
    """What SGLang's scheduler process provides before it builds the spec worker: published
    config bags, a parallel context, a TP group, the draft TP worker (all mocked)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    import sglang.srt.runtime_context as rc
    import sglang.srt.speculative.dflash_worker_v2 as dw

    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    parallel = types.SimpleNamespace(tp_rank=0, tp_size=1, attn_dp_enabled=False, tp_group=group,
                                     attn_tp_size=1, attn_cp_size=1)
    graphs = types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
        decode=types.SimpleNamespace(backend=Backend.DISABLED, bs=[1, 2, 4])))
    bags = {"get_spec": server_args, "get_schedule": server_args,
            "get_exec": types.SimpleNamespace(graph=graphs),
            "get_parallel": parallel}
    patches = {name: (lambda v=v: v) for name, v in bags.items()}
    patches.update(
        build_draft_tp_worker=lambda **kw: _draft_bundle(),
        get_dp_tp_group=lambda: group,
        SpecTpSync=lambda group: mock.MagicMock(name="SpecTpSync"),
        model_draft_parallel_spec=lambda *a, **k: None,
        resolve_draft_parallel_layout=lambda *a, **k: types.SimpleNamespace(tp_group=None),
        draft_pp_context=contextlib.nullcontext,
        draft_tp_context=lambda *a, **k: contextlib.nullcontext(),
        get_tp_group=lambda: group,
    )
    with contextlib.ExitStack() as stack:
        for module in (dw, rc):
            for name, value in patches.items():
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, value))
        stack.enter_context(mock.patch.object(compat.load(), "get_tp_group", lambda: group))
        import sglang.srt.model_executor.forward_batch_info as fbi

        if hasattr(fbi, "enable_num_token_non_padded"):  # reads MoE/DP context: not padded here
            stack.enter_context(mock.patch.object(fbi, "enable_num_token_non_padded",
                                                  lambda: False))
        yield


def _constructor_kwargs(server_args, target_worker):
    """Keyword arguments for the installed DFlashWorkerV2 constructor (0.5.17 has ``ps``)."""
    sgl = compat.load()
    params = inspect.signature(sgl.DFlashWorkerV2.__init__).parameters
    values = {"server_args": server_args, "gpu_id": 0, "nccl_port": 12345,
              "target_worker": target_worker}
    if "ps" in params:
        from sglang.srt.distributed.parallel_state_wrapper import ParallelState

        values["ps"] = ParallelState.trivial()
    assert set(params) - {"self"} == set(values), sorted(params)
    return values


@pytest.fixture
def worker_class(monkeypatch):
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ddtree import plugin, worker

    assert plugin.registration_error() is None
    monkeypatch.setenv(cfg.ENV_BUDGET, str(BUDGET))
    monkeypatch.setenv("SGLANG_DDTREE_TREE_BACKEND", "torch")
    return worker.get_worker_class()


def test_worker_class_subclasses_the_installed_dflash_worker(worker_class):
    sgl = compat.load()
    assert issubclass(worker_class, sgl.DFlashWorkerV2)
    assert worker_class.__name__ == "DDTreeWorker"
    # SGLang (both versions) builds spec workers with keyword arguments only
    kwargs = inspect.signature(sgl.DFlashWorkerV2.__init__).parameters
    assert list(kwargs)[-1] == "target_worker"


def test_worker_constructor_runs_against_the_installed_api(worker_class, tmp_path):
    server_args = _server_args(tmp_path)
    target = _target_worker()
    with _fake_sglang_process(server_args):
        w = worker_class(**_constructor_kwargs(server_args, target))
    # SGLang's DFlashWorkerV2.__init__ ran: drafter bundle wired in, mask token resolved
    assert w.model_runner is target.model_runner
    assert w.draft_model_runner.model_config.hf_config["block_size"] == BLOCK
    assert int(w._mask_token_id) == MASK_ID
    # then DDTREE's part: tree sized from the budget, drafter block from the drafter config
    assert (w.tree_cfg.budget, w.tree_cfg.verify_width, w.tree_cfg.num_draft_tokens) == (
        BUDGET, BUDGET + 1, BUDGET + 1)
    assert w.block_size == w.speculative_num_draft_tokens == BLOCK
    # 0.5.23's DFLASH sizes the drafter with speculative_num_draft_tokens (BUDGET + 1 here); the
    # drafter's own block must win
    assert w.draft_model.block_size == BLOCK
    assert w.draft_model.block_sizes_set == ([] if VERSION == "0.5.17" else [BUDGET + 1, BLOCK])
    assert w._block_pos_offsets.tolist() == list(range(BLOCK))
    assert w._draft_block_spec_info.draft_token_num == BLOCK
    assert w._tp_group is None


def test_worker_constructor_takes_positional_arguments_too(worker_class, tmp_path):
    server_args = _server_args(tmp_path)
    kwargs = _constructor_kwargs(server_args, _target_worker())
    params = [p for p in inspect.signature(compat.load().DFlashWorkerV2.__init__).parameters
              if p != "self"]
    with _fake_sglang_process(server_args):
        w = worker_class(*[kwargs[p] for p in params])
    assert w.tree_cfg.budget == BUDGET


def test_worker_constructor_refuses_a_changed_budget(worker_class, tmp_path, monkeypatch):
    server_args = _server_args(tmp_path)
    monkeypatch.setenv(cfg.ENV_BUDGET, str(BUDGET + 4))  # launcher said BUDGET, process disagrees
    with _fake_sglang_process(server_args), \
            pytest.raises(cfg.DDTreeConfigError, match="disagrees with budget"):
        worker_class(**_constructor_kwargs(server_args, _target_worker()))


@pytest.mark.skipif(VERSION != "0.5.23", reason="drafter variants exist from SGLang 0.5.23")
def test_worker_constructor_refuses_selector_drafters(worker_class, tmp_path):
    server_args = _server_args(tmp_path)
    bundle = _draft_bundle()
    bundle.draft_model.candidate_selector = object()
    with _fake_sglang_process(server_args), \
            mock.patch("sglang.srt.speculative.dflash_worker_v2.build_draft_tp_worker",
                       lambda **kw: bundle), \
            pytest.raises(cfg.DDTreeConfigError, match="candidate selector"):
        worker_class(**_constructor_kwargs(server_args, _target_worker()))


def test_worker_constructor_refuses_a_draft_window(worker_class, tmp_path):
    server_args = _server_args(tmp_path)
    server_args.speculative_draft_window_size = 64
    with _fake_sglang_process(server_args), \
            pytest.raises(cfg.DDTreeConfigError, match="draft-window-size"):
        worker_class(**_constructor_kwargs(server_args, _target_worker()))


def test_worker_constructor_refuses_a_deepep_overflow(worker_class, tmp_path, monkeypatch):
    """DeepEP low-latency dispatch with SGLang's default 128 tokens per rank cannot take a
    verify of the fake pool's requests x 33 tree tokens: refused at start-up, naming the fix."""
    monkeypatch.delenv(cfg.ENV_DEEPEP_LL_TOKENS, raising=False)
    server_args = _server_args(tmp_path)
    server_args.moe_a2a_backend = "deepep"
    server_args.deepep_mode = "low_latency"
    with _fake_sglang_process(server_args), \
            pytest.raises(cfg.DDTreeConfigError, match="DeepEP low-latency"):
        worker_class(**_constructor_kwargs(server_args, _target_worker()))


def _draft_input_with_reserved_lens(bs, lens):
    """SGLang's DFlashDraftInputV2 as prepare_for_decode leaves it: host reserved KV lengths in
    the version's fields (0.5.17 ``reserved_seq_lens_*``, 0.5.23 ``nxt_kv_lens_*``)."""
    import dataclasses

    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    names = {"0.5.17": ("reserved_seq_lens_cpu", "reserved_seq_lens_sum"),
             "0.5.23": ("nxt_kv_lens_cpu", "nxt_kv_lens_sum")}[VERSION]
    assert set(names) <= {f.name for f in dataclasses.fields(DFlashDraftInputV2)}
    draft_input = DFlashDraftInputV2.create_idle_input(device=torch.device("cpu"))
    setattr(draft_input, names[0], lens)
    setattr(draft_input, names[1], int(lens.sum()))
    return draft_input


@pytest.mark.parametrize("host_lens", ["batch", "reserved"])
def test_draft_block_runs_through_the_installed_api(worker_class, tmp_path, host_lens):
    """One drafter block of the decode step (DDTreeWorker._draft) on CPU: the version's
    ForwardBatch, KV plan and embedding path, then the top-K head over the target's lm_head.
    ``host_lens``: the host length bound comes from the batch, or (overlap scheduling without
    host lengths) from the draft input's reserved KV lengths."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    server_args = _server_args(tmp_path)
    target = _target_worker()
    bs = 3
    prefix = torch.tensor([5, 9, 17], dtype=torch.int64)
    bonus = torch.tensor([11, 22, 33], dtype=torch.int64)
    block_slots = 100 * torch.arange(1, bs + 1)[:, None] + torch.arange(BLOCK)[None, :]
    reserved = prefix + 2 * BUDGET + 3
    batch = types.SimpleNamespace(
        req_pool_indices=torch.tensor([1, 2, 3]), seq_lens=prefix, seq_lens_cpu=prefix.clone(),
        spec_info=None, can_run_decode_cuda_graph=False)
    if host_lens == "reserved":
        batch.seq_lens_cpu = None
        batch.spec_info = _draft_input_with_reserved_lens(bs, reserved)
    bound = prefix + BLOCK if host_lens == "batch" else reserved
    with _fake_sglang_process(server_args):
        w = worker_class(**_constructor_kwargs(server_args, target))
        positions = prefix[:, None] + torch.arange(BLOCK)[None, :]
        block_ids = torch.full((bs, BLOCK), MASK_ID)
        block_ids[:, 0] = bonus
        topk_logp, topk_ids = w._draft(batch, prefix, block_ids, positions, block_slots, bs)

    (fb,) = w.draft_model_runner.calls
    assert isinstance(fb, ForwardBatch) and fb.forward_mode == ForwardMode.TARGET_VERIFY
    assert fb.batch_size == bs and fb.spec_info is w._draft_block_spec_info
    assert torch.equal(fb.out_cache_loc.view(bs, BLOCK), block_slots)
    assert torch.equal(fb.positions.view(bs, BLOCK), positions)
    assert torch.equal(fb.input_ids.view(bs, BLOCK), block_ids)
    embed = target.model_runner.model.embed.weight
    assert torch.equal(fb.input_embeds, embed[block_ids.view(-1)])
    assert fb.seq_lens_cpu.tolist() == bound.tolist() and fb.seq_lens_sum == int(bound.sum())
    if VERSION == "0.5.23":  # every forward carries the iteration's KV plan
        assert fb.kv_loc_plan is not None and fb.out_cache_loc_is_physical
        assert fb.global_num_token_non_padded_cpu == bs * BLOCK

    # the head: per-depth top-K of log_softmax(hidden @ lm_head.T) at depths 1..B-1
    hidden = (fb.input_embeds + 0.25 * fb.positions[:, None].float()).view(bs, BLOCK, -1)
    logp = torch.log_softmax(hidden[:, 1:] @ target.model_runner.model.lm_head.weight.T, -1)
    want_logp, want_ids = logp.topk(w.tree_cfg.topk, dim=-1)
    assert topk_logp.shape == (bs, BLOCK - 1, w.tree_cfg.topk)
    torch.testing.assert_close(topk_logp, want_logp, rtol=1e-5, atol=1e-5)
    assert torch.equal(topk_ids, want_ids)


def test_kv_layout_and_logits_helpers(worker_class, tmp_path):
    """The step's other version-specific pieces: translated KV pools refused (0.5.23 only; 0.5.17
    has none), verify logits gathered when DFLASH deferred the TP vocab gather (0.5.23)."""
    sgl = compat.load()
    server_args = _server_args(tmp_path)
    with _fake_sglang_process(server_args):
        w = worker_class(**_constructor_kwargs(server_args, _target_worker()))
    sgl.check_kv_layout(w)  # plain pools: fine on every version
    w.draft_model_runner.kv_index_translator = types.SimpleNamespace(is_translating=True)
    if VERSION == "0.5.17":
        sgl.check_kv_layout(w)
    else:
        with pytest.raises(cfg.DDTreeConfigError, match="drafter uses"):
            sgl.check_kv_layout(w)

    full = torch.randn(6, VOCAB)
    out = types.SimpleNamespace(next_token_logits=full)
    assert sgl.verify_logits(w, out) is full  # nothing deferred
    shard = full[:, : VOCAB // 2]
    w._target_logits_processor = types.SimpleNamespace(
        is_deferred_shard=lambda x: x.shape[-1] < VOCAB, finish_deferred_gather=lambda x: full)
    out = types.SimpleNamespace(next_token_logits=shard)
    got = sgl.verify_logits(w, out)
    if VERSION == "0.5.17":  # 0.5.17 never defers: logits are returned as they are
        assert got is shard
    else:
        assert got is full and out.next_token_logits is full


def _auto_worker(worker_class, tmp_path, monkeypatch, table):
    """A DDTreeWorker built with --speculative-ddtree-budget auto and ``table``."""
    monkeypatch.setenv(cfg.ENV_BUDGET, "auto")
    monkeypatch.setenv(cfg.ENV_AUTO_TABLE, table)
    server_args = _server_args(tmp_path)
    target = _target_worker()
    with _fake_sglang_process(server_args):
        w = worker_class(**_constructor_kwargs(server_args, target))
    return w, target, server_args


def test_auto_budget_worker_builds_one_tree_builder_per_budget_and_the_verify_states(
        worker_class, tmp_path, monkeypatch):
    """--speculative-ddtree-budget auto: trees for every budget of the table; after SGLang's own
    capture, one (attention backend, verify runner) state per smaller budget, built through the
    version's ``build_verify_state``, and the target left on the widest state."""
    w, target, server_args = _auto_worker(worker_class, tmp_path, monkeypatch,
                                          f"1:{BUDGET},4:6,inf:3")
    assert w.tree_cfg.budgets == (BUDGET, 6, 3)
    assert {b: tb.budget for b, tb in w._tree_builders.items()} == {BUDGET: BUDGET, 6: 6, 3: 3}
    assert w._tree_builders[3].topk == 3 and w._tree_builder is w._tree_builders[BUDGET]
    assert [w.tree_cfg.budget_for(bs) for bs in (1, 2, 4, 5, 64)] == [BUDGET, 6, 6, 3, 3]

    mr = w.model_runner
    mr.attn_backend, mr.decode_cuda_graph_runner = "backend-main", "runner-main"
    built = []
    sgl = compat.load()
    monkeypatch.setattr(sgl, "build_verify_state",
                        lambda m, width, graphs, wrap=None: built.append((m, width, graphs, wrap))
                        or (f"backend-{width}", f"runner-{width}"))
    w._graphs_enabled = True
    with _fake_sglang_process(server_args):
        w._build_verify_states()
    assert built == [(mr, 7, True, None), (mr, 4, True, None)]  # native verify: no wrapper
    assert w._verify_states == {BUDGET: ("backend-main", "runner-main"),
                                6: ("backend-7", "runner-7"), 3: ("backend-4", "runner-4")}
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == ("backend-main", "runner-main")


def test_auto_budget_with_the_triton_verify_backend_wraps_every_width(worker_class, tmp_path,
                                                                       monkeypatch):
    """--speculative-ddtree-budget auto behind the Triton verify backend (MLA targets on
    trtllm_mla / flashmla / ...): every smaller width's new attention backend is wrapped in its
    own TreeVerifyBackend of that width before its verify graphs are built."""
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "triton")
    w, target, server_args = _auto_worker(worker_class, tmp_path, monkeypatch,
                                          f"1:{BUDGET},4:6,inf:3")
    mr = w.model_runner
    mr.attn_backend, mr.decode_cuda_graph_runner = "wrapper-main", "runner-main"
    w._tree_verify = "wrapper-main"  # what init_attention_backends installs for the widest tree
    import sglang_ddtree.verify_backend as vb

    wrapped = []
    monkeypatch.setattr(vb, "wrap", lambda inner, model_runner, num_tree_tokens, sgl,
                        kernels=None: wrapped.append((inner, model_runner, num_tree_tokens))
                        or f"wrapper-{num_tree_tokens}")
    sgl = compat.load()
    monkeypatch.setattr(sgl, "build_verify_state",
                        lambda m, width, graphs, wrap=None: (wrap(f"backend-{width}"),
                                                              f"runner-{width}"))
    w._graphs_enabled = True
    with _fake_sglang_process(server_args):
        w._build_verify_states()
    assert wrapped == [("backend-7", mr, 7), ("backend-4", mr, 4)]
    assert w._verify_states == {BUDGET: ("wrapper-main", "runner-main"),
                                6: ("wrapper-7", "runner-7"), 3: ("wrapper-4", "runner-4")}


def test_build_verify_state_reports_the_width_while_building_and_restores_it(monkeypatch):
    """The version's imports resolve; the runtime context reports the new width while the backend
    and runner are built (and is restored, also on failure); init_new_workspace is restored."""
    import sglang.srt.model_executor.runner as runner_mod
    import sglang.srt.runtime_context as rc

    spec = types.SimpleNamespace(speculative_num_draft_tokens=33)
    overrides = []

    class Ctx:
        def override(self, source, **fields):
            overrides.append((source, dict(fields)))
            spec.speculative_num_draft_tokens = fields["speculative_num_draft_tokens"]

    seen = {}

    class FakeRunner:
        def __init__(self, model_runner, *, attn_backend, speculative_num_draft_tokens):
            seen["runner"] = (attn_backend, speculative_num_draft_tokens,
                              spec.speculative_num_draft_tokens)

    class MR:
        init_new_workspace = False

        def _get_attention_backend(self, init_new_workspace=False):
            seen["backend_width"] = spec.speculative_num_draft_tokens
            self.init_new_workspace = init_new_workspace
            return "backend"

    monkeypatch.setattr(rc, "get_context", lambda: Ctx())
    monkeypatch.setattr(rc, "get_spec", lambda: spec)
    monkeypatch.setattr(runner_mod, "DecodeCudaGraphRunner", FakeRunner)
    mr = MR()
    sgl = compat.load()
    backend, runner = sgl.build_verify_state(mr, 9, True)
    assert backend == "backend" and isinstance(runner, FakeRunner)
    assert seen["backend_width"] == 9 and seen["runner"] == ("backend", 9, 9)
    assert spec.speculative_num_draft_tokens == 33 and mr.init_new_workspace is False
    assert sgl.build_verify_state(mr, 17, False)[1] is None  # graphs off: backend only
    # wrap: the new backend is replaced (DDTREE's Triton verify around it) before the runner
    wrapped, runner = sgl.build_verify_state(mr, 9, True, wrap=lambda b: ("wrapped", b))
    assert wrapped == ("wrapped", "backend") and seen["runner"][0] == ("wrapped", "backend")

    def boom(*a, **k):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(runner_mod, "DecodeCudaGraphRunner", boom)
    with pytest.raises(RuntimeError, match="capture failed"):
        sgl.build_verify_state(mr, 5, True)
    assert spec.speculative_num_draft_tokens == 33  # restored after the failure


class _KVPool:
    """Per-layer [slots, H] buffers; SGLang's move_kv_cache semantics (one column per call)."""

    def __init__(self, slots):
        g = torch.Generator().manual_seed(7)
        self.bufs = [torch.randn(slots, 4, generator=g) for _ in range(2)]

    def move_kv_cache(self, tgt, src):
        for buf in self.bufs:
            buf[tgt] = buf[src].clone()


class _SamplingInfo:
    """What the T > 0 path reads from SGLang's SamplingBatchInfo (no penalties, no bias)."""

    def __init__(self, bs, temperature, top_k, top_p):
        self.temperatures = torch.full((bs, 1), temperature)
        self.top_ks = torch.full((bs,), top_k, dtype=torch.int32)
        self.top_ps = torch.full((bs,), top_p)
        self.min_ps = torch.zeros(bs)
        self.need_top_k_sampling, self.need_top_p_sampling = True, top_p < 1.0
        self.need_min_p_sampling = False
        self.is_all_greedy = False
        self.has_custom_logit_processor = False
        self.sampling_seed = None
        self._bs = bs

    def __len__(self):
        return self._bs


def _children(tree, b, node):
    """Request b's children of ``node`` in the tree, by index."""
    return [i for i in range(1, tree.tokens.shape[1])
            if tree.valid[b, i] and tree.parents[b, i] == node]


def _step_worker(worker_class, tmp_path, monkeypatch):
    """(compat module, target worker, DDTreeWorker) for a decode step on CPU, SGLang's verify
    kernel replaced by its torch stand-in."""
    sgl = compat.load()
    monkeypatch.setattr(sgl, "verify_tree_greedy_func", _sglang_verify_tree_greedy)
    server_args = _server_args(tmp_path)
    target = _target_worker()
    with _fake_sglang_process(server_args):
        w = worker_class(**_constructor_kwargs(server_args, target))
    return sgl, target, w


@pytest.mark.parametrize("mode", ["fixed", "auto", "sampled"])
def test_one_decode_step_end_to_end_on_cpu(worker_class, tmp_path, monkeypatch, mode):
    """DDTreeWorker.forward_batch_generation on CPU against the installed SGLang's classes, with
    the drafter, the target forward and SGLang's verify kernel replaced by stand-ins: the
    emitted tokens, lengths, KV moves and drafter-KV rows follow the path the target picked;
    with ``auto`` the step uses the small tree and that width's verify state; ``sampled`` runs
    the T > 0 path (per-node samples, top-k bounded on the host) at a temperature so low that
    the samples are the planted argmaxes."""
    from sglang_ddtree.tree import build_tree

    if mode == "auto":
        monkeypatch.setenv(cfg.ENV_BUDGET, "auto")
        monkeypatch.setenv(cfg.ENV_AUTO_TABLE, f"1:{BUDGET},inf:4")
    sgl, target, w = _step_worker(worker_class, tmp_path, monkeypatch)
    bs, depth = 2, BLOCK - 1
    budget = w.tree_cfg.budget_for(bs)
    assert budget == (4 if mode == "auto" else BUDGET)
    n = budget + 1
    width = w.tree_cfg.num_draft_tokens
    g = torch.Generator().manual_seed(3)
    k_full = w.tree_cfg.topk
    logp = torch.log_softmax(3 * torch.randn(bs, depth, 40, generator=g), -1).topk(k_full).values
    ids = torch.stack([torch.randperm(VOCAB - 10, generator=g)[:k_full] + 10
                       for _ in range(bs * depth)]).view(bs, depth, k_full)
    prefix = torch.tensor([7, 12], dtype=torch.int64)
    bonus = torch.tensor([3, 4], dtype=torch.int64)
    draft_pos = prefix[:, None] + torch.arange(BLOCK)[None, :]
    drafted = {}

    def fake_draft(batch, prefix_in, block_ids, positions, block_slots, bs_in, seq_bound):
        drafted.update(block_ids=block_ids, positions=positions, block_slots=block_slots.clone())
        return logp, ids

    monkeypatch.setattr(w, "_draft", fake_draft)

    # the tree the worker will build (same inputs, same budget), and a path the target follows
    k = min(k_full, budget)
    tree = build_tree(bonus, logp[:, :, :k], ids[:, :, :k], budget)
    path_nodes = []
    for b in range(bs):
        node, path = 0, [0]
        while True:
            kids = _children(tree, b, node)
            if not kids:
                break
            node = kids[-1]  # the last child: not always the best-ranked branch
            path.append(node)
        path_nodes.append(path)
    logits = torch.randn(bs * n, VOCAB, generator=g)
    next_tok = torch.randint(10, VOCAB, (bs,), generator=g)  # the bonus after the path
    for b, path in enumerate(path_nodes):
        for a, c in zip(path, path[1:]):
            logits[b * n + a, tree.tokens[b, c]] = 100.0
        logits[b * n + path[-1], next_tok[b]] = 100.0
    hidden = torch.randn(bs * n, HIDDEN, generator=g)

    mr = target.model_runner
    rows = torch.arange(8 * 64, dtype=torch.int64).view(8, 64) + 1
    mr.req_to_token_pool = types.SimpleNamespace(size=64, req_to_token=rows)
    pool = _KVPool(int(rows.max()) + 1)
    mr.token_to_kv_pool = pool
    mr.attn_backend, mr.decode_cuda_graph_runner = "main-backend", "main-runner"
    if mode == "auto":
        w._verify_states = {BUDGET: ("main-backend", "main-runner"),
                            4: ("backend-5", "runner-5")}
    seen = {}

    class VerifyInput(sgl.DFlashVerifyInput):
        def prepare_for_verify(self, batch, target_worker):
            seen["verify"] = (self.draft_token_num, self.draft_token.clone(),
                              mr.attn_backend, mr.decode_cuda_graph_runner,
                              self.custom_mask is not None)
            return "forward-batch", False

    monkeypatch.setattr(sgl, "DFlashVerifyInput", VerifyInput)
    target.forward_batch_generation = lambda **kw: types.SimpleNamespace(
        logits_output=types.SimpleNamespace(next_token_logits=logits.clone(),
                                            hidden_states=hidden.clone()),
        can_run_cuda_graph=False)
    appended = {}
    monkeypatch.setattr(w, "_append_target_hidden_to_draft_kv_by_loc",
                        lambda **kw: appended.update(kw))
    published = []
    req_pool = torch.tensor([1, 5])
    draft_input = types.SimpleNamespace(bonus_tokens=bonus)
    params = types.SimpleNamespace(top_k=50, sampling_seed=None)
    sampling = _SamplingInfo(bs, 1e-3, 50, 0.9) if mode == "sampled" else None
    batch = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
        is_extend_in_batch=False, spec_info=draft_input, has_grammar=False, seq_lens=prefix,
        seq_lens_cpu=prefix.clone(), seq_lens_sum=int(prefix.sum()), req_pool_indices=req_pool,
        reqs=[types.SimpleNamespace(sampling_params=params)] * bs, sampling_info=sampling,
        out_cache_loc=None)
    before = [buf.clone() for buf in pool.bufs]
    from sglang_ddtree import worker as worker_mod

    sampled = {}
    real_sample = worker_mod.sample_per_node

    def spy(*a, **kw):
        sampled.update(kw)
        return real_sample(*a, **kw)

    monkeypatch.setattr(worker_mod, "sample_per_node", spy)

    result = w.forward_batch_generation(batch, on_publish=published.append)

    if mode == "sampled":  # the T > 0 path ran, with the host-side top-k bound
        assert sampled["max_top_k"] == 50 and sampled["request_seeds"] is None
    else:
        assert not sampled
    # verify forward: the tree of this step's budget, through this width's verify state
    assert seen["verify"][0] == n and torch.equal(seen["verify"][1], tree.tokens.reshape(-1))
    want_state = ("backend-5", "runner-5") if mode == "auto" else ("main-backend",
                                                                   "main-runner")
    assert seen["verify"][2:4] == want_state and seen["verify"][4]
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == ("main-backend", "main-runner")
    # accept + commit
    accept = torch.tensor([len(p) - 1 for p in path_nodes])
    assert int(accept.min()) >= 2  # long enough to exercise the walk and the KV moves
    assert torch.equal(result.accept_lens.long(), accept + 1)
    out = result.next_token_ids.view(bs, BLOCK)
    slots = rows[req_pool][:, None] + 0  # req_to_token row of each request
    for b, path in enumerate(path_nodes):
        kk = len(path) - 1
        assert out[b, :kk].tolist() == [int(tree.tokens[b, c]) for c in path[1:]]
        assert int(out[b, kk]) == int(next_tok[b])
        row = slots[b, 0, int(prefix[b]): int(prefix[b]) + width]
        for j, node in enumerate(path[1:], start=1):  # KV of path node -> position j's slot
            for buf, old in zip(pool.bufs, before):
                assert torch.equal(buf[row[j]], old[row[node]])
    assert torch.equal(published[0], prefix + accept + 1)
    # the step's prep handed the drafter its block: [root, MASK...], prefix + 0..B-1, slots
    assert drafted["block_ids"][:, 0].tolist() == bonus.tolist()
    assert bool((drafted["block_ids"][:, 1:] == MASK_ID).all())
    assert torch.equal(drafted["positions"], draft_pos)
    for b in range(bs):
        p0 = int(prefix[b])
        assert torch.equal(drafted["block_slots"][b], rows[req_pool[b], p0:p0 + BLOCK])
    assert torch.equal(result.new_seq_lens, prefix + accept + 1)
    # drafter KV: the accepted nodes' hidden rows, in path order, at the block's slots
    hrows = appended["target_hidden"].view(bs, BLOCK, HIDDEN)
    for b, path in enumerate(path_nodes):
        for j, node in enumerate(path):
            assert torch.equal(hrows[b, j], hidden[b * n + node])
    assert torch.equal(appended["positions"], draft_pos.reshape(-1))
    assert torch.equal(appended["commit_lens"].long(), accept + 1)


class _BanGrammar:
    """SGLang's grammar-object interface (what ``traverse_tree`` and ``GrammarMask`` call) over a
    toy language: after token s, the tokens in ``bans[s]`` are not allowed. Bitmasks are packed
    int32 words, 32 tokens a word, as xgrammar's."""

    def __init__(self, bans, state, log):
        self.bans, self.stack, self.log = bans, [int(state)], log

    def allowed(self, state, token):
        return int(token) not in self.bans.get(int(state), ())

    def accept_token(self, token):
        assert self.allowed(self.stack[-1], token), "the traversal fed a banned token"
        self.stack.append(int(token))

    def rollback(self, k):
        del self.stack[-k:]

    def is_terminated(self):
        return False

    def allocate_vocab_mask(self, vocab_size, batch_size, device):
        return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_vocab_mask(self, vocab_mask, idx):
        self.log.append("fill")
        bits = torch.ones(vocab_mask.shape[1] * 32, dtype=torch.int64)
        for t in self.bans.get(self.stack[-1], ()):
            bits[t] = 0
        words = (bits.view(-1, 32) << torch.arange(32)).sum(1)
        vocab_mask[idx] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    def apply_vocab_mask(self, logits, vocab_mask):
        bits = (vocab_mask.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1
        allowed = bits.reshape(vocab_mask.shape[0], -1)[:, :logits.shape[1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))


@pytest.mark.parametrize("sampled", [False, True])
def test_grammar_constrained_decode_step_on_cpu(worker_class, tmp_path, monkeypatch, sampled):
    """A batch with grammar-constrained requests: the target's token at every tree node is one
    the grammar allows after that node's path (SGLang's GrammarTree walk over our tree's links),
    so a draft token the unconstrained target prefers but the grammar bans is not accepted and
    the bonus token obeys the grammar too. The tree's copy to the host starts before the verify
    launch, the scheduler's grammar barrier runs before the first bitmask, and a request without
    a grammar in the same batch is unconstrained. ``sampled``: the T > 0 path."""
    from sglang_ddtree.tree import build_tree

    sgl, target, w = _step_worker(worker_class, tmp_path, monkeypatch)
    bs, depth, n = 3, BLOCK - 1, BUDGET + 1
    g = torch.Generator().manual_seed(11)
    k = w.tree_cfg.topk
    logp = torch.log_softmax(2 * torch.randn(bs, depth, 40, generator=g), -1).topk(k).values
    ids = torch.stack([torch.randperm(VOCAB - 10, generator=g)[:k] + 10
                       for _ in range(bs * depth)]).view(bs, depth, k)
    prefix = torch.tensor([7, 12, 9], dtype=torch.int64)
    bonus = torch.tensor([3, 4, 6], dtype=torch.int64)
    monkeypatch.setattr(w, "_draft", lambda *a: (logp, ids))
    tree = build_tree(bonus, logp[:, :, :k], ids[:, :, :k], BUDGET)

    # per request: the path the grammar lets the target take (the first child at every node),
    # a banned decoy at each path node (a sibling the target would prefer; past the deepest
    # node, a token), and the bonus after the path
    logits = torch.randn(bs * n, VOCAB, generator=g)
    bans, paths, decoys = {}, [], 0
    next_tok = torch.tensor([901, 902, 903])
    for b in range(bs):
        node, path = 0, [0]
        while kids := _children(tree, b, node):
            path.append(kids[0])
            if len(kids) > 1 and b < 2:  # request 2 has no grammar: its decoys must win
                state, bad = int(tree.tokens[b, node]), int(tree.tokens[b, kids[1]])
                if bad != int(tree.tokens[b, kids[0]]) and bans.setdefault(state, set()) \
                        .isdisjoint({int(tree.tokens[b, kids[0]])}):
                    bans[state].add(bad)
                    logits[b * n + node, bad] = 200.0
                    decoys += 1
            logits[b * n + node, tree.tokens[b, kids[0]]] = 100.0
            node = kids[0]
        logits[b * n + node, next_tok[b]] = 100.0
        if b < 2:
            bans.setdefault(int(tree.tokens[b, node]), set()).add(950 + b)
            logits[b * n + node, 950 + b] = 200.0
        paths.append(path)
    assert decoys >= 2 and all(len(p) >= 3 for p in paths)
    # the decoys really are preferred: they are in the tree and outscore the path's token
    for b in range(2):
        assert any(int(logits[b * n + a].argmax()) != int(tree.tokens[b, c])
                   for a, c in zip(paths[b], paths[b][1:]))
    for b in range(bs):  # no ban may cut a grammar request's own path
        if b < 2:
            for a, c in zip(paths[b], paths[b][1:]):
                assert int(tree.tokens[b, c]) not in bans.get(int(tree.tokens[b, a]), ())

    events = []
    grammars = [_BanGrammar(bans, bonus[b], events) for b in range(2)] + [None]
    rows = torch.arange(8 * 64, dtype=torch.int64).view(8, 64) + 1
    mr = target.model_runner
    mr.req_to_token_pool = types.SimpleNamespace(size=64, req_to_token=rows)
    mr.token_to_kv_pool = _KVPool(int(rows.max()) + 1)
    mr.attn_backend, mr.decode_cuda_graph_runner = "main-backend", "main-runner"
    real_from_device = sgl.GrammarTree.from_device

    class GrammarTree(sgl.GrammarTree):
        @classmethod
        def from_device(cls, *tensors):
            events.append("tree-copy")
            assert torch.equal(tensors[0], tree.retrive_next_token)
            assert torch.equal(tensors[1], tree.retrive_next_sibling)
            assert torch.equal(tensors[2], tree.tokens)
            return real_from_device(*tensors)

    monkeypatch.setattr(sgl, "GrammarTree", GrammarTree)

    class VerifyInput(sgl.DFlashVerifyInput):
        def prepare_for_verify(self, batch, target_worker):
            events.append("verify")
            return "forward-batch", False

    monkeypatch.setattr(sgl, "DFlashVerifyInput", VerifyInput)
    target.forward_batch_generation = lambda **kw: types.SimpleNamespace(
        logits_output=types.SimpleNamespace(next_token_logits=logits.clone(),
                                            hidden_states=torch.zeros(bs * n, HIDDEN)),
        can_run_cuda_graph=False)
    monkeypatch.setattr(w, "_append_target_hidden_to_draft_kv_by_loc", lambda **kw: None)
    sampling = _SamplingInfo(bs, 1e-3, 50, 0.9)
    sampling.is_all_greedy = not sampled
    sampling.vocab_size, sampling.grammar_mask = VOCAB, "left over from the prefill"
    params = types.SimpleNamespace(top_k=50, sampling_seed=None)
    batch = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
        is_extend_in_batch=False, spec_info=types.SimpleNamespace(bonus_tokens=bonus),
        has_grammar=True, seq_lens=prefix, seq_lens_cpu=prefix.clone(),
        seq_lens_sum=int(prefix.sum()), req_pool_indices=torch.tensor([1, 5, 2]),
        reqs=[types.SimpleNamespace(sampling_params=params, grammar=gr) for gr in grammars],
        sampling_info=sampling, out_cache_loc=None,
        # where SGLang computes speculative logprobs (0.5.23), from the masked logits too
        return_logprob=sgl.SPEC_LOGPROBS, top_logprobs_nums=[2, 0, 3], token_ids_logprobs=None)

    result = w.forward_batch_generation(batch, on_publish=lambda lens: None,
                                        grammar_barrier=lambda: events.append("barrier"))

    assert events.index("tree-copy") < events.index("verify") < events.index("barrier")
    assert events.index("barrier") < events.index("fill")
    assert sampling.grammar_mask is None  # the prefill's mask is not applied to the tree
    assert all(gr.stack == [int(bonus[b])] for b, gr in enumerate(grammars[:2]))  # rolled back
    out = result.next_token_ids.view(bs, BLOCK)
    for b, path in enumerate(paths):
        kk = len(path) - 1
        if b < 2:  # the grammar's path and bonus, past the preferred decoys
            assert int(result.accept_lens[b]) == kk + 1
            assert out[b, :kk].tolist() == [int(tree.tokens[b, c]) for c in path[1:]]
            assert int(out[b, kk]) == int(next_tok[b])
        else:  # no grammar: the target's own argmax walk
            assert int(result.accept_lens[b]) >= 1
    if sgl.SPEC_LOGPROBS:  # token j's logprob from the row of accepted node j, masked
        lo = result.logits_output
        scale = 1.0 if not sampled else 1e-3
        assert tuple(lo.next_token_logprobs.shape) == (bs, BLOCK)
        for b, path in enumerate(paths):
            kk = len(path) - 1
            rows_b = torch.log_softmax(lo.next_token_logits[b * n + torch.tensor(path)] / scale,
                                       -1)
            want = rows_b.gather(1, out[b, :kk + 1, None].long())[:, 0]
            assert torch.allclose(lo.next_token_logprobs[b, :kk + 1], want, atol=1e-5)
            if b < 2:  # the banned decoys (logit 200) do not count: the path's token is ~certain
                assert float(lo.next_token_logprobs[b, :kk + 1].min()) > -1e-3
            tops = lo.next_token_top_logprobs_idx[b * BLOCK: b * BLOCK + kk + 1]
            assert all(len(t) == [2, 0, 3][b] for t in tops)
            if b == 0:
                assert [t[0] for t in tops] == out[0, :kk + 1].tolist()
    # without the mask the same logits walk off the grammar's path (the test can fail)
    pred = logits.view(bs, n, VOCAB).argmax(-1)
    assert any(int(pred[b, a]) != int(tree.tokens[b, c])
               for b in range(2) for a, c in zip(paths[b], paths[b][1:])) or \
        any(int(pred[b, paths[b][-1]]) != int(next_tok[b]) for b in range(2))


def test_sglang_grammar_walk_over_our_tree_with_xgrammar():
    """SGLang's grammar walk (GrammarTree + build_grammar_vocab_mask, as the worker calls them)
    over a DDTree's links with real xgrammar matchers: each node whose path the grammar accepts
    gets the bitmask a fresh matcher gives after that path, every other node keeps the
    all-allowed row, and the request's matcher is left where it started."""
    xgr = pytest.importorskip("xgrammar")
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
    from sglang_ddtree.tree import build_tree

    sgl = compat.load()
    vocab = ["a", "b", "c", "ab", "ba", "ca", "0", "1", "01", "10", "x", "y", "-", "_", "z",
             "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[15])
    compiled = xgr.GrammarCompiler(info).compile_regex(r"(ab|ba|c)+(0|1)*-?")

    def matcher():
        return xgr.GrammarMatcher(compiled)

    class Grammar(XGrammarGrammar):  # SGLang's, but its bitmask unpinned (no CUDA driver here)
        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            return xgr.allocate_token_bitmask(batch_size, vocab_size)

    bs, depth, k, budget = 3, 6, 6, 40
    g = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(bs, depth, 16, generator=g), -1).topk(k).values
    ids = torch.stack([torch.randperm(15, generator=g)[:k] for _ in range(bs * depth)])
    roots = torch.tensor([3, 2, 4])  # "ab", "c", "ba": each already accepted by its request
    tree = build_tree(roots, logp, ids.view(bs, depth, k), budget)
    grammars = []
    for b in range(bs):
        gr = Grammar(matcher(), info.vocab_size, compiled, None)
        gr.accept_token(int(roots[b]))
        grammars.append(gr)
    reqs = [types.SimpleNamespace(grammar=gr) for gr in grammars]
    info_ns = types.SimpleNamespace(vocab_size=info.vocab_size, grammar_mask=None)
    gtree = sgl.GrammarTree.from_device(tree.retrive_next_token, tree.retrive_next_sibling,
                                        tree.tokens)
    mask = sgl.build_grammar_vocab_mask(reqs=reqs, tree=gtree, sampling_info=info_ns,
                                        device="cpu", barrier=None).vocab_mask
    n = budget + 1
    admitted = 0
    for b in range(bs):
        assert grammars[b].accepted_tokens == [int(roots[b])]  # every walk rolled back
        for i in range(n):
            if not bool(tree.valid[b, i]):
                continue
            path, node = [], i
            while node > 0:
                path.append(int(tree.tokens[b, node]))
                node = int(tree.parents[b, node])
            m = matcher()
            ok = all(m.accept_token(t) for t in [int(roots[b])] + path[::-1])
            want = torch.full((1, mask.shape[1]), -1, dtype=torch.int32)
            if ok:
                m.fill_next_token_bitmask(want, 0)
                admitted += 1
            assert torch.equal(mask[b * n + i], want[0]), (b, i, path[::-1])
    assert bs < admitted < bs * n  # some nodes admitted beyond the roots, some not


def test_auto_budget_state_failure_names_the_fix(worker_class, tmp_path, monkeypatch):
    w, target, server_args = _auto_worker(worker_class, tmp_path, monkeypatch,
                                          f"1:{BUDGET},inf:4")
    mr = target.model_runner
    mr.attn_backend, mr.decode_cuda_graph_runner = "main-backend", "main-runner"

    def oom(*a):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(compat.load(), "build_verify_state", oom)
    with _fake_sglang_process(server_args), \
            pytest.raises(cfg.DDTreeConfigError, match="mem-fraction-static"):
        w._build_verify_states()
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == ("main-backend", "main-runner")


def test_step_graphs_are_prewarmed_for_every_batch_size_with_its_budget(
        worker_class, tmp_path, monkeypatch):
    """At start-up (after SGLang's capture) every batch size up to the largest CUDA-graph batch
    size gets its accept/commit graph, on the tree buffers of the budget it will use; nothing
    happens with graphs off."""
    w, target, server_args = _auto_worker(worker_class, tmp_path, monkeypatch,
                                          f"1:{BUDGET},4:6,inf:3")
    sgl = compat.load()
    monkeypatch.setattr(sgl, "max_capture_bs", lambda: 6)
    monkeypatch.setattr(sgl, "max_running_requests", lambda worker: 64)
    asked, warmed = [], []
    for b, tb in w._tree_builders.items():
        monkeypatch.setattr(tb, "static_tree", lambda bs, b=b: asked.append((bs, b)) or (b, bs))
    monkeypatch.setattr(w._accept_commit, "prewarm",
                        lambda tree, width, pool, **kw: warmed.append((tree, width, pool, kw))
                        or True)
    w.model_runner.token_to_kv_pool = pool = object()
    w._graphs_enabled = False
    with _fake_sglang_process(server_args):
        w._prewarm_step_graphs()
    assert asked == [] and warmed == []
    w._graphs_enabled = True
    w._step_prep.use_kernel = False  # the torch ops: no buffers to hand over
    with _fake_sglang_process(server_args):  # the start-up log line reads the TP rank
        w._prewarm_step_graphs()
    assert asked == [(1, BUDGET), (2, 6), (3, 6), (4, 6), (5, 3), (6, 3)]
    assert warmed == [((b, bs), w.tree_cfg.num_draft_tokens, pool, {}) for bs, b in asked]
    # the kernel's per-batch-size buffers: the graphs read the step's slots and lengths there
    w._step_prep.use_kernel = True
    w._accept_commit.use_graphs = True
    asked.clear()
    warmed.clear()
    with _fake_sglang_process(server_args):
        w._prewarm_step_graphs()
    assert len(warmed) == 6
    for (tree, width, _, kw), (bs, _) in zip(warmed, asked):
        prep = w._step_prep.buffers(bs)
        assert kw["slots"] is prep[0] and kw["prefix"] is prep[3]


def test_online_auto_mode_asks_the_controller_and_prewarms_every_budget(
        worker_class, tmp_path, monkeypatch):
    """SGLANG_DDTREE_AUTO_MODE=online: the step's budget comes from the controller, fed with
    the tokens the scheduler emitted to the batch's requests; a prefill breaks the interval;
    every budget's graphs are captured at every batch size."""
    monkeypatch.setenv(cfg.ENV_AUTO_MODE, "online")
    w, target, server_args = _auto_worker(worker_class, tmp_path, monkeypatch,
                                          f"1:{BUDGET},inf:3")
    from sglang_ddtree.auto_online import OnlineBudgetController

    assert isinstance(w._online, OnlineBudgetController) and w._online.budgets == (BUDGET, 3)
    calls = []
    monkeypatch.setattr(w._online, "step", lambda bs, emitted, now: calls.append((bs, emitted))
                        or 3)
    req = types.SimpleNamespace(rid="a", output_ids=[1])
    batch = types.SimpleNamespace(reqs=[req])
    assert w._budget_for(batch, 1) == 3  # not the table's BUDGET for batch size 1
    req.output_ids += [2, 3]
    w._budget_for(batch, 1)
    assert calls == [(1, 0), (1, 2)]

    sgl = compat.load()
    monkeypatch.setattr(sgl, "max_capture_bs", lambda: 2)
    monkeypatch.setattr(sgl, "max_running_requests", lambda worker: 64)
    asked = []
    for b, tb in w._tree_builders.items():
        monkeypatch.setattr(tb, "static_tree", lambda bs, b=b: asked.append((bs, b)) or None)
    w.model_runner.token_to_kv_pool = object()
    w._graphs_enabled = True
    with _fake_sglang_process(server_args):
        w._prewarm_step_graphs()
    assert asked == [(1, BUDGET), (1, 3), (2, BUDGET), (2, 3)]


def test_online_auto_mode_is_off_by_default(worker_class, tmp_path, monkeypatch):
    w, _, _ = _auto_worker(worker_class, tmp_path, monkeypatch, f"1:{BUDGET},inf:3")
    assert w._online is None
    assert w._budget_for(types.SimpleNamespace(reqs=[]), 1) == BUDGET
    assert w._budget_for(types.SimpleNamespace(reqs=[]), 2) == 3


def test_online_auto_mode_is_refused_with_dp_attention(worker_class, tmp_path, monkeypatch):
    monkeypatch.setenv(cfg.ENV_BUDGET, "auto")
    monkeypatch.setenv(cfg.ENV_AUTO_TABLE, f"1:{BUDGET},inf:3")
    monkeypatch.setenv(cfg.ENV_AUTO_MODE, "online")
    server_args = _server_args(tmp_path)
    server_args.enable_dp_attention = True
    with _fake_sglang_process(server_args):
        with pytest.raises(cfg.DDTreeConfigError, match="--enable-dp-attention"):
            worker_class(**_constructor_kwargs(server_args, _target_worker()))
