"""What every launch does, wherever its workers run: check the plan against the model, turn prompts
into token ids, take the workers' reports (`@@hpipe {json}` lines) and write results as they
finish. `launcher.local` runs the workers as local processes; the SSH launcher runs the same
worker command on remote hosts and feeds its output through the same `JobOutput`.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import time
from dataclasses import dataclass, field

import numpy as np

from hpipe import formats, models, protocol
from hpipe.config import RuntimeConfig
from hpipe.errors import HpipeError
from hpipe.launcher.overheads import decode_terms
from hpipe.launcher.progress import JobProgress
from hpipe.launcher.pulses import Pulses
from hpipe.launcher.run_chart import predicted_timeline, stage_table, write_run_timeline
from hpipe.planner import simulate
from hpipe.prediction import DecodePrediction, Prediction
from hpipe.request import BATCH_SAMPLING, MAX_NEW_TOKENS, Request, SamplingParams, sequence_seed


@dataclass
class LaunchSettings:
    """What a launch adds to the runtime's config: the job's own settings."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)   # how the stage workers run
    max_new_tokens: int = MAX_NEW_TOKENS
    params: SamplingParams = BATCH_SAMPLING      # seed: see `seed`
    seed: int = 0
    logits_out: str | None = None
    resume: bool = False
    serve: bool = False              # requests come on stage 0's stdin (hpipe serve), not in a file
    # CPU stages get their compiled decode graphs beside them, not before the first step (hpipe
    # serve: a server outlives the minute; hpipe.runtime.background_compile)
    background_compile: bool = False
    log_dir: str | None = None       # every stage's log lines, whole, in LOG_DIR/stage-R.log


@dataclass
class PreparedJob:
    plan: formats.Plan
    source: models.ModelSource
    config: object
    tokenizer: object
    requests: list[Request]         # the prompts still to run
    skipped: list[str]              # ids already in the results file (--resume)


def encode_prompt(tokenizer, record: formats.PromptRecord, where: str = "") -> list[int]:
    if record.input_ids is not None:
        return list(record.input_ids)
    if tokenizer is None:
        raise HpipeError(f"{where}prompt {record.id!r} is text, but the model has no tokenizer files; "
                         f"give \"input_ids\" instead")
    if not record.raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": record.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(record.prompt)["input_ids"]]


def check_settings(settings: LaunchSettings) -> None:
    """The job's own settings (the runtime's are checked by RuntimeConfig itself)."""
    if settings.max_new_tokens < 1:
        raise HpipeError(f"--max-new-tokens must be at least 1, got {settings.max_new_tokens}")


def prepare_model(plan_path: str, settings: LaunchSettings, model: str | None = None,
                  progress=None) -> PreparedJob:
    """The plan checked against its model, the tokenizer loaded, no requests yet (serving)."""
    check_settings(settings)
    plan = formats.load_plan(plan_path)
    source = models.resolve_model(model or plan.model.name, progress=progress)
    config = models.load_config(source.path)
    models.check_plan_matches(plan, config, source.name)
    return PreparedJob(plan, source, config, models.load_tokenizer(source.path), [], [])


@dataclass(frozen=True)
class JobFiles:
    """A batch job's own files, read before its model: the prompts, and the ids of those the results
    file already holds (--resume)."""

    prompts: list[formats.PromptRecord]
    done_ids: frozenset[str]


def read_job_files(prompts_path: str, out_path: str, settings: LaunchSettings) -> JobFiles:
    """The job's settings and files checked first: a mistake in them is one line at once, where it
    came after the model's loading (~6 s of a local launch's imports and its fork server's start)."""
    check_settings(settings)
    prompts = formats.load_prompts(prompts_path)
    done_ids: frozenset[str] = frozenset()
    if os.path.exists(out_path) and os.path.getsize(out_path) > 0:
        if not settings.resume:
            raise HpipeError(f"{out_path}: results file already exists; pass --resume to skip the prompts "
                             f"it holds, or choose another --out")
        done_ids = frozenset(r["id"] for r in formats.load_results(out_path))
    return JobFiles(prompts, done_ids)


