"""File formats: valid files load, invalid ones are refused with the file and the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpipe import formats
from hpipe.errors import HpipeError

EXAMPLE = Path(__file__).resolve().parent.parent / "profiles" / "examples" / "office.toml"


def test_example_inventory_loads():
    inv = formats.load_inventory(EXAMPLE)
    assert [h.name for h in inv.hosts] == ["workstation", "nas"]
    assert inv.hosts[1].port == 2222 and inv.hosts[0].port == 22
    assert inv.devices() == [("workstation", "cuda:0"), ("workstation", "cuda:1"), ("nas", "cpu")]
    assert inv.ssh.connect_timeout_s == 10


BASE = EXAMPLE.read_text()


@pytest.mark.parametrize("edit,needles", [
    (lambda s: s.replace('python = "/usr/bin/python3"', 'python = "python3"'), ("hosts[1].python", "absolute")),
    (lambda s: s.replace('devices = ["cpu"]', 'devices = ["gpu"]'), ("hosts[1].devices[0]", "gpu")),
    (lambda s: s.replace('name = "nas"', 'name = "workstation"'), ("hosts[1].name", "twice")),
    (lambda s: s.replace("port = 2222", "port = 70000"), ("hosts[1].port",)),
    (lambda s: s.replace("port = 2222", "prot = 2222"), ("hosts[1]", "unknown key 'prot'")),
    (lambda s: s.replace('address = "192.0.2.11"\n', ""), ("hosts[1]", "'address'")),
    (lambda s: s.replace("connect_timeout_s = 10", 'connect_timeout_s = "ten"'), ("ssh.connect_timeout_s",)),
    (lambda s: s.replace("version = 1", "version = 9"), ("version", "9")),
    (lambda s: s + "\n[[hosts]]\nname = 'x'\n", ("hosts[2]", "missing")),
    (lambda s: s.replace("[ssh]", "[ssh"), ("not valid TOML",)),
])
def test_bad_inventory_names_file_and_field(tmp_path, edit, needles):
    path = tmp_path / "cluster.toml"
    path.write_text(edit(BASE))
    with pytest.raises(HpipeError) as e:
        formats.load_inventory(path)
    msg = str(e.value)
    assert msg.startswith(str(path)), msg
    for n in needles:
        assert n in msg, msg


def sample_plan(**slicing):
    return formats.Plan(
        model=formats.ModelIdentity(name="m", family="llama", units=10, blocks=4, fingerprint="sha256:x"),
        stages=(formats.StagePlan("local", "cpu", (0, 4)), formats.StagePlan("local", "cuda:0", (4, 10))),
        slicing=formats.Slicing(**slicing))


# a profiled plan's figures as `hpipe plan --profile` writes them (hpipe/prediction.py), a few of each kind
PREDICTED = {"profile": "profile.json", "seq_len": 12, "batch": 2, "slices": [8, 4], "makespan_s": 0.5,
             "throughput_tokens_per_s": 48.0, "stage_busy_s": [0.2, 0.3], "slice_compute_s": [[0.1, 0.15], [0.05, 0.1]],
             "objective": "mixed", "overlap_sends": False, "assumptions": ["stages share cores"], "cut_search": {"method": "exhaustive"},
             "compare": [{"method": "GPipe", "cuts": [0, 5, 10], "makespan_s": 0.7}],
             "decode": {"new_tokens": 8, "rows_per_group": 1, "groups": 2, "context": 16.0, "stage_step_s": [0.01, 0.02],
                        "round_s": 0.04, "tokens_per_s": 50.0,
                        "terms": {"compute_s": [0.01, 0.02], "send_s": [0.001], "back_s": 0.002,
                                  "runtime_costs": "measured"}}}


def test_plan_round_trip(tmp_path):
    plan = sample_plan(count=3, lengths=(8, 4), granularity=4, by_seq_len={12: (8, 4)})
    formats.write_plan(plan, tmp_path / "p.json")
    assert formats.load_plan(tmp_path / "p.json") == plan
    data = {**plan.to_json(), "predicted": PREDICTED}
    (tmp_path / "q.json").write_text(json.dumps(data))
    profiled = formats.load_plan(tmp_path / "q.json")          # typed as read: the figures that decide things
    pr = profiled.pipeline_prediction
    assert pr.decode.terms.send_s == (0.001,) and pr.slice_compute_s[1] == (0.05, 0.1) and pr.objective == "mixed"
    assert pr.objective_s() == pytest.approx(2 * 8 / 50.0 + 0.5)
    formats.write_plan(profiled, tmp_path / "r.json")          # and written back as they were
    assert json.loads((tmp_path / "r.json").read_text())["predicted"] == PREDICTED


@pytest.mark.parametrize("edit,needles", [
    (lambda d: d.pop("version"), ("version",)),
    (lambda d: d.update(version=2), ("version", "2")),
    (lambda d: d["stages"][0].update(units=[0, 5]), ("stages[1].units", "starts at unit 4, expected 5")),
    (lambda d: d["stages"][1].update(units=[4, 9]), ("stages[1].units", "ends at unit 9")),
    (lambda d: d["stages"][1].update(units=[4, 4]), ("stages[1].units", "empty")),
    (lambda d: d["model"].update(units=11), ("model.units",)),
    (lambda d: d["slicing"].update(by_seq_len={"12": [8, 3]}), ("slicing.by_seq_len[12]", "sum to 12")),
    (lambda d: d.update(dtype="int4"), ("dtype", "int4")),
    (lambda d: d.update(extra=1), ("unknown key 'extra'",)),
    (lambda d: d.update(predicted={**PREDICTED, "makespan": 1.0}), ("predicted", "unknown key 'makespan'")),
    (lambda d: d.update(predicted={k: v for k, v in PREDICTED.items() if k != "slices"}), ("predicted", "'slices'")),
    (lambda d: d.update(predicted={**PREDICTED, "decode": {"round_s": 1.0}}), ("predicted.decode", "missing")),
    (lambda d: d.update(predicted={**PREDICTED, "stage_busy_s": [0.1, float("inf")]}), ("predicted.stage_busy_s",)),
    (lambda d: d.update(predicted=[1]), ("predicted", "an object")),
])
def test_bad_plan_names_file_and_field(tmp_path, edit, needles):
    data = sample_plan().to_json()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpipeError) as e:
        formats.load_plan(path)
    msg = str(e.value)
    assert msg.startswith(str(path))
    for n in needles:
        assert n in msg, msg


def test_slicing_rules():
    assert formats.Slicing(lengths=(10, 5)).slices_for(30) == [10, 20]      # the last takes the rest
    assert formats.Slicing(lengths=(10, 5)).slices_for(12) == [10, 2]       # cut short
    assert formats.Slicing(lengths=(10, 5)).slices_for(7) == [7]
    assert formats.Slicing(count=4, granularity=16).slices_for(100) == [32, 32, 32, 4]
    assert formats.Slicing(count=4, granularity=16).slices_for(10) == [3, 3, 3, 1]
    table = formats.Slicing(by_seq_len={64: (32, 20, 12)}, count=2)
    assert table.slices_for(64) == [32, 20, 12]
    assert table.slices_for(40) == [32, 8]                                  # from the next longer entry
    assert table.slices_for(100) == [64, 36]                                # beyond: the rule, granularity 16


@given(n=st.integers(1, 5000), count=st.integers(1, 40), g=st.integers(1, 64),
       lengths=st.lists(st.integers(1, 300), max_size=6))
def test_slices_always_cover_the_prompt(n, count, g, lengths):
    s = formats.Slicing(count=count, granularity=g, lengths=tuple(lengths)).slices_for(n)
    assert sum(s) == n and all(x >= 1 for x in s)
    if not lengths:
        assert len(s) <= count


def test_results_survive_a_torn_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    formats.append_result(path, {"id": "a", "output_ids": [1], "text": "x", "ttft_s": 0.1, "tpot_s": 0.0})
    with open(path, "a") as f:
        f.write('{"version": 1, "id": "b", "outp')
    assert [r["id"] for r in formats.load_results(path)] == ["a"]
