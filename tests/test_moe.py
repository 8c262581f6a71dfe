"""Mixtures of experts (qwen3_moe, qwen2_moe with its shared expert, mixtral, olmoe): the pipeline's
numbers are transformers' numbers on random plans of 1-3 stages, cuts at every kind of unit
boundary; the routed experts run each picked expert once over its rows and never read the others;
weights quantized at load run the same routing."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import MOE_FAMILIES, VOCAB, build_tiny_model
from hpipe import cpu_kernels, experts, formats, memory, models, quant, quantized
from hpipe.errors import HpipeError
from hpipe.formats import Slicing
from test_exactness import check_against_reference


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    paths = {f: build_tiny_model(f, root / f) for f in MOE_FAMILIES}
    return {f: (p, AutoModelForCausalLM.from_pretrained(p).eval()) for f, p in paths.items()}


@st.composite
def moe_plans(draw, n_units: int):
    """1-3 stages; the cuts drawn among every kind of boundary (after the embedding, between a
    block's attention and MoE halves, between blocks, before the head)."""
    n_stages = draw(st.integers(1, 3))
    cuts = sorted(draw(st.sets(st.integers(1, n_units - 1), min_size=n_stages - 1, max_size=n_stages - 1)))
    slicing = Slicing(lengths=tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))))
    prompts = draw(st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=60), min_size=1, max_size=4))
    return [0, *cuts, n_units], slicing, prompts, draw(st.integers(1, 4))


@pytest.mark.parametrize("family", MOE_FAMILIES)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_match_transformers(family, moe_models, data):
    path, reference = moe_models[family]
    bounds, slicing, prompts, max_batch = data.draw(moe_plans(models.num_units(models.load_config(path))))
    check_against_reference(path, reference, bounds, slicing, prompts, max_batch)


def test_every_kind_of_cut(moe_models):
    """Cuts after the embedding, inside block 0 (attention | MoE half), between blocks 1 and 2, and
    before the head, on the family with a shared expert and a dense block (`mlp_only_layers`)."""
    path, reference = moe_models["qwen3_moe"]
    n = models.num_units(models.load_config(path))
    check_against_reference(path, reference, [0, 1, 2, 5, n - 1, n], Slicing(lengths=(9,)),
                            [list(range(3, 50)), [7, 8, 9], list(range(200, 230))], max_batch=3)


def test_experts_kept_in_host_ram_give_the_models_numbers(moe_models, device):
    """A plan's `host_experts`: each stage's first MoE blocks keep their routed experts on the CPU
    (`experts.HostExperts`) while the rest of the stage runs on its device (here the CPU too where no
    GPU is lent); the logits those of transformers, the tokens those of `generate`. qwen2_moe: its
    shared expert stays on the stage's device."""
    path, reference = moe_models["qwen2_moe"]
    n = models.num_units(models.load_config(path))
    check_against_reference(path, reference, [0, 3, n], Slicing(lengths=(9,)),
                            [list(range(3, 40)), [7, 8, 9]], max_batch=2, device=device, host_experts=[1, 1])
    config = models.load_config(path)
    with pytest.raises(HpipeError, match="hold 1 MoE blocks; use at most 1"):
        models.host_expert_units(config, range(0, 3), 2)


def reference_experts(module, hidden, index, weights):
    """transformers' own eager loop over the experts (the module's original forward)."""
    return type(module).forward.__wrapped__(module, hidden, index, weights)


def test_rows_meet_on_shared_experts_part_on_others_and_unpicked_experts_are_never_read(moe_models):
    path, reference = moe_models["mixtral"]
    module = reference.model.layers[0].mlp.experts
    routed = experts.float_experts(module)
    torch.manual_seed(0)
    hidden = torch.randn(6, module.hidden_dim)
    # rows 0-1 share expert 3, rows 2-3 share nothing with them, rows 4-5 pick the same pair; 6 and 7 unpicked
    index = torch.tensor([[3, 0], [3, 1], [2, 4], [5, 2], [1, 0], [0, 1]])
    weights = torch.softmax(torch.randn(6, 2), -1)
    want = reference_experts(module, hidden, index, weights)
    with torch.no_grad():
        got = routed(hidden, index, weights)
        assert float((got - want).abs().max()) < 1e-5
        saved = module.gate_up_proj[6:].clone()
        module.gate_up_proj[6:] = float("nan")       # an unpicked expert read would make the output NaN
        try:
            assert torch.isfinite(routed(hidden, index, weights)).all()
        finally:
            module.gate_up_proj[6:] = saved


