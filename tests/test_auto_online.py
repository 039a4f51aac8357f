"""The online budget controller (SGLANG_DDTREE_AUTO_MODE=online) against simulated servers."""

import types

import pytest

from sglang_ddtree.auto_online import OnlineBudgetController, bucket_of

ACCEPT = {8: 1.8, 32: 2.1, 64: 2.2}  # the tiny pair's greedy accept lengths, session 5


def simulate(ctrl, bs, step_ms, steps, lag=2, accept=ACCEPT):
    """Run ``steps`` decode steps of ``bs`` requests; a step with budget b takes step_ms(bs, b)
    and its tokens reach the requests ``lag`` steps later (overlap scheduling). Returns the
    budgets chosen, in order."""
    t, chosen, pending = 0.0, [], []
    reqs = [types.SimpleNamespace(rid=f"r{i}", output_ids=[0]) for i in range(bs)]
    for _ in range(steps):
        while len(pending) >= lag:  # the scheduler processed an older step's results
            b_old = pending.pop(0)
            for r in reqs:
                r.carry = getattr(r, "carry", 0.0) + accept[b_old]
                whole = int(r.carry)
                r.carry -= whole
                r.output_ids.extend([0] * whole)
        b = ctrl.step(bs, ctrl.emitted_since_last(reqs), t)
        chosen.append(b)
        pending.append(b)
        t += step_ms(bs, b) / 1e3
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_host_bound_steps_pick_the_widest_tree():
    """Every budget costs the same step (the tiny pair on the H200): the best accept wins."""
    ctrl = OnlineBudgetController([8, 32, 64], window=16, exploit=200)
    chosen = simulate(ctrl, 1, lambda bs, b: 4.0, 400)
    assert chosen[:48] == [64] * 16 + [32] * 16 + [8] * 16  # exploration, widest first
    assert set(chosen[48:248]) == {64}  # then the best, for an exploit period
    assert ctrl.report()["1"]["best"] == 64
    row = ctrl.report()["1"]["64"]
    assert row["accept"] == pytest.approx(2.2, abs=0.1) and row["step_ms"] == pytest.approx(4.0)


def test_gpu_bound_steps_pick_a_small_tree_at_large_batches():
    """Verify cost grows with the width at batch 32 (the Kimi-shape curve): b8 wins there while
    b64 still wins at batch 1, each bucket on its own."""
    def step_ms(bs, b):
        return 5.0 + (0.2 if bs == 1 else 0.2 * bs * (b + 1) / 33)

    ctrl = OnlineBudgetController([8, 32, 64], window=16, exploit=200)
    big = simulate(ctrl, 32, step_ms, 300)
    small = simulate(ctrl, 1, step_ms, 300)
    assert set(big[48:248]) == {8} and ctrl.report()["32"]["best"] == 8
    assert set(small[48:248]) == {64} and ctrl.report()["1"]["best"] == 64


def test_it_follows_a_change_after_an_exploit_period():
    """Cost regime flips (the host gets busy): re-exploration moves to the new best."""
    regime = {"gpu": True}

    def step_ms(bs, b):
        return 5.0 + (0.2 * bs * (b + 1) / 33 if regime["gpu"] else 0.0)

    ctrl = OnlineBudgetController([8, 64], window=16, exploit=64)
    first = simulate(ctrl, 32, step_ms, 32 + 64)
    assert first[-64:] == [8] * 64
    regime["gpu"] = False
    # a fresh round: the incumbent 8 first, then 64; then 64 for an exploit period
    later = simulate(ctrl, 32, step_ms, 32 + 64)
    assert later == [8] * 16 + [64] * 16 + [64] * 64


def test_an_interval_across_another_forward_is_dropped():
    ctrl = OnlineBudgetController([8], window=4, exploit=8)
    ctrl.step(1, 0, 0.0)
    ctrl.other_forward()  # a prefill ran in between: this interval is not a decode step's
    ctrl.step(1, 0, 10.0)
    ctrl.step(1, 0, 10.004)
    s = ctrl._buckets[1].stats[8]
    assert s.intervals == 1 and s.ms == pytest.approx(4.0)


def test_emitted_tokens_count_per_request_and_new_requests_from_their_length():
    ctrl = OnlineBudgetController([8])
    a = types.SimpleNamespace(rid="a", output_ids=[1, 2])
    assert ctrl.emitted_since_last([a]) == 0
    a.output_ids += [3, 4, 5]
    b = types.SimpleNamespace(rid="b", output_ids=[9] * 7)  # joined: counted from now on
    assert ctrl.emitted_since_last([a, b]) == 3
    b.output_ids.append(1)
    assert ctrl.emitted_since_last([b]) == 1  # a finished and left


def test_bad_arguments():
    with pytest.raises(ValueError):
        OnlineBudgetController([])
    with pytest.raises(ValueError):
        OnlineBudgetController([8], lag=0)


def test_tp_ranks_with_different_timings_take_rank_0s_choice():
    """Two ranks time the same schedule differently (rank 1 sees a GPU-bound step, rank 0 a
    host-bound one); at the end of each round both use rank 0's choice, so they never verify
    different widths."""
    rank0_choices = []
    calls = iter(range(1000))

    def agree_rank0(local):  # what broadcast_object(src=0) returns: rank 0's i-th choice
        return rank0_choices[next(calls)]

    def record_rank0(local):
        rank0_choices.append(local)
        return local

    r0 = OnlineBudgetController([8, 64], window=8, exploit=32, agree=record_rank0)
    r1 = OnlineBudgetController([8, 64], window=8, exploit=32, agree=agree_rank0)
    host_bound = simulate(r0, 16, lambda bs, b: 5.0, 100)
    gpu_bound = simulate(r1, 16, lambda bs, b: 5.0 + 0.3 * (b + 1), 100)
    assert host_bound == gpu_bound  # same budget at every step
    assert rank0_choices and set(rank0_choices) == {64}
