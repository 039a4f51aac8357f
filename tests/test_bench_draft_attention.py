"""scripts/bench_draft_attention.py on CPU (Triton's interpreter): the point it times is the
drafter's block attention: every block query sees its whole prefix and every block token
(checked against the fp32 reference with an all-ones block mask and against a plain softmax
over the gathered keys), and the grid writes nothing without a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.triton_kernels import load_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_draft_attention as bda  # noqa: E402

K = load_kernels(interpret=True)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_timed_kernel_is_the_drafters_block_attention(monkeypatch):
    monkeypatch.setitem(bda.SHAPES, "tiny", (4, 1, 16))
    gen = torch.Generator().manual_seed(1)
    p = bda.DraftPoint(K.reference, "tiny", 2, 5, 37, gen, "cpu")
    assert p.mask.shape == (2, 5, 5) and p.mask.all()
    assert p.kv_bytes == 2 * (37 + 5) * 2 * 1 * 16 * 2
    fn, out, splits = bda.ours_fn(K.tree_attention, p, validate=True)
    fn()
    ref = K.reference.tree_attention_reference(p.q, p.k_cache, p.v_cache, p.layout.out_cache_loc,
                                               p.mask, sm_scale=p.sm_scale,
                                               **p.layout.table_kwargs())
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
    # the same by hand for request 1, query 3, head 2: softmax over prefix + all block keys
    lay, b, i, h = p.layout, 1, 3, 2
    slots = torch.cat([lay.req_to_token[lay.req_pool_indices[b], :37].long(),
                       lay.out_cache_loc[b * 5:(b + 1) * 5].long()])
    k, v = p.k_cache[slots, 0].float(), p.v_cache[slots, 0].float()
    w = torch.softmax(k @ p.q[b * 5 + i, h].float() * p.sm_scale, dim=0)
    torch.testing.assert_close(out[b * 5 + i, h].float(), w @ v, atol=2e-2, rtol=2e-2)


def test_main_needs_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "x.json"
    assert bda.main(["--out", str(out)]) == 2 and not out.exists()


class _FakeFlashInfer:
    """What FlashInfer's paged prefill computes with pages of one token and ``causal=False``
    (every query of request b over keys ``indices[kv_indptr[b]:kv_indptr[b + 1]]``): the
    benchmark's FlashInfer baseline must hand it the same keys our kernel reads."""

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace, layout, backend):
            assert layout == "NHD" and backend == "fa2"

        def plan(self, qo_indptr, kv_indptr, indices, last_page_len, hq, hkv, d, page_size, *,
                 causal, sm_scale, q_data_type, kv_data_type):
            assert page_size == 1 and not causal and bool((last_page_len == 1).all())
            self.args = (qo_indptr, kv_indptr, indices, hq // hkv, sm_scale)

        def run(self, q, kv, out):
            qo, kvp, idx, group, scale = self.args
            k4, v4 = kv
            for b in range(qo.numel() - 1):
                slots = idx[kvp[b]:kvp[b + 1]].long()
                k = k4[slots, 0].float().repeat_interleave(group, 1)  # [keys, hq, d]
                v = v4[slots, 0].float().repeat_interleave(group, 1)
                qb = q[qo[b]:qo[b + 1]].float()                      # [n, hq, d]
                w = torch.softmax(torch.einsum("nhd,khd->hnk", qb, k) * scale, -1)
                out[qo[b]:qo[b + 1]] = torch.einsum("hnk,khd->nhd", w, v).to(out.dtype)


def test_flashinfer_baseline_reads_the_same_keys(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", _FakeFlashInfer)
    monkeypatch.setitem(bda.SHAPES, "tiny", (4, 2, 16))
    p = bda.DraftPoint(K.reference, "tiny", 3, 6, 29, torch.Generator().manual_seed(2), "cpu")
    fn, out, _ = bda.ours_fn(K.tree_attention, p)
    fn()
    ffn, fout = bda.flashinfer_fn(p, workspace=None)
    ffn()
    assert ((fout.float() - out.float()).abs().max() / out.float().abs().max()).item() < 1e-2


def test_baselines_flag_rejects_unknown_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        bda.main(["--baselines", "fa3"])


def test_time_baseline_fills_its_keys_or_records_the_error(monkeypatch):
    monkeypatch.setattr(bda, "time_graph", lambda fn, iters, flush: (fn() or 30.0, "graph"))
    ours = torch.ones(2, 3)
    r = {}
    bda.time_baseline(r, lambda: ((lambda: None), ours * 1.01), 3, None, ours, 10.0,
                      ("b_us", "b_mode", "b_speed", "b_diff"))
    assert r == {"b_us": 30.0, "b_mode": "graph", "b_speed": 3.0, "b_diff": 0.01}

    def broken():
        raise RuntimeError("no kernel for this shape")

    r = {}
    bda.time_baseline(r, broken, 3, None, ours, 10.0, ("b_us", "b_mode", "b_speed", "b_diff"))
    assert r == {"b_us": "error: RuntimeError: no kernel for this shape"}


def test_split_sweep_times_each_split_and_chunk_and_restores_the_reduce(monkeypatch):
    """--splits / --reduce-chunks: one row per (split count, chunk) with the launch's output
    against the served plan's (equal within bf16 rounding: the same attention, split
    differently), and the reduce's served chunk rule back afterwards."""
    monkeypatch.setitem(bda.SHAPES, "tiny", (4, 1, 16))
    ta = K.tree_attention
    served_rule = ta._reduce_chunk
    gen = torch.Generator().manual_seed(2)
    p = bda.DraftPoint(K.reference, "tiny", 1, 4, 300, gen, "cpu")
    fn, out, _ = bda.ours_fn(ta, p, validate=True)
    fn()
    seen = []

    def fake_time(f, iters, flush):  # runs the launch once, records the chunk it ran with
        seen.append(ta._reduce_chunk(16))
        f()
        return 1.0, "eager"

    monkeypatch.setattr(bda, "time_graph", fake_time)
    rows = bda.sweep_splits(ta, p, [1, 3], [1, 2], 0, 1, None, out)
    assert [(r["splits"], r["chunk"]) for r in rows] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    assert seen == [1, 2, 1, 2]
    assert all(r["rel_diff"] < 1e-2 for r in rows), rows
    assert ta._reduce_chunk is served_rule
