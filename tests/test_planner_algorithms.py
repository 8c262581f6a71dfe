"""HPipe's Algorithm 1 (exact DP with memory limits) and Algorithm 2 (token slicing) against
brute force, and the simulator against the flow-shop recurrence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hpipe.planner.partition import Infeasible, partition_layers
from hpipe.planner.simulate import simulate
from hpipe.planner.slicing import slice_sequence


def brute_force(unit_time, out_comm, unit_mem, device_mem, overlap=False):
    d, u = unit_time.shape
    best, best_cuts = np.inf, None
    for interior in itertools.combinations(range(1, u), d - 1):
        cuts = [0, *interior, u]
        if any(unit_mem[a:b].sum() > device_mem[j] for j, (a, b) in enumerate(zip(cuts, cuts[1:]))):
            continue
        join = max if overlap else (lambda x, y: x + y)
        worst = max(join(unit_time[j, a:b].sum(), out_comm[j, b - 1]) for j, (a, b) in enumerate(zip(cuts, cuts[1:])))
        if worst < best:
            best, best_cuts = worst, cuts
    return best, best_cuts


@settings(max_examples=300, deadline=None)
@given(data=st.data(), d=st.integers(1, 4), u=st.integers(1, 9), overlap=st.booleans())
def test_partition_reaches_the_brute_force_optimum(data, d, u, overlap):
    if d > u:
        d = u
    floats = st.floats(0.0, 10.0, allow_nan=False)
    unit_time = np.array(data.draw(st.lists(st.lists(floats, min_size=u, max_size=u), min_size=d, max_size=d)))
    out_comm = np.array(data.draw(st.lists(st.lists(floats, min_size=u, max_size=u), min_size=d, max_size=d)))
    out_comm[-1] = 0.0
    # memory in bytes: integers (float64 sums of integers are exact)
    unit_mem = np.array(data.draw(st.lists(st.integers(0, 5 << 30), min_size=u, max_size=u)), dtype=float)
    device_mem = np.array(data.draw(st.lists(st.integers(0, 20 << 30), min_size=d, max_size=d)), dtype=float)
    best, cuts = brute_force(unit_time, out_comm, unit_mem, device_mem, overlap)
    if cuts is None:
        with pytest.raises(Infeasible):
            partition_layers(unit_time, out_comm, unit_mem, device_mem, overlap=overlap)
        return
    part = partition_layers(unit_time, out_comm, unit_mem, device_mem, overlap=overlap)
    assert part.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert part.cuts[0] == 0 and part.cuts[-1] == u and all(a < b for a, b in zip(part.cuts, part.cuts[1:]))
    for j, (a, b) in enumerate(zip(part.cuts, part.cuts[1:])):
        assert unit_mem[a:b].sum() <= device_mem[j] * (1 + 1e-9)
        assert part.stage_times[j] <= part.bottleneck + 1e-12


def test_infeasible_names_device_and_shortfall():
    with pytest.raises(Infeasible) as e:
        partition_layers(np.ones((2, 4)), np.zeros((2, 4)), unit_mem=[3, 3, 3, 3], device_mem=[6, 4],
                         device_names=["box/cuda:0", "box/cuda:1"])
    assert "box/cuda:1" in str(e.value) and "short by" in str(e.value)


@given(st.lists(st.lists(st.floats(0.0, 5.0), min_size=3, max_size=3), min_size=1, max_size=6))
def test_simulate_is_the_flow_shop_recurrence(t):
    t = np.array(t)
    m, d = t.shape
    c = np.zeros((m + 1, d + 1))
    for i in range(1, m + 1):
        for j in range(1, d + 1):
            c[i, j] = max(c[i - 1, j], c[i, j - 1]) + t[i - 1, j - 1]
    assert simulate(t).makespan == pytest.approx(c[m, d])


def test_simulate_with_sends():
    # two slices, two stages; sends of 1 s overlap the next compute on stage 0
    tl = simulate([[2, 1], [2, 1]], comm=[[1, 0], [1, 0]])
    # slice 0: stage 0 [0,2], sent at 3, stage 1 [3,4]; slice 1: stage 0 [2,4], sent at 5, stage 1 [5,6]
    assert tl.makespan == 6
    assert tl.start.tolist() == [[0, 3], [2, 5]]


def all_slicings(n):
    for k in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            yield [b - a for a, b in zip(bounds, bounds[1:])]


def slicing_objective(tau, lengths, n_stages):
    starts = np.cumsum([0] + lengths[:-1])
    costs = tau[lengths, starts]
    return costs.sum() + (n_stages - 1) * costs.max()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 9), n_stages=st.integers(1, 6), ties=st.booleans())
def test_slicing_reaches_the_brute_force_optimum(data, n, n_stages, ties):
    values = st.integers(0, 6).map(float) if ties else st.floats(0.0, 10.0, allow_nan=False)
    tau = np.array(data.draw(st.lists(st.lists(values, min_size=n + 1, max_size=n + 1), min_size=n + 1,
                                      max_size=n + 1)))
    best = min(slicing_objective(tau, lengths, n_stages) for lengths in all_slicings(n))
    result = slice_sequence(tau, n_stages)
    assert sum(result.lengths) == n and min(result.lengths) >= 1
    assert result.objective == pytest.approx(best, abs=1e-9)
    assert slicing_objective(tau, result.lengths, n_stages) == pytest.approx(result.objective, abs=1e-9)


def test_slicing_puts_longer_slices_first_when_context_costs():
    # attention grows with context: the optimum slices get shorter along the prompt (HPipe §3.4)
    n = 64
    s = np.arange(n + 1)[:, None]
    c = np.arange(n + 1)[None, :]
    result = slice_sequence(1.0 + 0.5 * s + 0.02 * s * (c + s / 2), n_stages=4)
    assert len(result.lengths) > 1
    assert result.lengths == sorted(result.lengths, reverse=True)


def test_split_orders_keep_every_device_once():
    from hpipe.planner.search import split_orders

    order = [("a", "0"), ("a", "1"), ("a", "2"), ("b", "0"), ("b", "1"), ("c", "0")]
    variants = split_orders(order)
    assert variants and all(sorted(v) == sorted(order) for v in variants)
    assert [("a", "0"), ("b", "0"), ("b", "1"), ("a", "1"), ("a", "2"), ("c", "0")] in variants
    # a host's devices end up in two runs, around exactly one other host's run
    for v in variants:
        runs = [h for i, (h, _) in enumerate(v) if i == 0 or v[i - 1][0] != h]
        assert len(runs) == 4 and len(set(runs)) == 3


from hpipe.planner.cuts import TIE  # noqa: E402


def _cut_costs(rng, d, u, m, capacity=None):
    from hpipe.planner.cuts import CutCosts

    unit = rng.uniform(0.1, 2.0, size=(d, m, u)) * rng.uniform(0.3, 3.0, size=(d, 1, 1))   # devices differ
    compute = np.concatenate([np.zeros((d, m, 1)), np.cumsum(unit, axis=2)], axis=2)
    send = rng.uniform(0.0, 1.5, size=(max(d - 1, 0), m, u + 1))
    mem = rng.uniform(1.0, 3.0, size=u)
    cap = np.full(d, np.inf) if capacity is None else np.full(d, capacity)
    return CutCosts(compute=compute, send=send, memory=np.concatenate([[0.0], np.cumsum(mem)]), capacity=cap,
                    prefill_weight=1.0), unit, send, mem


def _simulated(unit, send, cuts):
    """The plain simulator (simulate.py) on these cuts: the independent reference."""
    d, m = unit.shape[:2]
    t = np.stack([unit[j, :, a:b].sum(axis=1) for j, (a, b) in enumerate(zip(cuts, cuts[1:]))], axis=1)
    comm = np.zeros((m, d))
    for j in range(d - 1):
        comm[:, j] = send[j, :, cuts[j + 1]]
    return simulate(t, comm).makespan


@pytest.mark.parametrize("seed", range(12))
def test_cut_search_reaches_the_simulators_optimum(seed):
    from hpipe.planner.cuts import search_cuts

    rng = np.random.default_rng(seed)
    d, u, m = int(rng.integers(2, 5)), int(rng.integers(5, 11)), int(rng.integers(1, 7))
    capacity = None if seed % 3 else float(rng.uniform(4.0, 12.0))
    costs, unit, send, mem = _cut_costs(rng, d, u, m, capacity)
    best, best_cuts = np.inf, None
    for interior in itertools.combinations(range(1, u), d - 1):   # brute force with the plain simulator
        cuts = [0, *interior, u]
        if capacity is not None and any(mem[a:b].sum() > capacity for a, b in zip(cuts, cuts[1:])):
            continue
        value = _simulated(unit, send, cuts)
        if value < best:
            best, best_cuts = value, cuts
    found = search_cuts(costs, [])
    if best_cuts is None:
        assert found.value == np.inf
        return
    assert found.method == "exhaustive"
    assert best * (1 - 1e-12) <= found.value <= best * (1 + TIE)       # ties within TIE go to the balanced cuts
    assert _simulated(unit, send, found.cuts) == pytest.approx(found.value, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_local_cut_search_is_never_worse_than_its_starts(seed):
    from hpipe.planner.cuts import objective_values, search_cuts
    from hpipe.planner.uniform import uniform_cuts

    rng = np.random.default_rng(100 + seed)
    d, u, m = 6, 30, 8
    costs, unit, send, _ = _cut_costs(rng, d, u, m)
    starts = [[0, *uniform_cuts(u, d), u], [0, *sorted(rng.choice(np.arange(1, u), d - 1, replace=False)), u]]
    found = search_cuts(costs, starts, exhaustive=1000)
    assert found.method == "local search"
    assert found.value <= min(objective_values(costs, starts)) * (1 + 1e-12)
    assert _simulated(unit, send, found.cuts) == pytest.approx(found.value, rel=1e-9)
    exact = search_cuts(costs, [])                     # C(29, 5) = 118,755 candidates: all of them
    assert exact.method == "exhaustive" and exact.value <= found.value * (1 + TIE)


@settings(max_examples=100, deadline=None)
@given(t=arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 4)), elements=st.floats(0.01, 5.0)),
       data=st.data())
def test_shared_cores_are_the_recurrence_while_nobody_waits_for_a_core(t, data):
    from hpipe.planner.simulate import Sharing, simulate_shared

    comm = np.array(data.draw(arrays(np.float64, t.shape, elements=st.floats(0.0, 2.0))))
    d = t.shape[1]
    enough = Sharing(tuple("m" for _ in range(d)), tuple(1 for _ in range(d)), {"m": d})
    a, b = simulate(t, comm), simulate_shared(t, comm, enough)
    assert np.allclose(a.start, b.start) and np.allclose(a.end, b.end) and b.makespan == pytest.approx(a.makespan)


def test_stages_sharing_one_core_split_it():
    """Processor sharing, by hand: two stages on one core, two slices of 1 s each. Slice 0 runs alone
    on stage 0 (0-1 s); then slice 1 on stage 0 and slice 0 on stage 1 share the core (1-3 s, half
    speed each); slice 1 on stage 1 runs alone (3-4 s). A GPU stage (machine None) never waits."""
    from hpipe.planner.simulate import Sharing, simulate_shared

    tl = simulate_shared(np.ones((2, 2)), None, Sharing(("m", "m"), (1, 1), {"m": 1}))
    assert tl.start.tolist() == [[0, 1], [1, 3]] and tl.end.tolist() == [[1, 3], [3, 4]] and tl.makespan == 4
    free = simulate_shared(np.ones((2, 2)), None, Sharing(("m", None), (1, 1), {"m": 1}))
    assert free.makespan == simulate(np.ones((2, 2))).makespan == 3
