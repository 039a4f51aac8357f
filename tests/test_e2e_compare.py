"""scripts/e2e_lossless.py: how a divergence from plain greedy is judged (near tie or mismatch)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import e2e_lossless  # noqa: E402


class FakeAR:
    """Answers the top-8 log-prob query with a fixed table per (prompt + prefix) length."""

    def __init__(self, tops):
        self.tops = tops

    def generate(self, ids, n, logprob=False):
        assert n == 1 and logprob
        return {"meta_info": {"output_top_logprobs": [self.tops[len(ids)]]}}


def test_divergence_judged_by_the_emitted_tokens_own_gap():
    prompts = [[1, 2], [1, 2], [1, 2], [1, 2]]
    ref = [[5, 6, 7]] * 4
    outs = [[5, 6, 7],      # identical
            [5, 9, 7],      # token 9 is third but within 0.25 of the best: near tie
            [5, 8, 7],      # token 8 is 1.0 below the best: mismatch
            [5, 4, 7]]      # token 4 is not in the top-8 at all: mismatch
    top = [(-1.0, 6, ""), (-1.05, 3, ""), (-1.2, 9, ""), (-2.0, 8, "")]
    ident, near, bad = e2e_lossless.compare(FakeAR({3: top}), prompts, outs, ref, 0.25, "t")
    assert (ident, near) == (1, 1)
    assert [m["ddtree_token"] for m in bad] == [8, 4]
    assert abs(bad[0]["ddtree_token_gap"] - 1.0) < 1e-9
    assert bad[1]["ddtree_token_gap"] is None
    assert bad[0]["position"] == 1 and abs(bad[0]["top2_gap"] - 0.05) < 1e-9


def test_shorter_output_is_a_divergence_at_its_end():
    assert e2e_lossless.first_diff([1, 2], [1, 2, 3]) == 2
    assert e2e_lossless.first_diff([1, 2, 3], [1, 2, 3]) is None


class FakeSeeded:
    """A server whose output is a function of (prompt, params): seeded draws by hashing, greedy
    the prompt's last token counting up. ``flaky`` adds a per-call counter to every output."""

    def __init__(self, flaky=False):
        self.calls, self.flaky = 0, flaky

    def generate(self, ids, n, params=None, logprob=False):
        self.calls += 1
        seed = (params or {}).get("sampling_seed")
        base = ids[-1] if seed is None else hash((tuple(ids), seed)) % 1000
        out = [base + i for i in range(n)]
        if self.flaky and seed is not None:
            out[-1] += self.calls
        return {"output_ids": out, "meta_info": {"completion_tokens": n, "spec_verify_ct": n}}


def test_deterministic_checks_pass_a_seeded_server_and_catch_a_flaky_one():
    prompts = [[i, i + 1] for i in range(10)]
    good = e2e_lossless.deterministic_checks(FakeSeeded(), FakeSeeded(), prompts, 4, 0.25, "t")
    assert good["greedy"]["identical"] == 10 and not good["greedy"]["mismatches"]
    s = good["seeded"]
    assert s["all_reproducible"] and s["equal_to_ar"] == 8 and s["other_seed_differs"] == 8
    flaky = e2e_lossless.deterministic_checks(FakeSeeded(), FakeSeeded(flaky=True), prompts, 4,
                                              0.25, "t")
    assert not flaky["seeded"]["all_reproducible"]
    assert flaky["seeded"]["rows"][0]["first_divergence_from_ar"] == 3


def test_port_free_sees_a_listener():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert not e2e_lossless.port_free(port)
    assert e2e_lossless.port_free(port)


def test_case_wave_caps_the_servers_at_once():
    # 0: every case's server at once (the H200's default); else at most that many
    assert e2e_lossless.case_wave(8, 0) == 8
    assert e2e_lossless.case_wave(8, 3) == 3
    assert e2e_lossless.case_wave(2, 3) == 2
    assert e2e_lossless.case_wave(0, 3) == 0
