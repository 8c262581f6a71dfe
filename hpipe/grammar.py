"""Structured output: a grammar's token mask applied where hpipe's sampler already runs, on the
CPU off the pipeline's critical path (SiPipe's split again). The grammar engine is llguidance
(what vLLM's `guidance` backend uses); a request's grammar travels as llguidance's own grammar
text in `SamplingParams.grammar`, built here from what the API takes (a JSON schema, any JSON
object, a regex, a choice among strings).

    grammar = json_schema_grammar({"type": "object", ...})
    vocab = GrammarVocabulary(model_dir, vocab_size)     # one per process; its tokenizer is built once
    vocab.check(grammar)                                  # "" or what is wrong (the API's 400)
    masks = GrammarMasks(vocab)                           # a sampler's: one matcher per request
    masks.start(index, grammar); logits = masks.apply(logits, seqs); masks.advance(seqs, ids)

JSON is compact (no free whitespace between tokens, llguidance's `whitespace_flexible` off): a
small model given free whitespace can pad forever. Once a grammar is complete its mask holds the
end-of-sequence tokens alone, so the request ends as any other does (stage 0 sees its EOS).
"""

from __future__ import annotations

import collections
import json
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from hpipe import models
from hpipe.errors import HpipeError

__all__ = ["GrammarMasks", "GrammarVocabulary", "choice_grammar", "json_object_grammar", "json_schema_grammar",
           "regex_grammar"]

JSON_DEFAULTS = {"whitespace_flexible": False}
TEMPLATES = 64          # compiled grammars kept per process (a matcher per request is a copy of one)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise HpipeError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


def json_schema_grammar(schema: dict) -> str:
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    return _llguidance().LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


class GrammarVocabulary:
    """The model's tokenizer as the grammar engine sees it (built on first use: ~0.4 s), its
    end-of-sequence ids those of the model's requests, and the grammars compiled so far (LRU)."""

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.model_dir, self.vocab_size = str(model_dir), int(vocab_size)
        self.templates: collections.OrderedDict = collections.OrderedDict()

    @cached_property
    def tokenizer(self):
        llg = _llguidance()
        hf = models.load_tokenizer(Path(self.model_dir))
        if hf is None:
            raise HpipeError(f"{self.model_dir}: structured output needs the model's tokenizer files")
        config = models.load_config(Path(self.model_dir))
        eos = models.eos_token_ids(Path(self.model_dir), config) or None
        return llg.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)

    def check(self, grammar: str) -> str:
        """What is wrong with the grammar ("" when nothing is)."""
        try:
            return _llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer)
        except (ValueError, RuntimeError) as e:
            return str(e)

    def matcher(self, grammar: str):
        """A fresh matcher for one request: a copy of the grammar's compiled template."""
        template = self.templates.pop(grammar, None)
        if template is None:
            llg = _llguidance()
            template = llg.LLMatcher(self.tokenizer, grammar, log_level=0,
                                     limits=llg.LLParserLimits(verbose_errors=False))
            if template.is_error():
                raise HpipeError(f"the grammar does not compile: {template.get_error()}")
        self.templates[grammar] = template
        while len(self.templates) > TEMPLATES:
            self.templates.popitem(last=False)
        return template.deep_copy()


class GrammarMasks:
    """A sampler's grammar state: a matcher per request that has a grammar and the mask of its next
    token, computed as soon as its last token is known (before the next micro-batch's logits come).
    Requests without one never reach here."""

    def __init__(self, vocab: GrammarVocabulary):
        self.vocab = vocab
        self.words = (vocab.vocab_size + 31) // 32
        self.matchers: dict[int, object] = {}
        self.masks: dict[int, torch.Tensor] = {}        # request index -> allowed [V] (bool)

    def start(self, index: int, grammar: str) -> None:
        self.matchers[index] = self.vocab.matcher(grammar)
        self._fill(index)

    def drop(self, index: int) -> None:
        self.matchers.pop(index, None)
        self.masks.pop(index, None)

    def apply(self, logits: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        """A copy of the logits with every grammar row's disallowed tokens at -inf (the logits
        themselves when no row has a grammar)."""
        rows = [(i, s) for i, s in enumerate(seqs) if s in self.masks]
        if not rows:
            return logits
        out = logits.clone()
        for i, s in rows:
            out[i].masked_fill_(~self.masks[s], float("-inf"))
        return out

    def advance(self, seqs: list[int], ids: list[int]) -> None:
        """Each grammar row's token goes to its matcher, and its next mask is computed. A row
        after its grammar ended (a leftover decode step, dropped by stage 0) changes nothing."""
        for s, t in zip(seqs, ids):
            m = self.matchers.get(s)
            if m is None or m.is_stopped() or m.is_error():
                continue
            if m.consume_token(int(t)):
                self._fill(s)
            else:
                self.masks.pop(s, None)

    def _fill(self, index: int) -> None:
        import llguidance.numpy as lnp

        bits = np.zeros((1, self.words), dtype=np.int32)
        lnp.fill_next_token_bitmask(self.matchers[index], bits, 0)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab.vocab_size].astype(bool)
        self.masks[index] = torch.from_numpy(allowed)