def prepare(plan_path: str, prompts_path: str, out_path: str, settings: LaunchSettings,
            model: str | None = None, progress=None, files: JobFiles | None = None) -> PreparedJob:
    """files: `read_job_files`' (the `hpipe` command reads them before it starts its fork server)."""
    files = files or read_job_files(prompts_path, out_path, settings)
    prompts, done_ids = files.prompts, files.done_ids
    base = prepare_model(plan_path, settings, model, progress)
    plan, source, config, tokenizer = base.plan, base.source, base.config, base.tokenizer
    eos = frozenset(models.eos_token_ids(source.path, config))
    ctx = models.max_model_len(settings.runtime.max_model_len, config)
    limit = "--max-model-len" if ctx < models.context_length(config) else "the model's context"
    vocab = int(config.vocab_size)
    requests = []
    for rec in prompts:
        if rec.id in done_ids:
            continue
        ids = encode_prompt(tokenizer, rec, f"{prompts_path}: ")
        for what, tokens in (("token id", ids), ("stop_token_ids: id", rec.stop_token_ids)):
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise HpipeError(f"{prompts_path}: prompt {rec.id!r}: {what} {bad[0]} is outside the vocabulary "
                                 f"(size {vocab})")
        new = settings.max_new_tokens if rec.max_new_tokens is None else rec.max_new_tokens
        if len(ids) + new > ctx:
            which = "--max-new-tokens" if rec.max_new_tokens is None else "its max_new_tokens"
            raise HpipeError(f"{prompts_path}: prompt {rec.id!r} has {len(ids)} tokens; with {which} {new} that "
                             f"exceeds {limit} of {ctx} tokens; shorten the prompt or lower {which}")
        # the launch's parameters, a seed of the request's own, then the prompt's overrides (its seed included)
        params = SamplingParams(**{**settings.params.__dict__, "seed": sequence_seed(settings.seed, rec.id),
                                   **(rec.sampling or {})})
        if params.grammar is not None:
            raise HpipeError(f"{prompts_path}: prompt {rec.id!r} has a grammar: structured output is served by "
                             f"hpipe serve (response_format, guided_json); remove it")
        if params.logprobs is not None:
            raise HpipeError(f"{prompts_path}: prompt {rec.id!r} asks for logprobs: hpipe serve answers them "
                             f"(OpenAI's logprobs / top_logprobs); a batch job does not write them: remove it")
        requests.append(Request(len(requests), rec.id, tuple(ids), params, new, eos,
                                frozenset(rec.stop_token_ids)))
    return PreparedJob(plan, source, config, tokenizer, requests, sorted(done_ids))


HEARTBEAT_TIMEOUT_S = 5.0   # a host silent this long is lost (--heartbeat-timeout; its wrapper reports every second)


@dataclass(kw_only=True)
class StageReports:
    """What every launch collects from its workers' reports (`hpipe.protocol`): the timelines, stage
    0's summary and each stage's one-line error. The batch job (`JobOutput`) and the server
    (`hpipe.launcher.serving`) each take the rest in `take_report`."""

    timelines: dict[int, dict] = field(default_factory=dict)
    summary: dict | None = None
    errors: dict[int, str] = field(default_factory=dict)
    peers_lost: set[int] = field(default_factory=set)     # stages that fell because a neighbour died
    events: list = field(default_factory=list)            # hosts lost and the plans that went on (launcher/elastic.py)
    notices: list[tuple[int, str]] = field(default_factory=list)     # (rank, text) not yet shown
    pulses: Pulses = field(default_factory=Pulses)        # the stages' last minute (launcher/pulses.py)

    def restart(self, plan: formats.Plan | None = None) -> None:
        """Another pipeline starts (a lost host's recovery), on `plan`: the last one's stage reports go."""
        self.timelines.clear()
        self.errors.clear()
        self.peers_lost.clear()
        self.pulses.clear()

    def take(self, rank: int, line: str) -> bool:
        """Handles one stdout line of a worker; False if it is not a report (a log line)."""
        report = protocol.read_report(line)
        if report is None:
            return False
        if isinstance(report, protocol.Pulse):
            self.pulses.take(report)
            self.on_pulse()
        elif isinstance(report, protocol.IntervalsReport):
            self.timelines[report.rank] = protocol.as_dict(report)
        elif isinstance(report, protocol.Summary):
            self.summary = protocol.as_dict(report)
        elif isinstance(report, protocol.Notice):
            self.notices.append((rank, report.text))
        elif isinstance(report, protocol.Error):
            self.errors[rank] = report.message
            if report.peer_lost:
                self.peers_lost.add(rank)
        else:
            self.take_report(report)
        return True

    def take_report(self, report) -> None:
        pass

    def on_pulse(self) -> None:
        pass

    def done_line(self) -> str:
        return "no request had finished"


