"""Shared fixtures: small random-init models of every supported family, built in the test (no
download), saved as Hugging Face directories; and the transformers reference they are checked
against."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# inductor's cache, and with it what `hpipe warmup` marked warm (`--compile auto`, the default), is
# the session's own: the suite runs the same paths on a developer's machine as on CI's fresh one.
# One for the whole session, both pytest-xdist workers' (started with the controller's environment,
# after it read this file): a block's graph compiled by one test loads in every later one (the
# default model's warmup took 72 s cold, 17 s from a warm cache, on 2 AVX-512 cores).
if "HPIPE_TEST_INDUCTOR" not in os.environ:
    os.environ["HPIPE_TEST_INDUCTOR"] = tempfile.mkdtemp(prefix="hpipe-test-inductor-")
    atexit.register(shutil.rmtree, os.environ["HPIPE_TEST_INDUCTOR"], True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["HPIPE_TEST_INDUCTOR"]


def cold_host_cache(directory: Path) -> Path:
    """An inductor cache at `directory` for a host that never ran `hpipe warmup`: the session's cache
    hard-linked file by file (what other tests compiled loads, as it would from inductor's own cache
    on a host that compiled other work), without hpipe's warm marks."""
    shared = Path(os.environ["HPIPE_TEST_INDUCTOR"])
    directory.mkdir(parents=True, exist_ok=True)
    for src in sorted(shared.rglob("*")):
        rel = src.relative_to(shared)
        if rel.parts[0] in ("hpipe-warm", "locks") or rel.name == ".lock":      # a graph directory's own lock
            continue
        try:
            if src.is_dir():
                (directory / rel).mkdir(parents=True, exist_ok=True)
            else:
                os.link(src, directory / rel)
        except (FileNotFoundError, FileExistsError):     # the other worker's compile renaming its files
            pass
    _COLD_HOSTS.append(directory)
    return directory


_COLD_HOSTS: list[Path] = []


@pytest.fixture(autouse=True)
def _cold_hosts_give_back_their_graphs():
    """After a test, the decode graphs its cold hosts compiled join the session's cache (hard links
    of whole files), as `cold_host_cache` took them from it: a later test compiles none of them again
    (the same tiny blocks were compiled up to three times a run, ~6 s each)."""
    yield
    shared = Path(os.environ["HPIPE_TEST_INDUCTOR"]) / "hpipe-graphs"
    while _COLD_HOSTS:
        for src in sorted((_COLD_HOSTS.pop() / "hpipe-graphs").glob("*/*.graph")):
            (shared / src.parent.name).mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.link(src, shared / src.parent.name / src.name)


FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share this machine's cores: a test's own torch work (the in-process references)
    # takes one thread, as every stage of a local launch beside another does (OpenMP threads that
    # outnumber the cores spin against each other: a test ran 30x slower)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # and the stages it starts wait for work asleep


# The devices that tests taking a `device` argument run on: the CPU here and on CI; a lent GPU
# machine runs them with HPIPE_TEST_DEVICES=cuda (bench/gpu/run.sh), the CPU's runs already counted.
TEST_DEVICES = tuple(os.environ.get("HPIPE_TEST_DEVICES", "cpu").split(","))


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
        metafunc.parametrize("device", [pytest.param(d, marks=[no_cuda] if d.startswith("cuda") else [])
                                        for d in TEST_DEVICES])


def pytest_terminal_summary(terminalreporter):
    """At the end of the run (`-q` included), the machine in one line, with a pure-Python probe: the suite's time is the tests' CPU over the
    cores, and these machines' single-core speed varies by ~2x between sessions (docs/benchmarks.md
    relates the probe to the suite's CPU)."""
    import re
    import time

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = sorted({f for f in info.split() if re.fullmatch(r"avx2|avx512f|avx512_bf16|amx_bf16", f)})
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        sum(range(10 ** 7))
        best = min(best, time.perf_counter() - t)
    terminalreporter.write_line(f"machine: {name}, {os.cpu_count()} cores, {' '.join(flags)}; pure-Python probe "
                                f"(sum(range(10**7)), best of 5) {best * 1e3:.0f} ms")


