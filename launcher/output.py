"""One request's output, assembled in one place on the client side of the pipeline.

Stage 0 reports a request's tokens and its end; the last stage reports the log-probabilities of
the same tokens (and of an echoed prompt's), on another pipe, in either order. `RequestOutput`
pairs each token with its entry, detokenizes incrementally (`TextStream`), applies the stop
strings and decides the end. It emits ordered events, the only ones an HTTP handler formats:

    ("text", piece, entries)     text that became final, with the log-probability entries of the
                                 tokens taken since the last event ([token, log-probability, top])
    ("finish", reason, entries)  the end, once: OpenAI's "stop" or "length"
    ("error", message, ())       the pipeline failed

Where each finish reason is decided:
- "stop" for the model's EOS and a request's stop ids: stage 0 (`Request.finish_reason`, "eos" or
  "stop"), mapped here (`FINISH`);
- "stop" for a stop string: here (`TextStream`), which also has the request aborted at once;
- "length" for max_tokens: stage 0 ("length"); an echo without generated tokens: here.

Pure Python, no asyncio: `PipelineClient` feeds it from the thread that reads the stages' reports.
"""

from __future__ import annotations

import collections
import time

from hpipe.request import Request

__all__ = ["FINISH", "LOGPROB_WAIT_S", "RequestOutput", "TextStream"]

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}   # stage 0's reasons in OpenAI's words
LOGPROB_WAIT_S = 10.0      # how long an ended request waits for log-probabilities still on their way


class TextStream:
    """Token ids -> text as it becomes final (incremental detokenization, as vLLM does: each token is
    decoded with a few tokens before it, never the whole output again), holding back what may be the
    start of a stop string and anything that ends in half a character."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0          # ids[prefix:read] were decoded last time (context for the next)
        self.text = ""
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False
        self.tokens_used = 0                   # tokens up to the one that completed a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        hits = [h for h in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if h >= 0]
        if hits:
            self.stopped = True
            self.tokens_used = len(self.ids)
            return self._take(min(hits))
        return self._take(len(self.text) - self.hold)

    def finish(self) -> str:
        if self.stopped:
            return ""
        if self.read < len(self.ids):     # a trailing half character: whatever the tokenizer makes of it
            self.text += self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]
            self.read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out


class RequestOutput:
    """The state machine of one request's output (see the module's docstring). Every method returns
    the events it made, in order; `done` once the end (or an error) went out; `stopped` when a stop
    string ended it (the caller aborts the request at stage 0)."""

    def __init__(self, request: Request, tokenizer, stops: list[str], echo: str | None = None,
                 generates: bool = True):
        self.request, self.text = request, TextStream(tokenizer, stops)
        self.echo = echo                       # completions' echo: the prompt's text, first
        self.generates = generates             # False: max_tokens 0 with echo (the one token sampled is dropped)
        self.wants = request.params.logprobs is not None
        self.prompt_wanted = len(request.input_ids) - 1 if request.params.prompt_logprobs is not None else 0
        self.tokens: collections.deque = collections.deque()
        self.logprobs: collections.deque = collections.deque()
        self.prompt: list = []                 # an echoed prompt's entries, [position, token, lp, top]
        self.entries: list = []                # entries of tokens taken, not yet sent
        self.n_tokens = 0
        self.taken = 0                         # tokens gone to the text (or dropped, without `generates`)
        self.end: str | None = None            # stage 0's reason, once it came
        self.deadline: float | None = None     # after the end: entries still missing are given up then
        self.given_up = False                  # the deadline passed: what is missing is not waited for
        self.done = self.stopped = False

    # ------------------------------------------------------------------ what arrives
    def token(self, token: int) -> list[tuple]:
        self.tokens.append(token)
        self.n_tokens += 1
        return self._drain()

    def logprob(self, entry: list) -> list[tuple]:
        self.logprobs.append(entry)
        return self._drain()

    def prompt_logprob(self, entry: list) -> list[tuple]:
        self.prompt.append(entry)
        return self._drain()

    def finish(self, reason: str) -> list[tuple]:
        self.end = reason
        self.deadline = time.monotonic() + LOGPROB_WAIT_S
        return self._drain()

    def expire(self, now: float) -> list[tuple]:
        """Past the deadline, what is missing is given up (a report lost with a stage)."""
        if self.deadline is None or now <= self.deadline:
            return []
        self.given_up = True
        return self._drain()

    def error(self, message: str) -> list[tuple]:
        if self.done:
            return []
        self.done = True
        return [("error", message, ())]

    def rewind(self) -> int:
        """The pipeline was lost and the request resumes on another: the tokens still waiting for
        their log-probabilities, the entries ahead of their tokens and an echoed prompt's entries
        not all come are dropped (they come again). Returns how many tokens it keeps: the first of
        its output the resumed request carries."""
        self.tokens.clear()
        self.logprobs.clear()
        if self.prompt_pending:
            self.prompt = []
        self.n_tokens = self.taken
        return self.taken

    @property
    def prompt_pending(self) -> bool:
        """An echoed prompt's entries are still to go out."""
        return self.echo is not None and self.prompt_wanted > 0

    @property
    def completion_tokens(self) -> int:
        """Tokens the answer counts: up to the one that completed a stop string, none for an echo alone."""
        if not self.generates:
            return 0
        return self.text.tokens_used if self.stopped else self.n_tokens

    # ------------------------------------------------------------------ what goes out
    def _drain(self) -> list[tuple]:
        if self.done:
            return []
        out = []
        late = self.given_up or (self.deadline is not None and time.monotonic() > self.deadline)
        if self.echo is not None:
            if len(self.prompt) < self.prompt_wanted and not late:
                return out
            first = [[self.request.input_ids[0], None, None]] if self.prompt_wanted else []
            out.append(("text", self.echo, first + [e[1:] for e in sorted(self.prompt)] if self.wants else []))
            self.echo = None
        while self.tokens and (self.logprobs or not self.wants or late):
            token = self.tokens.popleft()
            self.taken += 1
            entry = self.logprobs.popleft() if self.wants and self.logprobs else None
            if not self.generates:
                continue
            if entry is not None:
                self.entries.append(entry)
            piece = self.text.add(token)
            if self.text.stopped:
                self.stopped = True
                return out + self._last(piece, "stop")
            if piece:
                out.append(("text", piece, self._take()))
        if self.end is not None and not self.tokens:
            piece = self.text.finish() if self.generates else ""
            out += self._last(piece, FINISH.get(self.end, "stop") if self.generates else "length")
        return out

    def _last(self, piece: str, reason: str) -> list[tuple]:
        self.done = True
        return ([("text", piece, self._take())] if piece else []) + [("finish", reason, self._take())]

    def _take(self) -> list:
        taken, self.entries = self.entries, []
        return taken