@dataclass
class JobOutput(StageReports):
    """A batch job's reports: each finished prompt is appended to the results file."""

    out_path: str = ""
    tokenizer: object = None
    requests: list[Request] = field(default_factory=list)   # the job's, by index (a result names its index)
    results: list[dict] = field(default_factory=list)
    progress: JobProgress | None = None                     # shown while it runs (launcher/progress.py)

    def done_line(self) -> str:
        return f"{len(self.results)} results were written"

    def lost_hosts(self) -> tuple[str, ...]:
        return tuple(e.host for e in self.events if e.kind == "lost")

    def on_pulse(self) -> None:
        if self.progress is not None:
            self.progress.update(self.pulses, self.lost_hosts())

    def restart(self, plan: formats.Plan | None = None) -> None:
        super().restart(plan)
        if self.progress is not None and plan is not None:
            self.progress.restart(self.pulses, self.requests, plan)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close(self.pulses, self.lost_hosts())

    def take_report(self, report) -> None:
        if isinstance(report, protocol.Result):
            if self.progress is not None:
                self.progress.finished(self.requests[report.index].id, len(report.output_ids))
            ids = report.output_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None
            fields = protocol.as_dict(report)
            del fields["index"]
            record = {"id": self.requests[report.index].id, "output_ids": ids, "text": text, **fields}
            formats.append_result(self.out_path, record)
            self.results.append(record)


def job_output(job: PreparedJob, out_path: str, log, quiet: bool) -> JobOutput:
    """A batch job's reports, with its progress shown as `log` and `quiet` choose (launcher/progress.py)."""
    return JobOutput(out_path, job.tokenizer, job.requests,
                     progress=JobProgress(job.requests, job.plan, JobProgress.display_for(log, quiet)))


def trim_logits(path: str, results: list[dict]) -> None:
    """--logits-out: the last stage wrote every row it sampled; a request's rows past its output
    are leftover steps after its stop (stage 0 decided it: the result's length)."""
    import numpy as np
    with np.load(path) as f:
        rows = {k: f[k] for k in f.files}
    kept = {r["id"]: len(r["output_ids"]) for r in results}
    np.savez(path, **{k: v[:kept.get(k, len(v))] for k, v in rows.items()})


def busy_fractions(timelines: dict[int, dict]) -> dict[int, float]:
    """Per stage: the share of the run (first to last activity of any stage) spent computing."""
    return {r: row["busy"] for r, row in stage_table(timelines).items()}


def stage_busy_seconds(timelines: dict[int, dict], kind: str | None = None) -> dict[int, float]:
    return {r: sum(i["end"] - i["start"] for i in t["intervals"]
                   if i["what"] == "compute" and (kind is None or i.get("kind") == kind))
            for r, t in sorted(timelines.items())}


TOLERANCE = 0.10    # beyond this relative difference the run summary names the terms that are off


def plan_check(plan: formats.Plan, output: JobOutput, prompt_lengths: list[int]) -> dict | None:
    """Predicted against measured, for a plan that carries predictions. Prefill: the makespan (the
    last first token of the batch) and each stage's prefill busy time. Decode (one stream, the plan
    made for one row per group): each term of a token's trip, every stage's compute, every hop, the
    way back, read off the timelines (`decode_terms`). `off` names, beyond TOLERANCE, the terms
    that make the difference."""
    pr = plan.pipeline_prediction
    if pr is None or not output.results:
        return None
    measured = max(r["ttft_s"] for r in output.results)
    tokens = sum(prompt_lengths)
    busy = list(stage_busy_seconds(output.timelines, "prefill").values())
    diff = (measured - pr.makespan_s) / pr.makespan_s
    planned = len(prompt_lengths) == pr.batch and all(n == pr.seq_len for n in prompt_lengths)
    off = []
    modelled = _with_measured_compute(pr, output.timelines) if planned else None
    if abs(diff) > TOLERANCE:
        off += _prefill_off(pr, busy, measured, modelled) if planned else [
            f"prefill: the run ({len(prompt_lengths)} prompts, {tokens} tokens) is not the work planned for "
            f"({pr.batch} x {pr.seq_len} tokens): plan for it to compare"]
    decode = _decode_check(pr.decode, [output.timelines[r] for r in sorted(output.timelines)])
    if decode and abs(decode["relative_difference"]) > TOLERANCE:
        off += decode["off"]
    return {
        "predicted_makespan_s": pr.makespan_s, "measured_makespan_s": measured, "relative_difference": diff,
        "predicted_for": {"seq_len": pr.seq_len, "batch": pr.batch},
        "measured_for": {"prompts": len(prompt_lengths), "prompt_tokens": tokens},
        "predicted_stage_busy_s": pr.stage_busy_s, "measured_stage_busy_s": busy,
        "predicted_with_measured_compute_s": modelled,
        "predicted_throughput_tokens_per_s": pr.throughput_tokens_per_s,
        "measured_throughput_tokens_per_s": tokens / measured if measured > 0 else None,
        "decode": decode, "off": off, "tolerance": TOLERANCE,
        "reprofile_suggested": abs(diff) > TOLERANCE or bool(decode and abs(decode["relative_difference"]) > TOLERANCE),
    }


