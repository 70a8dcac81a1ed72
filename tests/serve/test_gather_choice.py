"""``GatherChoice``: a lease read's gather, torch's or numpy's, chosen by timing both (a clock of the test's own)."""

from __future__ import annotations

from tensorwire.serve.client.gather_choice import GatherChoice

BIG = GatherChoice.MIN_BYTES


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(choice: GatherChoice, clock: Clock, seconds: dict[bool, float], calls: int, step: float) -> list[bool]:
    """``calls`` gathers of BIG bytes, ``step`` seconds apart, each taking ``seconds[torch?]``; which each used."""
    used = []
    for _ in range(calls):
        use = choice.pick(BIG)
        choice.took(use, BIG, seconds[use])
        used.append(use)
        clock.now += step
    return used


def test_small_gathers_are_torchs_and_not_timed():
    clock = Clock()
    choice = GatherChoice(clock)
    for _ in range(5):
        assert choice.pick(BIG - 1)
        choice.took(True, BIG - 1, 1.0)
        choice.took(False, BIG - 1, 1.0)
    assert choice.cost == [0.0, 0.0] and choice.torch


def _try_starts(used: list[bool], tried: bool) -> list[int]:
    return [i for i, u in enumerate(used) if u == tried and (i == 0 or used[i - 1] != tried)]


def test_both_are_timed_first_and_the_faster_kept_trying_the_other_less_often_while_it_loses():
    clock = Clock()
    choice = GatherChoice(clock)
    n = GatherChoice.TRY_CALLS
    # 20 s of calls every 10 ms, torch 3x faster
    used = _run(choice, clock, {True: 1e-4, False: 3e-4}, calls=2000, step=0.01)
    assert used[: 2 * n] == [False] * n + [True] * n  # numpy tried first, then torch (the default)
    assert choice.torch and choice.cost[0] > choice.cost[1] > 0
    starts = _try_starts(used, False)
    assert all(used[s : s + n] == [False] * n for s in starts)  # a try is TRY_CALLS calls
    gaps = [(b - a) * 0.01 for a, b in zip(starts, starts[1:])]
    # numpy tried 0.5 s after its first try, then 1, 2, 4, 8 s after the last try ended (it keeps losing)
    assert [round(g, 1) for g in gaps] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert choice.torch


def test_a_torch_gather_slowed_by_busy_cores_hands_over_to_numpy_and_back_when_they_are_free():
    clock = Clock()
    choice = GatherChoice(clock)
    n = GatherChoice.TRY_CALLS
    busy = {True: 20e-3, False: 1e-3}  # an OpenMP team spinning on cores other work holds
    used = _run(choice, clock, busy, calls=3 * n, step=0.01)
    assert used == [False] * n + [True] * n + [False] * n  # TRY_CALLS slow torch gathers, then numpy
    used = _run(choice, clock, busy, calls=1000, step=0.01)  # 10 s: torch tried 0.5, 1, 2, 4 s apart
    assert len(_try_starts(used, True)) <= 4 and not choice.torch
    free = {True: 0.2e-3, False: 1e-3}
    used = _run(choice, clock, free, calls=1000, step=0.01)  # the next try of torch wins: torch from then on
    first = used.index(True)
    after = used[first + n :]
    assert all(after[:40]) and len(_try_starts(after, False)) <= 4  # numpy only as tries, 0.5, 1, 2, 4 s apart
    assert choice.torch


def test_one_slow_call_decides_nothing():
    clock = Clock()
    choice = GatherChoice(clock)
    n = GatherChoice.TRY_CALLS
    # numpy's first try, then torch's first calls, one of them hit by page faults (a new mapping)
    times = iter([3e-4, 3e-4, 3e-4, 50e-3, 1e-4, 1e-4, 1e-4, 1e-4, 40e-3, 1e-4, 1e-4])
    used = []
    for t in times:
        use = choice.pick(BIG)
        choice.took(use, BIG, t)
        used.append(use)
        clock.now += 0.01
    assert used == [False] * n + [True] * (len(used) - n)  # torch throughout: each spike a lone call
    assert choice.torch and abs(choice.cost[1] * BIG - 1e-4) < 1e-9  # the median of its last calls


def test_a_change_brings_the_next_try_near_again():
    clock = Clock()
    choice = GatherChoice(clock)
    _run(choice, clock, {True: 1e-4, False: 3e-4}, calls=400, step=0.01)  # numpy loses: tries drift apart
    assert choice._every > GatherChoice.EXPLORE_FIRST
    # torch slows below numpy's last try: numpy takes over, and torch is tried again EXPLORE_FIRST later
    used = _run(choice, clock, {True: 1e-3, False: 3e-4}, calls=200, step=0.01)
    flip = used.index(False)  # once most of torch's last five calls are slower than numpy's try
    assert flip == GatherChoice.RECENT // 2 + 1 and not choice.torch
    again = used.index(True, flip)
    assert again <= flip + GatherChoice.EXPLORE_FIRST / 0.01 + 1
