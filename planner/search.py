"""Device order and device choice (`hpipe plan --order search`, `--allow-drop`).

HPipe fixes the device order (§3.3); a commodity cluster's links differ enough that the order
matters: a slow link crossed by a stage that also computes little is a waste. Candidate orders
keep the devices of one host adjacent and permute the hosts; a networkx graph of the hosts, with
each link's bandwidth on its edge, ranks the host orders by their slowest hop, and the best
ranked are planned in full (partition and slicing) and compared by predicted makespan.
Then, for the best of those, the orders that split one host's devices around another host ("unless
splitting them pays"). `--allow-drop` also tries every plan that leaves out one device, and keeps
it only if it is faster.
"""

from __future__ import annotations

import dataclasses
import itertools

from hpipe import formats, models
from hpipe.errors import HpipeError
from hpipe.planner.partition import Infeasible
from hpipe.planner.compare import compare
from hpipe.planner.profiled import PlanResult, decode_prediction, objective_seconds, plan_from_profile

MAX_ORDERS = 8


def host_graph(profile: formats.Profile, devices: list[tuple[str, str]]) -> "nx.Graph":
    import networkx as nx     # here: ~0.2 s to import, for a search few commands make

    graph = nx.Graph()
    hosts = list(dict.fromkeys(h for h, _ in devices))
    graph.add_nodes_from(hosts)
    ids = {f"{h}/{d}": h for h, d in devices}
    for link in profile.links:
        a, b = ids.get(link.src), ids.get(link.dst)
        if a and b and a != b:
            bw = link.beta_bytes_per_s
            if not graph.has_edge(a, b) or graph[a][b]["bandwidth"] > bw:
                graph.add_edge(a, b, bandwidth=bw)
    return graph