def _with_measured_compute(pr: Prediction, timelines: dict[int, dict]) -> float | None:
    """The plan's pipeline re-simulated with every slice's compute as the run measured it (the sends
    and the way back as predicted): what the prediction would have been had the profile known how
    fast the devices ran today. None when the run's slices are not the plan's."""
    if pr.slice_compute_s is None:
        return None
    predicted = np.asarray(pr.slice_compute_s, dtype=float)
    got = np.zeros_like(predicted)
    for j, r in enumerate(sorted(timelines)):
        spans = sorted((i["start"], i["end"]) for i in timelines[r]["intervals"]
                       if i["what"] == "compute" and i.get("kind") == "prefill")
        if j >= got.shape[1] or len(spans) != got.shape[0]:
            return None
        got[:, j] = [e - s for s, e in spans]
    return simulate(got, np.asarray(pr.slice_send_s, dtype=float)).makespan + pr.way_back_s


def _prefill_off(pr: Prediction, busy: list[float], measured: float, modelled: float | None) -> list[str]:
    """Which prefill terms are off: the stages whose compute is (and whether the pipeline model holds
    once their measured compute is put in), else the time between them."""
    out = []
    for j, (p, m) in enumerate(zip(pr.stage_busy_s or (), busy)):
        if p > 0 and abs(m - p) / p > TOLERANCE:
            out.append(f"prefill: stage {j}'s compute {m:.3f} s against {p:.3f} s predicted ({(m - p) / p:+.0%}): "
                       f"its device ran slower or faster than profiled (other load, shared cores, another clock)")
    if out and modelled is not None and abs(measured - modelled) <= TOLERANCE * measured:
        out.append(f"prefill: with the compute the stages measured, the plan's pipeline gives {modelled:.3f} s "
                   f"({(modelled - measured) / measured:+.0%} of the run): the model holds, the devices' speed "
                   f"differs from the profile's; profile again under the run's conditions")
    if not out:
        out.append(f"prefill: every stage's compute is within {TOLERANCE:.0%} of its prediction, so the "
                   f"{measured - pr.makespan_s:+.3f} s are between them: the links, the hops or the waiting "
                   f"(profile the links again, or check the hosts' network)")
    return out


def decode_check(plan: formats.Plan, timelines: dict[int, dict]) -> dict | None:
    """`plan_check`'s decode part alone, for a service (`hpipe serve` at its end): the steady tokens
    of single streams, when the plan predicts them (one row per group) and the run had them."""
    pr = plan.pipeline_prediction
    return _decode_check(pr.decode if pr is not None else None, [timelines[r] for r in sorted(timelines)])


def decode_check_lines(check: dict | None) -> list[str]:
    """What a run's decode check says (`decode_check`, `plan_check`'s "decode"): predicted against
    measured, term by term, then the terms off by more than TOLERANCE, a line each."""
    if not check:
        return []
    terms = ", ".join(f"{k} {v:.2f} / {check['measured_terms_ms'].get(k, 0.0):.2f}"
                      for k, v in check["predicted_terms_ms"].items())
    head = (f"decode: predicted {check['predicted_ms_per_token']:.1f} ms/token, measured "
            f"{check['measured_ms_per_token']:.1f} ({check['relative_difference']:+.0%}); per term, predicted / "
            f"measured ms: {terms}; with the measured compute {check['predicted_with_measured_compute_ms']:.1f} ms")
    off = check["off"] if abs(check["relative_difference"]) > TOLERANCE else []
    return [head] + [f"off by more than {TOLERANCE:.0%}: {line}" for line in off]