@pytest.mark.parametrize("fmt", ["int8", "int4:32"])
def test_weights_quantized_at_load_route_as_the_float_model(moe_models, fmt):
    """`--quantize` of a float MoE checkpoint: every expert packed, routing unchanged (the router
    stays float) and the logits near the float model's: KL per token below what the format's own
    rounding of every matrix gives at these tiny, wide-spread weights (int8 1e-2, int4 0.1; an
    expert swapped or mis-sliced gives KL of order 1)."""
    path, reference = moe_models["qwen2_moe"]
    config = models.load_config(path)
    weights = quant.WeightFormat.parse(fmt)
    model = models.build_full_model(path, config, weights=weights)
    block = model.model.layers[0].mlp
    assert isinstance(block.experts, experts.RoutedExperts)
    assert all(isinstance(m, quantized.QUANTIZED) for e in block.experts.experts for m in (*e.gate_up, e.down))
    ids = torch.tensor([list(range(3, 60))])
    with torch.no_grad():
        ours, theirs = model(ids).logits[0].float(), reference(ids).logits[0]
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), theirs.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert float(kl.max()) < (1e-2 if fmt == "int8" else 0.1), float(kl.max())


def test_memory_counts_every_expert(moe_models):
    path, _ = moe_models["qwen3_moe"]
    config = models.load_config(path)
    sizes = models.unit_bytes(config).weights_per_unit
    e, i, h = models.num_experts(config), config.moe_intermediate_size, config.hidden_size
    routed = e * 3 * i * h * 4
    assert sizes[2] == routed + e * h * 4 + h * 4                           # experts, router, norm (block 0: MoE)
    assert sizes[6] == 3 * config.intermediate_size * h * 4 + h * 4         # block 2 is dense (`mlp_only_layers`)
    packed = models.unit_bytes(config, weights="int4:32").weights_per_unit
    assert packed[2] < sizes[2] / 5


@pytest.mark.parametrize("family,why", [("granitemoe", "input_linear"), ("gpt_oss", "sinks")])
def test_a_family_hpipe_cannot_run_is_refused_in_one_line(tmp_path, family, why):
    from transformers import AutoConfig

    AutoConfig.for_model(family).save_pretrained(tmp_path)
    with pytest.raises(HpipeError) as e:
        models.load_config(tmp_path)
    assert family in str(e.value) and why in str(e.value) and "\n" not in str(e.value)


# one block each: Q8_0; Q4_0 with Q8_0 down (the int4 and int8 kernels); Q4_K; gate and up in
# different types (packed apart) and Q6_K down, as Q4_K_M writes some blocks' down. Q6_K is
# re-quantized to int8 per row (`quant.pack`): its error (~1 % here) can flip a later block's routing,
# so it is the last block's
BLOCK_TYPES = [("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q4_0", "Q8_0"), ("Q4_K", "Q4_K", "Q4_K"), ("Q4_0", "Q8_0", "Q6_K")]


