"""Sampling of the next token: one call at the end of the last stage.

This first version does greedy decoding and temperature sampling with a per-sequence seeded
generator (so a sequence's tokens do not depend on how it was batched). SiPipe's column-wise CPU
sampler, with vLLM's semantics and penalties, replaces `sample_next` (its own issue).
"""

from __future__ import annotations

import hashlib

import torch

GREEDY_BELOW = 1e-5  # vLLM: a temperature below this is greedy


def sequence_seed(seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Sampler:
    def __init__(self, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.temperature = temperature
        self.seed = seed
        self.generators: dict[int, torch.Generator] = {}

    def add(self, seq: int, request_id: str) -> None:
        g = torch.Generator(device="cpu")
        g.manual_seed(sequence_seed(self.seed, request_id))
        self.generators[seq] = g

    def sample_next(self, logits: torch.Tensor, seqs: list[int]) -> list[int]:
        """logits [n, V] float32 (any device) for the sequences `seqs`; returns n token ids."""
        logits = logits.detach().float().cpu()
        if self.temperature < GREEDY_BELOW:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return [int(torch.multinomial(probs[i], 1, generator=self.generators[s])) for i, s in enumerate(seqs)]