def _decode_check(dec: DecodePrediction | None, timelines: list[dict]) -> dict | None:
    if dec is None or dec.terms is None or dec.rows_per_group != 1:
        return None
    got = decode_terms(timelines)
    if not got:
        return None
    terms = dec.terms
    d = len(terms.compute_s)
    predicted = {f"compute {j}": c for j, c in enumerate(terms.compute_s)}
    predicted.update({f"hop {j}->{j + 1}": s for j, s in enumerate(terms.send_s)})
    predicted["back"] = terms.back_s
    token = sum(predicted.values())
    diff = (got["token"] - token) / token
    # the same trip with the compute the stages measured: what is left is the model's own error
    modelled = token + sum(got.get(f"compute {j}", 0.0) - terms.compute_s[j] for j in range(d))
    off = []
    for name, p in predicted.items():
        m = got.get(name, 0.0)
        if abs(m - p) > TOLERANCE * token / max(1, d):
            what = ("its device ran slower or faster than profiled" if name.startswith("compute")
                    else "the link or the runtime's hop differ from the profile" if name.startswith("hop")
                    else "sampling, the ids' trip to stage 0 or the commit differ from the profile")
            off.append(f"decode: {name} {1000 * m:.2f} ms against {1000 * p:.2f} ms predicted: {what}")
    return {"predicted_ms_per_token": 1000 * token, "measured_ms_per_token": 1000 * got["token"],
            "relative_difference": diff, "predicted_with_measured_compute_ms": 1000 * modelled, "predicted_terms_ms": {k: 1000 * v for k, v in predicted.items()},
            "measured_terms_ms": {k: 1000 * v for k, v in got.items() if k != "token"}, "off": off}


def write_run_summary(job: PreparedJob, output: JobOutput, out_path: str, timeline_out: str | None = None) -> dict:
    """After a launch: `OUT.summary.json` (the run's figures, busy fractions, predicted against
    measured prefill) and, if asked, the timelines (.json, or charts as .html / .png, the plan's
    predicted prefill beside the measured run when the plan carries one). Returns the summary."""
    summary = {"version": 1, "run": output.summary or {}, "busy_fraction": busy_fractions(output.timelines),
               "links": {link: c for t in output.timelines.values() for link, c in t.get("links", {}).items()},
               "plan_check": plan_check(job.plan, output, [len(r.input_ids) for r in job.requests]),
               "events": [e.as_dict() for e in output.events]}
    with open(f"{out_path}.summary.json", "w") as f:   # first: a timeline that cannot be written loses nothing
        json.dump(summary, f, indent=2)
    if timeline_out:
        predicted = predicted_timeline(job)
        n_slices = len(job.plan.pipeline_prediction.slices) if predicted is not None else None
        title = (f"hpipe launch: {job.plan.model.name}, {len(job.plan.stages)} stages, "
                 f"{len(output.results)} prompts")
        write_run_timeline(timeline_out, output.timelines, predicted, title, slices_per_sequence=n_slices)
    return {**summary, "prompts_done": len(output.results)}


@dataclass(frozen=True)
class GroupSeat:
    """A SiDP replica's place: its stage in the plan, and its group's rendezvous (port and token)."""

    replica: int
    port: int
    token: str


def worker_command(python: str, plan_path: str, rank: int, world: int, addr: str, port: int, model: str,
                   requests_path: str | None, settings: LaunchSettings, threads: int,
                   logits_out: str | None, seat: GroupSeat | None = None) -> list[str]:
    """The runtime's worker command line, the same for local processes and remote hosts: the
    runtime config travels whole, as one JSON argument. What is per request (sampling parameters,
    seeds, limits, EOS ids) travels in the requests file, or (serving, requests_path None) on
    stage 0's stdin."""
    cmd = [python, "-m", "hpipe.runtime.worker", "--plan", plan_path, "--rank", str(rank),
           "--world-size", str(world), "--master-addr", addr, "--master-port", str(port), "--model", model,
           "--config", settings.runtime.to_json(), "--threads", str(threads)]
    cmd += ["--serve"] if requests_path is None else ["--requests", requests_path]
    if settings.background_compile:
        cmd += ["--background-compile"]
    if logits_out:
        cmd += ["--logits-out", logits_out]
    if seat is not None:
        cmd += ["--replica", str(seat.replica), "--group-port", str(seat.port)]
    return cmd