@pytest.mark.slow
def test_a_gguf_files_experts_stay_in_their_blocks_and_give_the_files_numbers(tmp_path):
    """A GGUF MoE file in the types Q4_K_M writes: every expert packed from the file's own blocks
    (4-bit codes to the int4 kernel, 6- and 8-bit to int8), and the logits those of transformers'
    float forward of the gguf package's dequantization of the same file, within the kernels'
    activation rounding: each block's experts on the same routing, then the whole model (median KL
    per token < 1e-3; llama.cpp's own on the 1B shape: 6e-4 to 2e-3, bench/results/quant-avx2.json);
    through one stage and through two cut inside block 1."""
    from transformers import AutoModelForCausalLM

    from conftest import write_moe_gguf
    from hpipe.runtime.stage import StageRunner

    path = write_moe_gguf(tmp_path / "moe.gguf", BLOCK_TYPES)
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    assert config.model_type == "qwen3_moe" and config.moe_intermediate_size == 256   # the file's, not the default
    assert models.num_experts(config) == 8 and models.experts_per_token(config) == 2
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    weights = quant.WeightFormat("gguf")
    model = models.build_full_model(source, config, weights=weights)
    kinds = {"Q4_0": "Int4Linear", "Q4_K": "Int4Linear", "Q6_K": "Int8Linear", "Q8_0": "Int8Linear"}
    for b, (gate, up, down) in enumerate(BLOCK_TYPES):
        expert = model.model.layers[b].mlp.experts.experts[5]
        got = [type(m).__name__ for m in (*expert.gate_up, expert.down)]
        assert got == ([kinds[gate]] if gate == up else [kinds[gate], kinds[up]]) + [kinds[down]]
    # each block's experts on the same rows and routing as transformers' (its float dequantization):
    # the file's own values (Q4_0, Q4_K, Q8_0) within activation rounding (hpipe's kernels: 16-bit per
    # block of 32; torch's, under HPIPE_CPU_KERNELS=torch: bf16, 2^-8 of each value, and bf16 outputs),
    # Q6_K within its int8 rows
    bound = 1e-3 if cpu_kernels.kernels()[0] is not None else 3e-2
    torch.manual_seed(0)
    x = torch.randn(80, config.hidden_size)
    with torch.no_grad():
        for b, (_, _, down) in enumerate(BLOCK_TYPES):
            theirs_block = reference.model.layers[b].mlp
            _, routing, picked = theirs_block.gate(x)
            want = theirs_block.experts(x, picked, routing)
            got = model.model.layers[b].mlp.experts(x, picked, routing)
            rel = float((got - want).abs().max() / want.abs().max())
            assert rel < (max(2e-2, bound) if down == "Q6_K" else bound), (b, rel)
        # a decode step's (row, slot) pairs in one routed kernel call per matrix, grouped by expert
        # inside it (`RoutedExperts.stacked`, where hpipe's CPU kernels run): each pair's row gets the
        # bits its expert's own module gives it, and the block's sum that of the grouped path
        for b in range(len(BLOCK_TYPES)):
            routed = model.model.layers[b].mlp.experts
            assert (routed.stacked is not None) == (cpu_kernels.kernels()[0] is not None)
            if routed.stacked is None:
                continue
            for rows in (1, 3, 12):
                _, routing, picked = reference.model.layers[b].mlp.gate(x[:rows])
                assert rows < routed.stacked_rows
                ids, k = picked.reshape(-1), picked.shape[-1]
                for j, part in enumerate(p for p in ("gate_up", "gate", "up") if p in routed.stacked):
                    together = routed.stacked[part](x[:rows], ids)
                    for i, e in enumerate(ids.tolist()):
                        assert torch.equal(together[i], routed.experts[e].gate_up[j](x[i // k: i // k + 1])[0])
                h = torch.randn(len(ids), config.moe_intermediate_size)
                down = routed.stacked["down"](h, ids)
                for i, e in enumerate(ids.tolist()):
                    assert torch.equal(down[i], routed.experts[e].down(h[i:i + 1])[0])
                grouped = routed._grouped(x[:rows], picked, routing)
                assert torch.allclose(routed(x[:rows], picked, routing), grouped, rtol=1e-5, atol=1e-6)
    ids = torch.tensor([list(range(300, 380))])
    with torch.no_grad():
        ours, theirs = model(ids).logits[0].float(), reference(ids).logits[0]
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), theirs.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    # end to end, a token whose router is near a tie in some block may take another expert on
    # either side (llama.cpp's too): most tokens agree to the kernels' rounding (a random head's
    # logits are too flat for top-1 to tell); torch's bf16 activations round 2^-8 of each, so 5x the bound
    assert float(kl.median()) < 1e-3 * (1 if cpu_kernels.kernels()[0] is not None else 5), float(kl.median())
    # two stages cut between block 1's attention and MoE halves: the same logits as one (the head on
    # the last row alone, as the last stage runs it: 80 rows go through a bf16 GEMM on a CPU with
    # bf16 units, one row through the int kernels, whose roundings differ by more than this bound)
    with torch.no_grad():
        last = model.lm_head(model.model(ids).last_hidden_state[:, -1:])[0, -1].float()
    n = models.num_units(config)
    stages = [StageRunner(source, config, r, weights=weights, kv_dtype="float32") for r in (range(0, 4), range(4, n))]
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.request import Request

    request = Request(0, "p", tuple(range(300, 380)), max_new_tokens=4, eos_ids=frozenset())
    split = run_inprocess(stages, [request], Slicing(lengths=(32,)).slices_for, max_batch=1, keep_logits=True)
    first = split["p"]["logits"][0]
    assert float((first - last).abs().max()) < 1e-3 * float(last.abs().max())
    # what --push-model sends the second stage's host: a GGUF of its units' tensors alone, blocks as
    # they are, which runs those units to the same numbers as the whole file
    import gguf

    part = models.stage_gguf(source.gguf, config, range(4, n))
    whole = {t.name: t for t in gguf.GGUFReader(str(source.gguf)).tensors}
    kept = {t.name: t for t in gguf.GGUFReader(str(part)).tensors}
    assert "token_embd.weight" not in kept and "blk.0.ffn_gate_exps.weight" not in kept
    assert "blk.1.attn_q.weight" not in kept and "blk.1.ffn_down_exps.weight" in kept and "output.weight" in kept
    assert all(bytes(kept[k].data) == bytes(whole[k].data) and kept[k].tensor_type == whole[k].tensor_type
               for k in kept)
    dropped = sum(int(t.n_bytes) for name, t in whole.items() if name not in kept)       # not sent at all
    assert dropped > 0 and part.stat().st_size <= source.gguf.stat().st_size - dropped + 4096   # padding aside
    hidden = torch.randn(1, 5, config.hidden_size)
    from hpipe.runtime.pages import Segment

    outs = []
    # the part's config and tokenizer are the whole file's (its metadata is copied as it is); and a
    # stage keeping its first two MoE blocks' experts in host RAM (`host_experts`: packed for the CPU)
    for src, host in ((source, 0), (models.ModelSource(str(part), source.path, part), 0), (source, 2)):
        runner = StageRunner(src, config, range(4, n), weights=weights, host_experts=host, kv_dtype="float32")
        assert sum(isinstance(m, experts.HostExperts) for m in runner.model.modules()) == host
        segments = [Segment(0, 0, 0, 5, True)]
        runner.kv.allocate(4)
        outs.append(runner.forward(runner.prepare_inputs(segments), hidden.reshape(5, -1)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_mixtral_gguf_file_is_refused_in_one_line(tmp_path):
    from conftest import write_moe_gguf

    path = write_moe_gguf(tmp_path / "mixtral.gguf", [("Q8_0", "Q8_0", "Q8_0")], arch="llama")
    with pytest.raises(HpipeError) as e:
        models.resolve_model(str(path))
    assert "Mixtral" in str(e.value) and "Hugging Face directory" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_compiled_decode_runs_attention_halves_through_graphs_and_experts_eagerly(moe_models):
    """`--compile on` with a MoE model: each block's halves a call apiece, the attention halves (and
    the dense block's MLP half) through compiled graphs, the MoE halves eager; transformers' logits."""
    from conftest import reference_greedy, reference_logits, assert_greedy_equal
    from hpipe.request import Request
    from hpipe.runtime import stage as stage_module
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner

    path, reference = moe_models["qwen3_moe"]
    config = models.load_config(path)
    n = models.num_units(config)
    runners = [StageRunner(path, config, r, compile="on", kv_dtype="float32") for r in (range(0, 4), range(4, n))]
    assert runners[0].calls == [(0,), (1,), (2,), (3,)]
    # block 0's MoE half and block 2's dense MLP half (`mlp_only_layers`): one graph per kind
    assert sorted(stage_module.graph_plan(runners[0])) == [1, 3]
    assert sorted(stage_module.graph_plan(runners[1])) == [5, 6, 7]
    for runner in runners:
        runner.kv.allocate(40)
        stage_module.warm_up(runner, 16, print)
    prompts = [list(range(3, 30)), [9, 8, 7], list(range(100, 117))]
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=8, eos_ids=frozenset()) for i, p in enumerate(prompts)]
    results = run_inprocess(runners, requests, Slicing(lengths=(16,)).slices_for, max_batch=3, keep_logits=True,
                            pages=40)
    for r in requests:
        out = results[r.id]["output_ids"]
        assert float((results[r.id]["logits"] - reference_logits(reference, list(r.input_ids), out)).abs().max()) < 1e-4
        assert_greedy_equal(reference, list(r.input_ids), out, reference_greedy(reference, list(r.input_ids), 8, None))


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels.kernels()[0] is None, reason="hpipe's CPU kernels do not run here")
def test_compiled_decode_holds_whole_moe_blocks_where_the_experts_run_the_routed_kernels(tmp_path):
    """A GGUF MoE file under `--compile on`: its experts stacked for the routed kernels, each block is
    one unit of a compiled graph (router, routed experts, the sum), as a dense block is; batches of
    requests take the eager stage's tokens and its logits to the graph's float rounding (which the
    kernels' 16-bit activations, a step of 2^-16 of a block's largest value, carry on: 1.4e-4 of the
    largest logit here)."""
    from conftest import write_moe_gguf
    from hpipe.request import Request
    from hpipe.runtime import stage as stage_module
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner

    path = write_moe_gguf(tmp_path / "moe.gguf", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_K")])
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    n = models.num_units(config)
    weights = quant.WeightFormat("gguf")
    runs = {}
    for mode in ("off", "on"):
        runner = StageRunner(source, config, range(n), weights=weights, compile=mode, kv_dtype="float32")
        if mode == "on":
            assert runner.compile_refused is None and runner.calls == [(0,), (1, 2, 3, 4), (5,)]
            assert sorted(stage_module.graph_plan(runner)) == [1]
        runner.kv.allocate(40)
        stage_module.warm_up(runner, 16, print)
        requests = [Request(i, f"p{i}", tuple(range(300 + i, 320 + 3 * i)), max_new_tokens=6, eos_ids=frozenset())
                    for i in range(3)]
        runs[mode] = run_inprocess([runner], requests, Slicing(lengths=(16,)).slices_for, max_batch=3,
                                   keep_logits=True, pages=40)
    for key, eager in runs["off"].items():
        compiled = runs["on"][key]
        assert compiled["output_ids"] == eager["output_ids"]
        scale = float(eager["logits"].abs().max())
        assert float((compiled["logits"] - eager["logits"]).abs().max()) < 1e-3 * scale


@pytest.mark.slow
def test_a_plain_warmup_covers_every_graph_of_every_stage_layout_when_blocks_differ(tmp_path):
    """`hpipe warmup` without a plan compiles one short layout per distinct graph (`any_layout_units`);
    with blocks of different expert types (as Q4_K_M writes some blocks' down in Q6_K) every stage
    of every layout, cut anywhere, calls only graphs among those layouts' (block 0's halves alone,
    the warmup's layouts before, left block 1's cut halves cold)."""
    from conftest import write_moe_gguf
    from hpipe.runtime import stage as stage_module
    from hpipe.runtime.stage import StageRunner

    path = write_moe_gguf(tmp_path / "moe.gguf", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_K")])
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    n = models.num_units(config)

    def keys(units: range) -> set:
        runner = StageRunner(source, config, units, weights=quant.WeightFormat("gguf"), compile="off",
                             kv_dtype="float32", join_halves=False)
        return {key for _, key in stage_module.graph_plan(runner).values()}

    whole = StageRunner(source, config, range(n), weights=quant.WeightFormat("gguf"), compile="off",
                        kv_dtype="float32")
    warmed = set().union(*(keys(units) for units in stage_module.any_layout_units(whole)))
    wanted = set().union(*(keys(range(a, b)) for a in range(n) for b in range(a + 1, n + 1)))
    assert wanted == warmed
    assert len({key for key in wanted if key[0] == "mlp_half"}) == 2       # the two blocks' MoE halves differ


def test_speculative_steps_route_each_proposed_row_to_its_own_experts(moe_models):
    """Prompt lookup on a MoE model (qwen2_moe, its shared expert too) over 2 stages cut between a
    block's halves: a step's proposed rows are routed one by one as the model routes them; every
    emitted token's logits within 1e-4 of one transformers forward, greedy tokens `generate`'s."""
    import random

    from conftest import assert_greedy_equal, reference_greedy, reference_logits
    from hpipe.config import Speculation
    from hpipe.request import Request
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner
    from test_speculative import repetitive_prompts

    path, reference = moe_models["qwen2_moe"]
    config = models.load_config(path)
    n = models.num_units(config)
    runners = [StageRunner(path, config, r, kv_dtype="float32") for r in (range(0, 4), range(4, n))]
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=16, eos_ids=frozenset())
                for i, p in enumerate(repetitive_prompts(random.Random(5), 3))]
    results = run_inprocess(runners, requests, Slicing(count=2).slices_for, max_batch=2, keep_logits=True,
                            page_size=4, speculation=Speculation("ngram", 4))
    for r in requests:
        got = results[r.id]
        ref = reference_logits(reference, list(r.input_ids), got["output_ids"])
        assert float((got["logits"] - ref).abs().max()) < 1e-4
        assert_greedy_equal(reference, list(r.input_ids), got["output_ids"],
                            reference_greedy(reference, list(r.input_ids), 16, None))
    assert sum(r["accepted"] for r in results.values()) > 0      # steps of several rows ran


def test_a_plan_keeps_each_device_within_its_memory_and_says_where_memory_moved_the_cuts(tmp_path, capsys):
    """Qwen3-30B-A3B's shape (by name: its published config, no weights) in int8 on a 24 GB GPU and
    a CPU: by speed the GPU would take every block, whose experts make 28 of its 30 GB; the plan
    gives the CPU what the GPU cannot hold, and one line says so."""
    from hpipe.cli import main

    cluster = tmp_path / "cluster.toml"
    cluster.write_text('version = 1\n'
                       '[[hosts]]\nname = "gpu-box"\naddress = "192.0.2.30"\npython = "/usr/bin/python3"\n'
                       'devices = ["cuda:0"]\ndevice_types = ["RTX3090"]\n'
                       '[[hosts]]\nname = "cpu-box"\naddress = "192.0.2.31"\npython = "/usr/bin/python3"\n'
                       'devices = ["cpu"]\ndevice_types = ["CPU"]\n'
                       '[[links]]\nhosts = ["gpu-box", "cpu-box"]\nbandwidth_gbps = 1\nlatency_ms = 0.3\n')
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", "--estimate", "--cluster", str(cluster), "--model", "qwen3-30b-a3b", "--dtype", "float16",
                 "--quantize", "int8", "-o", str(profile)]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", "qwen3-30b-a3b", "--cluster", str(cluster), "--profile", str(profile),
                 "--seq-len", "512", "--num-slices", "4", "-o", str(plan)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory:")]
    p = formats.load_plan(plan)
    need, free = p.predicted.memory_bytes_per_stage, p.predicted.memory_free_bytes
    assert all(n <= f for n, f in zip(need, free))
    assert 0 < p.stages[0].units[1] < models.num_units(models.config_for("qwen3-30b-a3b")) - 1
    assert len(said) == 1 and "gpu-box/cuda:0 cannot hold" in said[0] and "this plan fits" in said[0]


