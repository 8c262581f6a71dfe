"""SiDP's planner (`hpipe plan --mode sidp`): owners against a brute-force optimum, the
peak-shifting order, the memory model against a real model's own parameter bytes, and the plan
file it writes."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from hpipe import formats, models
from hpipe.cli import main
from hpipe.errors import HpipeError
from hpipe.planner import sidp


def test_owners_are_interleaved_on_equal_devices_and_near_the_optimum_otherwise():
    assert sidp.assign_owners([5.0] * 8, [10.0] * 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    rng = random.Random("owners")
    for _ in range(30):
        d = rng.randint(2, 3)
        ffn = [rng.uniform(1, 4) for _ in range(rng.randint(3, 8))]
        free = [rng.uniform(5, 20) for _ in range(d)]
        owners = sidp.assign_owners(ffn, free)

        def worst(assign):
            return max(sum(b for b, o in zip(ffn, assign) if o == i) / free[i] for i in range(d))

        best = min(worst(a) for a in itertools.product(range(d), repeat=len(ffn)))
        # greedy list scheduling on related machines: within one layer's share of the optimum
        assert worst(owners) <= best + max(ffn) / min(free) + 1e-12


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_peak_shifting_fetches_every_remote_block_once_and_spreads_the_owners(d):
    blocks = 4 * d + 1
    owners = sidp.assign_owners([1.0] * blocks, [1.0] * d)
    group = formats.SidpGroupPlan("h", tuple(range(d)), tuple(owners), d - 1, "host-pool")
    orders = [group.prefetch_order(r) for r in range(d)]
    assert all(group.slots_needed(r) == d - 1 for r in range(d))
    for r, order in enumerate(orders):
        assert sorted(order) == [b for b in range(blocks) if owners[b] != r]
    # the k-th fetch of every rank inside a full cycle reads a different owner: no incast
    for k in range(4 * (d - 1)):
        assert len({owners[order[k]] for order in orders}) == d


def test_replica_memory_follows_the_models_own_parameter_bytes(tiny_models):
    """Weights a SiDP replica holds, from the model's own modules (not from unit_bytes): all but the
    MLP halves, plus those of the blocks it owns, plus one slot per other replica of the largest."""
    path = tiny_models["llama"]
    config = models.load_config(path)
    model = models.build_full_model(path, config)
    # a block's MLP half as the runtime runs it: its norm and its MLP
    mlp = [sum(p.numel() * p.element_size() for m in (layer.post_attention_layernorm, layer.mlp) for p in m.parameters())
           for layer in model.model.layers]
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    d, free = 3, 10 ** 8
    members = [sidp.Member(f"r{i}", free, lambda b, c: 1e-3 * b, lambda b: 1e-4, 1e9, 1e-5, 1e9) for i in range(d)]
    group = sidp.plan_group(config, members, models.unit_bytes(config, "float32"), "peer", 64, 16, max_batch=8)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * \
        (config.hidden_size // config.num_attention_heads) * 4
    for i in range(d):
        owned = sum(b for b, o in zip(mlp, group.owners) if o == i)
        held = total - sum(mlp) + owned + (d - 1) * max(mlp)
        assert group.weight_bytes[i] == pytest.approx(held)
        assert group.kv_tokens[i] == pytest.approx((free - held) / kv_per_token)
        assert group.dp_kv_tokens[i] == pytest.approx((free - total) / kv_per_token)


def test_the_switch_point_is_where_was_stops_losing_to_cas():
    """T(B) grows with B, the fetch does not: B_th is the first batch of the grid at which WaS (the
    larger of T and the fetch) is no slower than CaS, and every batch below it is faster in CaS."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    unit = models.unit_bytes(config, "float32")
    members = [sidp.Member(f"r{i}", 1e9, lambda b, c: 0.002 * b, lambda b: 1e-4, 1e6, 1e-5, 1e9) for i in range(2)]
    group = sidp.plan_group(config, members, unit, "host-pool", 16, 16, max_batch=256)
    rows = group.rows["iterations"]
    assert group.fetch_s[0] == pytest.approx(sum(unit.weights_per_unit[2::2][:4][1::2]) / 1e6)
    assert group.b_threshold is not None
    for r in rows:
        assert (r["was_s"] <= r["cas_s"]) == (r["batch"] >= group.b_threshold)