class StageLogs:
    """What each stage logged (its lines that are not reports): the last few that are not a
    library's warnings, for the failure's message, and (--log-dir) every line in DIR/stage-R.log."""

    WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")       # Python's warnings: `file:line: FooWarning: text`

    def __init__(self, n: int, log_dir: str | None = None):
        self.tails = [collections.deque(maxlen=20) for _ in range(n)]
        self.in_warning = [False] * n
        self.files = [open(os.path.join(log_dir, f"stage-{r}.log"), "a") for r in range(n)] if log_dir else []

    def add(self, rank: int, line: str) -> None:
        if self.files:
            self.files[rank].write(line + "\n")
            self.files[rank].flush()
        warning = self.WARNING.match(line) is not None
        if not warning and not (self.in_warning[rank] and line.startswith(" ")):   # nor the source line after it
            self.tails[rank].append(line)
        self.in_warning[rank] = warning

    def last(self, rank: int, n: int = 5) -> str:
        return " | ".join(list(self.tails[rank])[-n:])

    def close(self) -> None:
        for f in self.files:
            f.close()


def watch_workers(workers: list, lines: queue.Queue, output: JobOutput, plan: formats.Plan, log, quiet: bool,
                  host_timeout_s: float | None = None, log_dir: str | None = None) -> None:
    """Feeds the workers' lines to `output` and the log until every worker has ended. Workers look
    like subprocess.Popen (poll, wait) plus stop(), kill(), silent_s() and describe_exit(code).
    On the first failure (non-zero exit, or a host silent for host_timeout_s) every worker is
    stopped and one HpipeError names the stage, its host, the cause and its last log lines."""
    logs = StageLogs(len(workers), log_dir)
    try:
        _watch(workers, lines, output, plan, log, quiet, host_timeout_s, logs)
    finally:
        logs.close()


def _watch(workers: list, lines: queue.Queue, output: JobOutput, plan: formats.Plan, log, quiet: bool,
           host_timeout_s: float | None, logs: StageLogs) -> None:
    open_streams = 2 * len(workers)
    failed: tuple[int, str] | None = None

    def take(rank, name, line, show: bool = True):
        if not output.take(rank, line):
            logs.add(rank, line)
            if show and (not quiet or name == "err" and ("Error" in line or "Traceback" in line)):
                log(f"[{plan.stages[rank].host}:{rank}] {line}")
        while output.notices:        # shown quiet or not
            r, text = output.notices.pop(0)
            log(f"[{plan.stages[r].host}:{r}] {text}")

    while open_streams and failed is None:
        try:
            rank, name, line = lines.get(timeout=0.2)
            if line is None:
                open_streams -= 1
            else:
                take(rank, name, line)
        except queue.Empty:
            pass
        failed = _failed_now(workers, plan, host_timeout_s)
    if failed is None:
        failed = _exited_badly(workers)
    if failed is None:
        return
    silent = [w.silent_s() for w in workers]       # how long each had been quiet when the failure was seen
    rank, cause = root_failure(_failures_seen(failed, workers, lines, take), output.peers_lost)
    stop_workers(workers)
    deadline = time.time() + 1.0   # what is left of the output, for the message
    while time.time() < deadline:
        try:
            r, name, line = lines.get(timeout=0.1)
        except queue.Empty:
            break
        if line is not None:
            take(r, name, line, show=r == rank)
    stage = plan.stages[rank]
    cause = output.errors.get(rank) or cause
    last = logs.last(rank)
    raise StageFailure(f"stage {rank} ({stage.host} {stage.device}, units {stage.units[0]}-{stage.units[1] - 1}) "
                       f"failed: {cause}" + (f"; last log lines: {last}" if last else "")
                       + f"; every worker was stopped; {output.done_line()}", rank, stage.host,
                       silent[rank] if host_timeout_s is not None and silent[rank] >= host_timeout_s else 0.0)


def _failed_now(workers: list, plan: formats.Plan, host_timeout_s: float | None) -> tuple[int, str] | None:
    """The first worker that exited with an error, or whose host has been silent too long."""
    for r, w in enumerate(workers):
        code = w.poll()
        if code not in (None, 0):
            return r, w.describe_exit(code)
        if code is None and host_timeout_s is not None and w.silent_s() > host_timeout_s:
            return r, (f"no answer from host {plan.stages[r].host} for {host_timeout_s:g} s "
                       f"(its link is down or it stopped)")
    return None