# The files with slow tests that took longest (docs/benchmarks.md, the suite test by test), longest
# first: started last, the README's 250 s ran on alone at the end of the suite
LONGEST = ("test_readme.py", "test_launch_local.py", "test_background_compile.py", "test_quant.py",
           "test_speculative.py", "test_determinism.py", "test_moe.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first: `make test` runs pytest-xdist workers, one file per worker at a
    time, in this order (`--no-loadscope-reorder`), the longest first so that the last to end is a
    short one: the emulated hosts' file (12-13 minutes: started first, the other workers run the
    other files beside it), then `LONGEST`, then the other files with slow tests, then the rest.
    The same order on every worker (xdist needs it). (The hosts' tests split over two workers ran
    slower: two clusters of three hosts each on two cores, 1,406 s of the two workers' time
    against 1,034.)"""
    slow_files = {item.path for item in items if "slow" in item.keywords}

    def rank(item) -> tuple:
        longest = LONGEST.index(item.path.name) if item.path.name in LONGEST else len(LONGEST)
        return "hosts" not in item.keywords, item.path not in slow_files, longest

    items.sort(key=rank)


VOCAB = 256


def tiny_config(family: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=24)  # short window: prompts cross it
    if family in MOE_FAMILIES:     # 8 experts, 2 a token: rows of a batch meet on some experts and part on others
        moe = dict(common, intermediate_size=48, num_experts_per_tok=2)
        if family == "mixtral":
            from transformers import MixtralConfig

            return MixtralConfig(**moe, num_local_experts=8)
        from transformers import AutoConfig

        extra = {"qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[2]),
                 "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=40,
                                   decoder_sparse_step=1, mlp_only_layers=[]),
                 "olmoe": dict()}[family]
        return AutoConfig.for_model(family, **moe, num_experts=8, **extra)
    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=512,
                          bos_token_id=1, eos_token_id=2)
    raise ValueError(family)


def save_random_model(config, directory: Path, seed: int, std: float = 0.08, max_shard_size: str = "5GB") -> Path:
    """A model of `config` with N(0, std) matrices (seeded), saved as a Hugging Face directory.
    Larger weights than the default init: logits spread out, so greedy ties are rare."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def build_tiny_model(family: str, directory: Path, sharded: bool = False) -> Path:
    seeds = {"llama": 1, "qwen2": 2, "mistral": 3, "gpt2": 4, "qwen3_moe": 5, "qwen2_moe": 6, "mixtral": 7, "olmoe": 8}
    return save_random_model(tiny_config(family), directory, seeds[family],
                             max_shard_size="200KB" if sharded else "5GB")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {f: build_tiny_model(f, root / f, sharded=(f == "qwen2")) for f in FAMILIES}
    return out