def test_a_gpu_that_cannot_hold_its_experts_keeps_the_fewest_blocks_of_them_in_its_hosts_ram(tmp_path, capsys):
    """Qwen3-30B-A3B in int8 on a 24 GB GPU whose host's CPU and RAM were profiled, and a second box:
    for decode the plan keeps the GPU's cuts memory would not move and the experts of as few MoE blocks
    as make them fit in the host's RAM, run by its CPU (`host_experts`), says so in one line, and the
    launch preflight counts those bytes against the host's RAM, not the GPU's."""
    from hpipe.cli import main
    from hpipe.launcher import cluster as cluster_checks

    inventory = tmp_path / "cluster.toml"
    inventory.write_text('version = 1\n'
                         '[[hosts]]\nname = "gpu-box"\naddress = "192.0.2.30"\npython = "/usr/bin/python3"\n'
                         'devices = ["cuda:0", "cpu"]\ndevice_types = ["RTX3090", "CPU"]\n'
                         '[[hosts]]\nname = "cpu-box"\naddress = "192.0.2.31"\npython = "/usr/bin/python3"\n'
                         'devices = ["cpu"]\ndevice_types = ["CPU"]\n'
                         '[[links]]\nhosts = ["gpu-box", "cpu-box"]\nbandwidth_gbps = 1\nlatency_ms = 0.3\n')
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", "--estimate", "--cluster", str(inventory), "--model", "qwen3-30b-a3b", "--dtype",
                 "float16", "--quantize", "int8", "-o", str(profile)]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", "qwen3-30b-a3b", "--cluster", str(inventory), "--profile", str(profile),
                 "--seq-len", "512", "--objective", "decode", "-o", str(plan)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("experts:")]
    p = formats.load_plan(plan)
    config = models.config_for("qwen3-30b-a3b")
    gpu = p.stages[0]
    assert (gpu.host, gpu.device) == ("gpu-box", "cuda:0") and gpu.host_experts > 0
    assert all(st.device == "cpu" and st.host == "cpu-box" for st in p.stages[1:])     # its CPU runs no stage
    pr = p.predicted
    assert pr.host_experts["value_s"] < pr.host_experts["cut_elsewhere_value_s"]
    assert len(said) == 1 and f"stage 0 (gpu-box/cuda:0) {gpu.host_experts} MoE blocks" in said[0]
    table = models.unit_bytes(config, p.dtype, p.weights)
    free = pr.memory_free_bytes[0] * (1 - pr.margin) - \
        memory.activation_bytes(table.activation_per_token_at_cut, memory.microbatch_tokens(pr.slices))
    units = range(*gpu.units)

    def on_gpu(count):
        m = memory.stage_memory(table, units, 512 + 128, 1, models.host_expert_units(config, units, count))
        return m.weights + m.kv
    assert on_gpu(gpu.host_experts) <= free < on_gpu(gpu.host_experts - 1)          # the fewest that fit
    need = cluster_checks.device_needs(p, config, "gpu-box", 512 + 128, 1)
    assert need["cpu"] == sum(table.experts_per_unit[u] for u in models.host_expert_units(config, units,
                                                                                            gpu.host_experts))