def _exited_badly(workers: list) -> tuple[int, str] | None:
    """Every stream closed: the first worker whose exit is not a clean one."""
    for r, w in enumerate(workers):
        code = w.wait(timeout=30)
        if code != 0:
            return r, w.describe_exit(code) if code is not None else "did not exit after its streams closed"
    return None


def _failures_seen(failed: tuple[int, str], workers: list, lines: queue.Queue, take) -> dict[int, str]:
    """A stage that dies takes its neighbours down with it (their links close under them), and their
    exits may be seen first: a moment for every exit and report, so that the stage whose failure is
    not a lost peer can be blamed (`root_failure`)."""
    failures = {failed[0]: failed[1]}
    deadline = time.time() + 1.5
    while time.time() < deadline:
        try:
            r, name, line = lines.get(timeout=0.1)
            if line is not None:     # the fallen neighbours' lines: kept, not shown
                take(r, name, line, show=False)
        except queue.Empty:
            pass
        for r, w in enumerate(workers):
            code = w.poll()
            if r not in failures and code not in (None, 0):
                failures[r] = w.describe_exit(code)
    return failures


class StageFailure(HpipeError):
    """A stage that failed, the launcher's one line: its rank, its host and, when its silence was
    the failure, how long the launcher had heard nothing from it (the recovery's `notice` time; an
    exit is seen within the watch's 0.2 s)."""

    def __init__(self, message: str, rank: int, host: str, silent_s: float):
        super().__init__(message)
        self.rank, self.host, self.silent_s = rank, host, silent_s


class Launch:
    """A started pipeline, as the batch job and the server each drive it: `send` an op to stage 0
    (serving), `lines` (the workers' output lines, each a report for `output` or a log line),
    `wait` until every worker has ended (their reports go to `output` as they come), `stop` every
    worker now. `wait` always ends with the launcher's teardown (`cleanup`), and a failure is one
    HpipeError naming the stage."""

    def __init__(self, workers: list, lines: queue.Queue, output: StageReports, plan: formats.Plan, log,
                 quiet: bool, host_timeout_s: float | None = None, finish=None, cleanup=None, where: str = "",
                 log_dir: str | None = None):
        self.workers, self.lines, self.output, self.plan = workers, lines, output, plan
        self.log, self.quiet, self.host_timeout_s, self.log_dir = log, quiet, host_timeout_s, log_dir
        self.finish, self.cleanup, self.where = finish, cleanup, where
        self.t0 = time.time()

    def send(self, op) -> bool:
        """One op on stage 0's stdin; False once it is gone."""
        return self.workers[0].send_line(protocol.op_line(op))

    def stop(self) -> None:
        stop_workers(self.workers)

    def wait(self) -> float:
        """Until every worker has ended; returns the wall time since the start."""
        try:
            watch_workers(self.workers, self.lines, self.output, self.plan, self.log, self.quiet, self.host_timeout_s,
                          self.log_dir)
            if self.finish is not None:
                self.finish()
        except KeyboardInterrupt:
            self.stop()
            raise HpipeError(f"interrupted; every worker was stopped; {self.output.done_line()}{self.where}; rerun "
                             f"with --resume to finish") from None
        finally:
            self.stop()
            if self.cleanup is not None:
                self.cleanup()
        return time.time() - self.t0


def root_failure(failures: dict[int, str], peers_lost: set[int]) -> tuple[int, str]:
    """Of the stages that failed (in the order seen), the first that did not report a lost peer:
    that is the cause; the others fell with it."""
    for rank, cause in failures.items():
        if rank not in peers_lost:
            return rank, cause
    return next(iter(failures.items()))


def stop_workers(workers: list, grace_s: float = 5.0) -> None:
    """Asks every worker still running to stop, then kills those that have not within grace_s. A
    worker whose host has been silent for over 2 s (a remote wrapper reports every second) is not
    waited for: its channel is closed at once and the wrapper's own timeout stops it there."""
    live = []
    for w in workers:
        if w.poll() is None:
            if w.silent_s() > 2.0:
                w.kill()
            else:
                w.stop()
                live.append(w)
    deadline = time.time() + grace_s
    for w in live:
        if w.wait(timeout=max(0.05, deadline - time.time())) is None:
            w.kill()
