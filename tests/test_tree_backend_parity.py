"""The start-up parity gate in front of a kernel tree builder."""

import logging

import torch

from sglang_ddtree import tree_backend
from sglang_ddtree.tree import build_tree


def _same_as_torch(root, logp, ids, budget, out=None):
    return build_tree(root, logp, ids, budget, out)


def _off_by_one(root, logp, ids, budget, out=None):
    t = build_tree(root, logp, ids, budget, out)
    t.tokens[:, 1:] += 1
    return t


def test_matching_builder_is_kept(monkeypatch):
    monkeypatch.setattr(tree_backend, "get_tree_builder", lambda: _same_as_torch)
    assert tree_backend.verified_tree_builder(16, 7, 8, "cpu") is _same_as_torch


def test_mismatching_builder_is_refused_loudly(monkeypatch, caplog):
    monkeypatch.setattr(tree_backend, "get_tree_builder", lambda: _off_by_one)
    with caplog.at_level(logging.ERROR):
        assert tree_backend.verified_tree_builder(16, 7, 8, "cpu") is build_tree
    assert "failed the start-up parity check" in caplog.text and "tokens" in caplog.text


def test_parity_inputs_have_ties_and_neg_inf():
    root, logp, ids = tree_backend._parity_inputs(3, 5, 16, "cpu", 0)
    assert torch.isinf(logp).any()
    finite = logp[torch.isfinite(logp)]
    assert finite.unique().numel() < finite.numel()  # exact ties present
    assert (logp[..., 1:] <= logp[..., :-1]).all()