def test_a_served_moe_model_answers_with_its_own_tokens_logprobs_n_and_cached_prefixes(tmp_path):
    """`hpipe serve` of a float MoE model (qwen2_moe: shared expert) on 2 stages cut inside a block,
    through the real `openai` client: greedy tokens and log-probabilities are transformers' own, `n`
    answers each get the prompt's cached pages, and a second question on the same document starts
    after its cached pages."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import save_random_model, tiny_config
    from hpipe.cli import main
    from test_openai_fields import reference_logprobs
    from serving import stop_serve
    from test_serve import client, metric, start_server

    source = models.resolve_model("smollm2").path
    config = tiny_config("qwen2_moe")
    config.vocab_size = int(models.load_config(source).vocab_size)
    path = save_random_model(config, tmp_path / "talking-moe", seed=9)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "2", "--cuts", "4", "-o", str(plan)]) == 0
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    proc, base, log = start_server(tmp_path, plan, key=None)
    try:
        c = client(base, key=None)
        model = c.models.list().data[0].id
        document = "Mixtures of experts route each token to a few of many feed-forward networks. " * 6
        prompt = tokenizer(document + "Question one:")["input_ids"]
        done = c.completions.create(model=model, prompt=document + "Question one:", max_tokens=8, temperature=0,
                                    logprobs=3, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        output = [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]
        ref = reference_logprobs(reference, prompt, output)
        assert output == ref.argmax(-1).tolist()
        assert done.choices[0].logprobs.token_logprobs == pytest.approx([float(ref[i, t]) for i, t in enumerate(output)],
                                                                        abs=1e-4)
        two = c.completions.create(model=model, prompt=document + "Question two:", max_tokens=4, temperature=0.8,
                                   n=2, seed=3)
        assert len(two.choices) == 2
        deadline = time.time() + 30           # the stages' counters reach the server with their next report
        while metric(base, "hpipe_prefix_cache_hit_tokens_total") == 0 and time.time() < deadline:
            time.sleep(0.2)
        assert metric(base, "hpipe_prefix_cache_hit_tokens_total") > 0
    finally:
        stop_serve(proc)
    assert proc.returncode in (0, 130), log.read_text()
