"""GGUF files of the sizes people split across boxes, made here from random weights (no download).

A shape is a Llama of a real model's dimensions with SmolLM2's tokenizer (its 49,152-token
vocabulary, so the embedding is smaller than the real model's): `1b` is Llama-3.2-1B's (hidden
2048, 16 blocks, 32/8 heads, MLP 8192, tied embedding), `8b-4` four blocks of Llama-3.1-8B's
(hidden 4096, 32/8 heads, MLP 14336) and its untied head. Weights are drawn once from a normal
of std 0.02 (seed 0, numpy's PCG64), written as an F16 GGUF by the `gguf` package, then quantized
by llama.cpp's own `llama-quantize --pure` (every matrix in the one type; the `gguf` package
quantizes Q4_0/Q8_0 but not the K-quants, and llama.cpp's quantizer is what users' files come
from). Files are kept under `~/.cache/hpipe/bench-models/`.

    python bench/shapes.py 1b Q4_0 Q4_K Q8_0        # prints the paths

llama.cpp's binaries: $LLAMA_CPP_BIN (default /opt/llama.cpp/build/bin; see
../shared/notes/peers.md for the build).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

SEED = 0
QUANT_TYPES = ("Q4_0", "Q4_K", "Q8_0")


@dataclass(frozen=True)
class Shape:
    hidden: int
    blocks: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool
    label: str


SHAPES = {"1b": Shape(2048, 16, 32, 8, 8192, True, "Llama-3.2-1B's shape"),
          "8b-4": Shape(4096, 4, 32, 8, 14336, False, "4 blocks of Llama-3.1-8B's shape")}


def llama_cpp_bin(name: str) -> Path:
    path = Path(os.environ.get("LLAMA_CPP_BIN", "/opt/llama.cpp/build/bin")) / name
    if not path.exists():
        raise SystemExit(f"{path} not found: build llama.cpp (../shared/notes/peers.md) or set LLAMA_CPP_BIN")
    return path


def models_dir() -> Path:
    from hpipe import models

    d = models.cache_dir() / "bench-models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write_f16(shape: Shape, path: Path) -> None:
    import gguf
    import numpy as np

    from hpipe import models

    source = gguf.GGUFReader(str(models.smollm2_gguf_path()))
    vocab = int(source.fields["llama.vocab_size"].parts[-1][0])
    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    w.add_name(f"random {shape.label}")
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.blocks)
    w.add_feed_forward_length(shape.mlp)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    models.copy_gguf_fields(source, w, lambda key: key.startswith("tokenizer."))   # SmolLM2's tokenizer, as it is
    rng = np.random.default_rng(SEED)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    w.add_tensor("token_embd.weight", matrix(vocab, h))
    for b in range(shape.blocks):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{b}.attn_q.weight", matrix(h, h))
        w.add_tensor(f"blk.{b}.attn_k.weight", matrix(kv, h))
        w.add_tensor(f"blk.{b}.attn_v.weight", matrix(kv, h))
        w.add_tensor(f"blk.{b}.attn_output.weight", matrix(h, h))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate.weight", matrix(shape.mlp, h))
        w.add_tensor(f"blk.{b}.ffn_up.weight", matrix(shape.mlp, h))
        w.add_tensor(f"blk.{b}.ffn_down.weight", matrix(h, shape.mlp))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    if not shape.tied:
        w.add_tensor("output.weight", matrix(vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".part", path)


def model_file(name: str, qtype: str) -> Path:
    """The shape's GGUF file in `qtype` (F16, Q4_0, Q4_K, Q8_0), made once."""
    shape = SHAPES[name]
    f16 = models_dir() / f"{name}-F16.gguf"
    if not f16.exists():
        _write_f16(shape, f16)
    if qtype == "F16":
        return f16
    out = models_dir() / f"{name}-{qtype}.gguf"
    if not out.exists():
        ftype = {"Q4_K": "Q4_K_M"}.get(qtype, qtype)       # with --pure: every matrix Q4_K
        subprocess.run([str(llama_cpp_bin("llama-quantize")), "--pure", str(f16), str(out) + ".part", ftype],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.replace(str(out) + ".part", out)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="GGUF files of real models' shapes from random weights: "
                                     "prints their paths (made once, kept under ~/.cache/hpipe/bench-models/)")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("types", nargs="*", default=list(QUANT_TYPES), help=f"ggml types (default: {' '.join(QUANT_TYPES)})")
    args = parser.parse_args()
    for q in args.types:
        print(model_file(args.shape, q))


if __name__ == "__main__":
    main()