@pytest.fixture
def estimated_box(tmp_path):
    inventory = tmp_path / "box.toml"
    inventory.write_text('version = 1\n[[hosts]]\nname = "box"\naddress = "192.0.2.30"\npython = "/usr/bin/python3"\n'
                         'devices = ["cuda:0", "cuda:1"]\ndevice_types = ["RTX3090", "RTX3090"]\n'
                         'intra_link = { bandwidth_gbps = 200, latency_us = 10 }\n')
    profile = tmp_path / "est.json"
    assert main(["profile", "--estimate", "--cluster", str(inventory), "--model", "llama-7b", "--dtype", "float16",
                 "-o", str(profile)]) == 0
    return profile


def test_plan_mode_sidp_writes_a_plan_that_says_what_to_run(estimated_box, tmp_path, capsys):
    out = tmp_path / "sidp.json"
    assert main(["plan", "--mode", "sidp", "--profile", str(estimated_box), "--model", "llama-7b",
                 "--seq-len", "2048", "--new-tokens", "256", "--max-batch", "256", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "B_th" in text and "run:" in text
    plan = formats.load_plan(out)
    assert plan.mode == "sidp" and len(plan.stages) == 2 and plan.sidp[0].source == "host-pool"
    assert all(s.units == (0, plan.model.units) for s in plan.stages)
    assert sorted(set(plan.sidp[0].owners)) == [0, 1]
    group = plan.predicted.groups[0]
    assert group["sidp"]["kv_tokens"] > group["dp"]["kv_tokens"] > 0
    # a SiDP plan names its replicas' owners; a broken one is refused with the place to fix
    data = json.loads(out.read_text())
    data["sidp"][0]["owners"][3] = 5
    out.write_text(json.dumps(data))
    with pytest.raises(HpipeError, match=r"sidp\[0\]\.owners"):
        formats.load_plan(out)


def test_plan_mode_sidp_without_a_profile_says_what_to_add(tmp_path, capsys):
    assert main(["plan", "--mode", "sidp", "--stages", "2", "-o", str(tmp_path / "p.json")]) != 0
    assert "--profile" in capsys.readouterr().err


def test_the_source_follows_the_profiles_fetch_and_peer_copies(estimated_box, tmp_path, capsys):
    """A measured pinned host read sets WaS's fetch time; auto reads from the peer GPU only where
    every pair's real copy arrived, faster; a copy that did not arrive refuses --sidp-source peer."""
    data = json.loads(estimated_box.read_text())
    ids = [d["id"] for d in data["devices"]]
    for d in data["devices"]:
        d["fetch"] = {"source": "host-pool", "what": "pinned host -> device", "bytes_per_s": 20e9}
    data["peers"] = [{"src": a, "dst": b, "peer_access": True, "works": True, "bytes_per_s": 25e9}
                     for a in ids for b in ids if a != b]
    args = ["plan", "--mode", "sidp", "--model", "llama-7b", "--seq-len", "2048", "--new-tokens", "256"]

    def plan_with(profile: dict, *extra):
        path = tmp_path / "measured.json"
        path.write_text(json.dumps(profile))
        out = tmp_path / "sidp.json"
        code = main(args + ["--profile", str(path), "-o", str(out), *extra])
        return code, (formats.load_plan(out) if code == 0 else None)

    code, plan = plan_with(data)
    assert code == 0 and plan.sidp[0].source == "peer"
    remote = sum(models.unit_bytes(models.config_for("llama-7b"), "float16").weights_per_unit[2::2]) / 2
    assert plan.predicted.groups[0]["fetch_s"][0] == pytest.approx(remote / 25e9, rel=0.01)
    data["peers"][0]["works"] = False            # the driver said yes, the copy did not arrive
    code, plan = plan_with(data)
    assert code == 0 and plan.sidp[0].source == "host-pool"
    assert plan.predicted.groups[0]["fetch_s"][0] == pytest.approx(remote / 20e9, rel=0.01)
    capsys.readouterr()
    code, _ = plan_with(data, "--sidp-source", "peer")
    err = capsys.readouterr().err
    assert code == 2 and "did not arrive" in err and "host-pool" in err and "Traceback" not in err