def candidate_orders(profile: formats.Profile, devices: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    by_host: dict[str, list[tuple[str, str]]] = {}
    for h, d in devices:
        by_host.setdefault(h, []).append((h, d))
    graph = host_graph(profile, devices)
    ranked = []
    for perm in itertools.permutations(by_host):
        hops = [graph[a][b]["bandwidth"] if graph.has_edge(a, b) else 0.0 for a, b in zip(perm, perm[1:])]
        ranked.append((-(min(hops) if hops else float("inf")), list(perm) != list(by_host), perm))
    ranked.sort()
    orders = [[dev for host in perm for dev in by_host[host]] for _, _, perm in ranked[:MAX_ORDERS]]
    if devices not in orders:
        orders.insert(0, list(devices))
    return orders


def split_orders(order: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Orders that split one host's run of devices in two around the neighbouring host's run."""
    runs: list[list[tuple[str, str]]] = []
    for dev in order:
        if runs and runs[-1][0][0] == dev[0]:
            runs[-1].append(dev)
        else:
            runs.append([dev])
    out = []
    for i, run in enumerate(runs):
        for j in (i - 1, i + 1):
            if not 0 <= j < len(runs):
                continue
            lo, hi = min(i, j), max(i, j)
            for k in range(1, len(run)):
                middle = [run[:k], runs[j], run[k:]]
                out.append([d for r in runs[:lo] + middle + runs[hi + 1:] for d in r])
    return out


def without_host_cpus(order: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """For a MoE model: the order without the CPU of a host that also has a GPU in it, one host at a
    time. That CPU may serve its GPU's stage better by running the experts the GPU cannot hold
    from the host's RAM (`planner/placement.py`) than as a stage of its own."""
    gpu_hosts = {h for h, d in order if d != "cpu"}
    return [[x for x in order if x != (h, "cpu")] for h in dict.fromkeys(h for h, d in order)
            if h in gpu_hosts and (h, "cpu") in order and len(order) > 1]


def needs_search(config, devices: list[tuple[str, str]], order: str, allow_drop: bool) -> bool:
    """Whether planning tries more than the inventory's devices in its order: with `--order search`
    or `--allow-drop`, and for a MoE model on a host with a GPU and its CPU (`without_host_cpus`)."""
    return order == "search" or allow_drop or (models.is_moe(config) and bool(without_host_cpus(devices)))


def plan_profiled(profile, profile_path, name, config, devices, seq_len, batch, slicing, margin, dtype, granularity,
                  order: str = "inventory", allow_drop: bool = False, log=None, overlap: bool = False,
                  objective: str = "prefill", new_tokens: int = 128, speculation: tuple[int, float] | None = None,
                  compare_baselines: bool = False) -> PlanResult:
    """`hpipe plan --profile`: the best plan over `devices` (the orders and choices of devices
    searched where `needs_search` says so), with everything it predicts in its one Prediction: its
    decode also with speculative decoding where `speculation` is given (K, the share of proposals
    a run accepted) and the paper's baselines beside it where `compare_baselines` (`--compare`)."""
    kw = dict(overlap=overlap, objective=objective, new_tokens=new_tokens)
    if needs_search(config, devices, order, allow_drop):
        result = search_plan(profile, profile_path, name, config, devices, seq_len, batch, slicing, margin, dtype,
                             granularity, order, allow_drop, log=log, **kw)
    else:
        result = plan_from_profile(profile, profile_path, name, config, devices, seq_len, batch, slicing, margin,
                                   dtype, granularity, **kw)
    pr = result.plan.predicted
    if speculation is not None:
        if pr.decode is None:
            raise HpipeError(f"{profile_path}: a device has no decode table; profile it again (`hpipe profile`) to "
                             f"predict decode with --speculative")
        pr = dataclasses.replace(pr, decode=decode_prediction(result.cost, result.cuts, batch, seq_len, new_tokens,
                                                              speculation))
    if compare_baselines:
        pr = dataclasses.replace(pr, compare=tuple(compare(result, granularity)))
    return dataclasses.replace(result, plan=dataclasses.replace(result.plan, predicted=pr))


def search_plan(profile, profile_path, name, config, devices, seq_len, batch, slicing, margin, dtype, granularity,
                order: str = "inventory", allow_drop: bool = False, log=None, overlap: bool = False,
                objective: str = "prefill", new_tokens: int = 128) -> PlanResult:
    tried, errors = [], []

    def plan_on(devs, note: str = "") -> PlanResult | None:
        """The plan over `devs`, noted among the candidates (None where it cannot be made)."""
        names = [f"{h}/{d}" for h, d in devs]
        try:
            result = plan_from_profile(profile, profile_path, name, config, devs, seq_len, batch, slicing, margin,
                                       dtype, granularity, overlap=overlap, objective=objective,
                                       new_tokens=new_tokens)
        except (Infeasible, HpipeError) as e:
            errors.append(e)
            tried.append({"devices": names, "error": str(e)})
            return None
        seconds = objective_seconds(result)
        tried.append({"devices": names, "makespan_s": result.timeline.makespan, "objective_s": seconds})
        if log:
            log(f"  {' -> '.join(names)}{note}: {seconds:.3f} s")
        return result

    def better(result, best) -> bool:
        return result is not None and (best is None or
                                       objective_seconds(result) < objective_seconds(best) * (1 - 1e-9))

    best = None
    for candidate in (candidate_orders(profile, devices) if order == "search" else [list(devices)]):
        options = [candidate]
        if allow_drop and len(candidate) > 1:
            options += [candidate[:i] + candidate[i + 1:] for i in range(len(candidate))]
        if models.is_moe(config):
            options += [o for o in without_host_cpus(candidate) if o not in options]
        for devs in options:
            result = plan_on(devs)
            best = result if better(result, best) else best
    if best is None:
        raise errors[0]
    if order == "search":
        for devs in split_orders([(st.host, st.device) for st in best.plan.stages]):
            result = plan_on(devs, " (split)")
            best = result if better(result, best) else best
    plan = dataclasses.replace(best.plan, predicted=dataclasses.replace(
        best.plan.predicted, candidates=tuple(tried), order=order, allow_drop=allow_drop))
    return dataclasses.replace(best, plan=plan)