@pytest.fixture(scope="session")
def talking_model(tmp_path_factory) -> Path:
    """A tiny float32 Llama with the default model's vocabulary, tokenizer and chat template: what
    `hpipe serve` needs (text in, text out) at the cost of a test model, exact against its
    transformers reference (no quantized kernels)."""
    import shutil

    from hpipe import models

    source = models.resolve_model("smollm2").path
    config = tiny_config("llama")
    config.vocab_size = int(models.load_config(source).vocab_size)
    directory = save_random_model(config, tmp_path_factory.mktemp("talking") / "talking", seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def reference_models(tiny_models):
    from transformers import AutoModelForCausalLM

    return {f: AutoModelForCausalLM.from_pretrained(p).eval() for f, p in tiny_models.items()}


def reference_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits of one full-sequence transformers forward at the last prompt position and at every
    generated position but the last: the rows the pipeline produced, [len(output), V]."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits[len(prompt) - 1:]


def reference_greedy(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_equal(model, prompt: list[int], ours: list[int], theirs: list[int], tie: float = 1e-4) -> None:
    """Greedy tokens must be equal; if they part, the reference's top two logits at that step must
    be a genuine tie (within float32 noise), else the pipeline is wrong."""
    if ours == theirs:
        return
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    ids = torch.tensor([prompt + theirs[:k]])
    with torch.no_grad():
        top2 = model(ids).logits[0, -1].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < tie, f"greedy tokens differ at step {k} where the reference is not a tie (gap {gap}): " \
                       f"{ours} vs {theirs}"


def assert_run_matches(reference, requests, results, tol: float) -> None:
    """Every request of an in-process run (`run_inprocess(..., keep_logits=True)`): its logits within
    `tol` of one transformers forward and its greedy tokens `generate`'s (near-ties within `tol` aside)."""
    for r in requests:
        out = results[r.id]["output_ids"]
        ref = reference_logits(reference, list(r.input_ids), out)
        assert float((results[r.id]["logits"] - ref).abs().max()) < tol, r.id
        assert_greedy_equal(reference, list(r.input_ids), out,
                            reference_greedy(reference, list(r.input_ids), r.max_new_tokens, None), tie=tol)


_MOE_FILES = Path(tempfile.mkdtemp(prefix="hpipe-test-moe-"))
atexit.register(shutil.rmtree, _MOE_FILES, True)


def write_moe_gguf(path: Path, expert_types: list[tuple], **shape) -> Path:
    """`_write_moe_gguf`'s file at `path`, written once per session for each set of arguments (it is
    seeded: the same arguments, the same bytes) and copied."""
    key = hashlib.sha256(repr((expert_types, sorted(shape.items()))).encode()).hexdigest()[:16]
    made = _MOE_FILES / f"{key}.gguf"
    if not made.exists():
        part = _write_moe_gguf(made.with_suffix(".part"), expert_types, **shape)
        part.rename(made)
    shutil.copyfile(made, path)
    return Path(path)


SMALL_VOCAB = 512


@functools.lru_cache(maxsize=1)
def small_tokenizer() -> tuple:
    """The default model's GGUF tokenizer cut to its first `SMALL_VOCAB` tokens (its 17 special
    tokens, its 256 byte symbols and the merges among them): any text still encodes. The whole one
    (49,152 tokens, 48,900 merges) made every reading of a test's GGUF file take ~5 s of CPU in the
    gguf package's reader, and a file is read six or seven times (its config, its tokenizer, its
    experts, the weights packed, a stage's own file, transformers' reference): a sixth of the pytest
    workers' own time (py-spy, 2026-12-03). The file's reader (for its scalar fields, as they are)
    and the arrays, cut."""
    import gguf

    from hpipe import models

    source = gguf.GGUFReader(str(models.smollm2_gguf_path()))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()[:SMALL_VOCAB]
    types = source.fields["tokenizer.ggml.token_type"].contents()[:SMALL_VOCAB]
    kept = set(tokens)
    merges = [m for m in source.fields["tokenizer.ggml.merges"].contents()
              if (parts := m.split(" ")) and "".join(parts) in kept and all(p in kept for p in parts)]
    return source, tokens, types, merges


def _write_moe_gguf(path: Path, expert_types: list[tuple], arch: str = "qwen3moe", seed: int = 0, hidden: int = 256,
                   experts: int = 8, used: int = 2, ff: int = 256, heads: int = 4,
                   kv_heads: int = 2, head_dim: int = 64) -> Path:
    """A small mixture-of-experts GGUF file as llama.cpp lays one out (merged `ffn_*_exps` tensors
    of every expert per block, the router `ffn_gate_inp`), written with the gguf package's own
    writer and quantizer (random blocks for the K-quants it cannot write, as tests/test_quant.py
    does): `arch` qwen3moe, or llama with experts (how llama.cpp writes Mixtral). The default
    model's tokenizer cut to `SMALL_VOCAB` tokens; embedding and head in float16. `expert_types`: per
    block, the ggml types of its gate, up and down."""
    import gguf
    import numpy as np

    from hpipe import models
    from test_quant import file_blocks

    T = gguf.GGMLQuantizationType
    source, tokens, types, merges = small_tokenizer()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random tiny {arch} with experts")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    blocks = len(expert_types)
    w.add_block_count(blocks)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(ff)
    w.add_vocab_size(vocab)
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    models.copy_gguf_fields(source, w, lambda key: key.startswith("tokenizer.") and key not in arrays)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    rng = np.random.default_rng(seed)

    def mat(*shape, std=0.05):
        return rng.standard_normal(shape, dtype=np.float32) * std

    def add(name, values, qtype=T.Q8_0):
        if qtype in (None, T.F16):
            w.add_tensor(name, values.astype(np.float32 if qtype is None else np.float16))
        elif values.ndim == 3:
            # K-quant blocks drawn with weights of the floats' size (super-block d small), and Q6_K's
            # group scales as a quantizer of normal weights leaves them (all near the largest, 80-127)
            raw = np.stack([file_blocks(v, qtype, rng, d=(1e-4, 2e-4)) for v in values])
            if qtype == T.Q6_K:
                blocks_ = raw.reshape(*raw.shape[:2], -1, 210)
                blocks_[..., 192:208] = rng.integers(80, 128, blocks_[..., 192:208].shape, dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, file_blocks(values, qtype, rng), raw_dtype=qtype)

    add("token_embd.weight", mat(vocab, hidden), T.F16)
    for b in range(blocks):
        add(f"blk.{b}.attn_norm.weight", 1 + mat(hidden), None)
        add(f"blk.{b}.attn_q.weight", mat(heads * head_dim, hidden))
        add(f"blk.{b}.attn_k.weight", mat(kv_heads * head_dim, hidden))
        add(f"blk.{b}.attn_v.weight", mat(kv_heads * head_dim, hidden))
        add(f"blk.{b}.attn_output.weight", mat(hidden, heads * head_dim))
        if arch == "qwen3moe":
            add(f"blk.{b}.attn_q_norm.weight", 1 + mat(head_dim), None)
            add(f"blk.{b}.attn_k_norm.weight", 1 + mat(head_dim), None)
        add(f"blk.{b}.ffn_norm.weight", 1 + mat(hidden), None)
        add(f"blk.{b}.ffn_gate_inp.weight", mat(experts, hidden, std=0.5), None)   # routes spread out
        for part, shape, qtype in zip(("gate", "up", "down"), ((ff, hidden), (ff, hidden), (hidden, ff)),
                                      expert_types[b]):
            add(f"blk.{b}.ffn_{part}_exps.weight", mat(experts, *shape), T[qtype])
    add("output_norm.weight", 1 + mat(hidden), None)
    add("output.weight", mat(vocab, hidden), T.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# HPIPE_TEST_CPU_LOG=FILE: each test's CPU (its worker's process tree: the processes, servers and
# emulated hosts it starts; a cgroup v1 `cpuacct` group per pytest-xdist worker, root only) and wall
# seconds, a tab-separated line each, appended to FILE: where the suite's CPU goes test by test
# (bench/suite_cpu.py says by kind of process). Off unless set.
_CPU_GROUP = None
if os.environ.get("HPIPE_TEST_CPU_LOG") and os.path.isdir("/sys/fs/cgroup/cpuacct"):
    _CPU_GROUP = Path("/sys/fs/cgroup/cpuacct") / f"hpipe-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    _CPU_GROUP.mkdir(exist_ok=True)
    (_CPU_GROUP / "cgroup.procs").write_text(str(os.getpid()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _CPU_GROUP is None:
        yield
        return
    import time

    cpu, wall = int((_CPU_GROUP / "cpuacct.usage").read_text()), time.monotonic()
    yield
    cpu = (int((_CPU_GROUP / "cpuacct.usage").read_text()) - cpu) / 1e9
    with open(os.environ["HPIPE_TEST_CPU_LOG"], "a") as f:
        f.write(f"{item.nodeid}\t{cpu:.1f}\t{time.monotonic() - wall:.1f}\t{_CPU_GROUP.name}\n")
