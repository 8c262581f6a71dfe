"""The `hpipe` command line.

    hpipe warmup --model MODEL            (compile its decode graphs on this host once)
    hpipe plan   --model MODEL (--stages N | --cluster FILE) [--cuts ...] [--slices ...] -o plan.json
    hpipe launch plan.json --local --prompts prompts.jsonl --out results.jsonl [...]
    hpipe serve  plan.json --local [--port 8000] [--api-key KEY] [--policy throttle|sarathi]
    hpipe demo

Errors the user can fix are printed as one line (`hpipe: error: ...`) with exit code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import typing
from pathlib import Path

import click
import typer

from hpipe import __version__, formats, launcher, memory, models, planner, profiler, ssh
from hpipe.demo import run_demo
from hpipe.errors import HpipeError
from hpipe.config import SETTINGS, RuntimeConfig, Speculation, cli_option, from_cli, int_list
from hpipe.launcher.serving import MAX_QUEUE, PipelineClient
from hpipe.request import BATCH_SAMPLING, MAX_NEW_TOKENS, SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and launch pipeline-parallel LLM inference on mixed commodity hardware.")


# what a plan runs on and the launch transport's flags, shared by launch and serve
PLAN_ARGUMENT = typer.Argument(..., metavar="PLAN", help="plan file from `hpipe plan`")
LOCAL = typer.Option(False, "--local", help="run every stage as a process on this machine")
CLUSTER = typer.Option(None, "--cluster", help="cluster inventory TOML: run the stages on its hosts over SSH")
ACCEPT_NEW_HOST_KEYS = typer.Option(False, "--accept-new-host-keys", help="record unknown host keys in known_hosts "
                                    "(changed keys are always refused)")


def _option_of(f: dataclasses.Field):
    """The typer option of a request's field (`hpipe.planner.request.option`): its flags, help and default."""
    return typer.Option(... if f.default is dataclasses.MISSING else f.default, *f.metadata["flags"],
                        help=f.metadata["help"])


_PLAN_FIELDS = {f.name: f for f in dataclasses.fields(planner.PlanRequest)}
QUANTIZE, KV_DTYPE_OPTION = _option_of(_PLAN_FIELDS["quantize"]), _option_of(_PLAN_FIELDS["kv_dtype"])   # as plan's
PUSH_MODEL = typer.Option(False, "--push-model", help="copy the model files each host's stages need over SFTP "
                          "(checksummed)")
LOG_DIR = typer.Option(None, "--log-dir", help="also write every stage's whole log to DIR/stage-R.log (created; "
                       "appended to)")
HOST_TIMEOUT = typer.Option(launcher.HEARTBEAT_TIMEOUT_S, "--heartbeat-timeout", "--host-timeout",
                            help="seconds of silence after which a host counts as lost (its wrapper reports every "
                                 "second: a shorter drop of its link is not a loss)")
RECOVER = typer.Option(True, "--recover/--no-recover", help="with --cluster: when a host is lost, plan again over the "
                       "hosts still up and go on (open requests resume where they stood; a returning host is taken "
                       "back); --no-recover stops everything at the first failure")


def _as_typer_sees_it(wrapper, params: list[inspect.Parameter]):
    """Gives a command's wrapper the parameters typer makes its options from (not the command's own)."""
    del wrapper.__wrapped__
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def runtime_options(command):
    """Adds every RuntimeConfig setting to a command as its flag (default, help and rule from the
    config) and hands the command one `runtime: RuntimeConfig`: launch and serve take the same
    flags with the same defaults, declared once."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "runtime"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=cli_option(name),
                               annotation=type(s.default)) for name, s in SETTINGS.items()]

    @functools.wraps(command)
    def with_runtime(*args, **kwargs):
        values = {name: kwargs.pop(name) for name in SETTINGS}
        return command(*args, runtime=from_cli(values), **kwargs)

    return _as_typer_sees_it(with_runtime, own + added)


def request_options(request_type):
    """Makes a command's options from a request type's fields (each field's flags and help in its
    metadata, `hpipe.planner.request.option`) and hands the command one `request` of that type:
    a flag, its default and its help are written once, in the request."""
    hints = typing.get_type_hints(request_type)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                default=_option_of(f))
              for f in dataclasses.fields(request_type)]

    def wrap(command):
        @functools.wraps(command)
        def with_request(**options):
            return command(request_type(**options))

        return _as_typer_sees_it(with_request, params)
    return wrap


@dataclasses.dataclass(frozen=True)
class StageHosts:
    """Where launch's and serve's stages run, from the flags the two share, checked once:
    `inventory` None for --local (processes on this machine), else --cluster's hosts over SSH with
    the transport's flags."""
    plan_path: str
    inventory: formats.Inventory | None
    cluster: str | None
    accept_new_keys: bool
    push: bool
    host_timeout_s: float
    recover: bool


_HOSTS_OPTIONS = (("plan_path", str, PLAN_ARGUMENT), ("local", bool, LOCAL), ("cluster", str | None, CLUSTER),
                  ("accept_new_host_keys", bool, ACCEPT_NEW_HOST_KEYS), ("push_model", bool, PUSH_MODEL),
                  ("host_timeout", float, HOST_TIMEOUT), ("recover", bool, RECOVER))


def stage_hosts_options(command):
    """Puts PLAN, --local or --cluster and the SSH transport's flags before a command's own options
    and hands it one `hosts: StageHosts`: launch and serve take them alike, checked in one place."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "hosts"]
    added = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=kind)
             for name, kind, default in _HOSTS_OPTIONS]

    @functools.wraps(command)
    def with_hosts(*args, **kwargs):
        plan_path, local, cluster, keys, push, timeout, recover = [kwargs.pop(name) for name, _, _ in _HOSTS_OPTIONS]
        if local == (cluster is not None):
            raise HpipeError("give exactly one of --local (processes on this machine) or --cluster FILE (SSH)")
        if timeout <= 0:
            raise HpipeError(f"--heartbeat-timeout must be > 0, got {timeout}")
        hosts = StageHosts(plan_path, formats.load_inventory(cluster) if cluster else None, cluster, keys, push,
                           timeout, recover)
        return command(*args, hosts=hosts, **kwargs)

    return _as_typer_sees_it(with_hosts, added + own)


def _note(msg: str) -> None:
    typer.echo(msg, err=True)


@app.command()
def profile(
    model: str = typer.Option("smollm2", "--model", help="'smollm2', a Hugging Face directory, a .gguf file, "
                              "or (with --estimate) an architecture name such as llama-7b"),
    local: bool = typer.Option(False, "--local", help="measure devices of this machine"),
    devices: str = typer.Option("cpu", "--devices", help="with --local: comma-separated, e.g. cpu,cuda:0"),
    cluster: str | None = typer.Option(None, "--cluster", help="cluster inventory TOML"),
    estimate: bool = typer.Option(False, "--estimate", help="with --cluster: roofline estimates from the device "
                                  "catalog (device_types) and the inventory's links, nothing measured"),
    quick: bool = typer.Option(False, "--quick", help="a coarse grid and fewer repeats"),
    max_seq_len: int | None = typer.Option(None, "--max-seq-len", help="longest prompt to plan for "
                                              "(default: 2048 or the model's context)"),
    dtype: str | None = typer.Option(None, "--dtype", help="activations: float32, bfloat16 or float16"),
    quantize: str | None = QUANTIZE,
    kv_dtype: str | None = KV_DTYPE_OPTION,
    threads: int = typer.Option(0, "--threads", help="CPU threads per measured device (0: all cores); profile "
                                "with what each stage will get, e.g. 1 for two local CPU stages on 2 cores"),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys",
                                              help="with --cluster: record unknown host keys in known_hosts"),
    out: str = typer.Option(..., "-o", "--out", help="where to write the profile (JSON)"),
):
    """Measure (or estimate) per-unit compute times, memory and links for a model on a cluster."""

    weights = _weights(model, quantize)
    dtype, kv_dtype = formats.activation_dtype(dtype), _kv_dtype(kv_dtype)
    if local == (cluster is not None):
        raise HpipeError("give exactly one of --local (this machine) or --cluster FILE")
    if estimate:
        if cluster is None:
            raise HpipeError("--estimate needs --cluster FILE with device_types and [[links]]")
        result = profiler.profile_estimate(model, formats.load_inventory(cluster), out, dtype, max_seq_len,
                                           str(weights), kv_dtype)
    elif cluster is not None:
        result = profiler.profile_cluster(model, formats.load_inventory(cluster), out, quick, max_seq_len, dtype,
                                          accept_new_keys=accept_new_host_keys, weights=str(weights),
                                          kv_dtype=kv_dtype)
    else:
        device_list = [d.strip() for d in devices.split(",") if d.strip()]
        if not device_list:
            raise HpipeError("--devices: name at least one device, e.g. --devices cpu")
        result = profiler.profile_local(model, device_list, out, quick, max_seq_len, dtype, threads=threads,
                                        weights=str(weights), kv_dtype=kv_dtype)
    if not estimate and result.devices:
        _note(f"measuring the runtime's own per-token costs (a small model through 1 and 2 local stages, "
              f"~{10 if quick else 20} s) ...")
        vocab = int(models.load_config(models.resolve_model(model).path).vocab_size)
        result = dataclasses.replace(result, runtime=profiler.runtime_costs(vocab, quick))
        formats.write_profile(result, out)
    typer.echo(profiler.summarize(result))
    typer.echo(f"wrote {out}")
    if result.errors:
        raise HpipeError(f"{len(result.errors)} device(s) or link(s) failed (see above); what was measured "
                         f"is in {out}")


@app.command()
@request_options(planner.PlanRequest)
def plan(request: planner.PlanRequest):
    """Make a plan: where to cut the model between stages and how to slice prompts."""
    r = request
    prof = formats.load_profile(r.profile) if r.profile is not None else None
    weights, kv_dtype = _weights(r.model, r.quantize, prof, r.profile), _kv_dtype(r.kv_dtype, prof, r.profile)
    devices = _plan_devices(r.stages, r.cluster, r.profile, r.device)
    config, name = _plan_model(r.model)
    if r.mode == "sidp":
        return _plan_sidp(prof, r.profile, name, config, devices, r.seq_len, r.new_tokens, r.max_batch, r.margin,
                          r.dtype, str(weights), r.sidp_source, r.out)
    p, result = planner.plan_request(r, prof, name, config, devices, str(weights), kv_dtype, log=_note)
    if r.compare_baselines:
        _print_comparison(p.predicted.compare, result)
    if r.timeline:
        pr = p.predicted
        planner.write_timeline(result.timeline, [f"{st.host}/{st.device} [{st.units[0]}-{st.units[1] - 1}]"
                                                 for st in p.stages], len(pr.slices), r.timeline,
                               f"{pr.batch} x {pr.seq_len} tokens, {len(pr.slices)} slices: "
                               f"{pr.makespan_s:.3f} s predicted")
        typer.echo(f"wrote {r.timeline}")
    formats.write_plan(p, r.out)
    _print_plan(p, r.out, result)


def _plan_sidp(prof, profile_path, name, config, devices, seq_len, new_tokens, max_batch, margin, dtype, weights,
               source, out) -> None:
    if prof is None or seq_len is None:
        raise HpipeError("--mode sidp plans from measured (or estimated) times: add --profile FILE and --seq-len N "
                         "(a request's prompt length; --new-tokens its output)")
    p, groups, pipelines = planner.plan_sidp(prof, profile_path, name, config, devices, seq_len, new_tokens,
                                             max_batch, margin, dtype or prof.dtype, weights, source)
    formats.write_plan(p, out)
    typer.echo(f"wrote {out}: SiDP, {len(p.stages)} replicas in {len(p.sidp)} group(s), "
               f"requests of {seq_len} + {new_tokens} tokens")
    for g, group in zip(p.sidp, groups):
        _print_sidp_group(g, group, pipelines[g.host])


def _print_sidp_group(g, group, pipeline: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = group.rows
    typer.echo(f"host {g.host}: {len(g.replicas)} replicas, WaS from {g.source}, {g.slots} cache slot(s) each; "
               f"FFN owners: " + "; ".join(f"{m.id} {sum(1 for o in g.owners if o == i)} blocks"
                                           for i, m in enumerate(group.members)))
    table = Table(title=f"host {g.host}: a job of {rows['dp']['batch'] or '-'} / {rows['sidp']['batch'] or '-'} "
                        f"sequences per replica (plain DP / SiDP)")
    for col in ("", "plain DP", "SiDP", "pipeline"):
        table.add_column(col, justify="left" if not col else "right")
    gb = 1e9
    table.add_row("weights per replica", f"{rows['dp']['weight_bytes'] / gb:.2f} GB",
                  f"{rows['sidp']['weight_bytes'] / gb:.2f} GB" + (" (shared)" if g.source == "shared-mapping" else ""),
                  f"{rows['dp']['weight_bytes'] / len(g.replicas) / gb:.2f} GB")
    fmt = (lambda r: f"{r['kv_tokens']:,.0f}" if r["fits"] else "does not fit")
    table.add_row("KV tokens (group)", fmt(rows["dp"]), fmt(rows["sidp"]), fmt(pipeline))
    table.add_row("batch", str(rows["dp"]["batch"]), str(rows["sidp"]["batch"]), str(pipeline["batch"]))
    table.add_row("decode tokens/s", f"{rows['dp']['tokens_per_s']:.0f}",
                  f"{rows['sidp']['tokens_per_s']:.0f} ({rows['sidp']['mode'].upper()})",
                  f"{pipeline['tokens_per_s']:.0f}")
    Console().print(table)
    it = rows["iterations"]
    typer.echo("T(B) per iteration against fetching the FFNs a replica does not own ("
               f"{rows['fetch_s'] * 1e3:.1f} ms): " + ", ".join(
                   f"B={r['batch']} {r['T_s'] * 1e3:.1f} ms (WaS {r['was_s'] * 1e3:.1f}, CaS {r['cas_s'] * 1e3:.1f})"
                   for r in it))
    b_th = rows["b_threshold"]
    if g.source == "shared-mapping":
        typer.echo("the replicas map one copy of the weights: nothing to fetch, no switch")
    else:
        typer.echo(f"B_th = {b_th}: WaS from {b_th} sequences per replica, CaS below" if b_th else
                   "WaS never hides the fetch here: run CaS (or plain DP where it fits)")
    best = max((("SiDP", rows["sidp"]["tokens_per_s"]), ("plain DP", rows["dp"]["tokens_per_s"]),
                ("the pipeline plan (--mode pipeline)", pipeline["tokens_per_s"])), key=lambda x: x[1])
    typer.echo(f"run: {best[0]} ({best[1]:.0f} tokens/s predicted)")


def _weights(model: str, quantize: str | None, prof: formats.Profile | None = None, profile_path: str | None = None):
    """The weight format: --quantize, else the profile's (its times are those units'), else the
    model's own (a GGUF file in its blocks, a float checkpoint dense)."""
    from hpipe import quant

    is_gguf = models.is_gguf(model)
    if quantize is not None:
        fmt = quant.WeightFormat.parse(quantize)
    elif prof is not None:
        fmt = quant.WeightFormat.parse(prof.weights, where=f"{profile_path}: weights")
    else:
        fmt = quant.default_format(is_gguf)
    if prof is not None and str(fmt) != prof.weights:
        raise HpipeError(f"{profile_path}: measured with --quantize {prof.weights}, not {fmt}; plan "
                         f"with --quantize {prof.weights} or profile again with --quantize {fmt}")
    if fmt.kind == "gguf" and not is_gguf and model not in models.ARCHITECTURES:
        raise HpipeError(f"--quantize gguf keeps a .gguf file's own blocks and {model} is a float checkpoint; "
                         f"use --quantize int8 or int4[:group]")
    return fmt


def _kv_dtype(kv_dtype: str | None, prof: formats.Profile | None = None, profile_path: str | None = None) -> str:
    """The KV cache's elements: asked for, else a profile's (its times and bytes are of them), else
    formats.KV_DTYPE."""
    if kv_dtype is not None and kv_dtype not in formats.DTYPES:
        raise HpipeError(f"--kv-dtype {kv_dtype!r}: use one of {', '.join(formats.DTYPES)}")
    if prof is None:
        return kv_dtype or formats.KV_DTYPE
    measured = prof.kv_dtype
    if kv_dtype not in (None, measured):
        raise HpipeError(f"{profile_path}: measured with --kv-dtype {measured}, not {kv_dtype}; plan with --kv-dtype "
                         f"{measured} or profile again with --kv-dtype {kv_dtype}")
    return measured


def _plan_devices(stages: int | None, cluster: str | None, profile_path: str | None, device: str):
    """(host, device) per stage, in pipeline order: N local stages, a cluster file's devices, or the
    profile's devices."""

    if stages is not None:            # checked by PlanRequest
        return [("local", device)] * stages
    if cluster is not None:
        return formats.load_inventory(cluster).devices()
    if profile_path is None:
        raise HpipeError("give --stages N (local processes) or --cluster FILE (or --profile: one stage per device "
                         "of the profile)")
    return [(d.host, d.device) for d in formats.load_profile(profile_path).devices]


def _plan_model(model: str):
    """The model's config and the name the plan records: an architecture name (plans for hardware
    not at hand, no weights), the default model, or a resolved path."""

    if model in models.ARCHITECTURES:
        return models.config_for(model), model
    config = models.load_config(models.resolve_model(model, progress=_note).path)
    return config, (model if model == models.DEFAULT_MODEL else str(Path(model).expanduser().resolve()))


def _print_plan(p, out: str, result=None) -> None:
    from hpipe import quant

    desc = ", ".join(f"{s.host}/{s.device} units {s.units[0]}-{s.units[1] - 1}" for s in p.stages)
    typer.echo(f"wrote {out}: {len(p.stages)} stages ({desc}); KV cache {p.kv_dtype}")
    if p.weights != "none":
        typer.echo(f"weights {p.weights}, activations {p.dtype}: " + "; ".join(
            f"stage {r} {s.weights}" + (f" ({quant.kernels_on(s.device)[1]})" if s.host in ("local", "localhost")
                                         else " (the stage checks its device's kernels when it starts)")
            for r, s in enumerate(p.stages)))
    if result is None:
        return

    pr = p.predicted
    typer.echo(f"slices for {pr.seq_len} tokens: {list(pr.slices)}")
    typer.echo(f"predicted prefill of {pr.batch} x {pr.seq_len} tokens: {pr.makespan_s:.3f} s "
               f"({pr.throughput_tokens_per_s:.0f} tokens/s), uniform cuts: {pr.uniform_makespan_s:.3f} s; "
               f"utilization " + ", ".join(f"{u:.0%}" for u in pr.utilization))
    b, g, cs = result.bound, pr.gap, pr.cut_search
    typer.echo(f"cuts by the simulated makespan ({cs['method']}, {cs['candidates']} candidates); Algorithm 1's cuts "
               f"{cs['algorithm1_cuts'][1:-1]}: {cs['algorithm1_makespan_s']:.3f} s")
    typer.echo(f"lower bound for this work: {b.makespan_s:.3f} s ({b.binding}: perfect balance {b.compute_s:.3f} s, "
               f"busiest link {b.link_s:.3f} s); this plan is {pr.ratio_to_lower_bound:.2f}x the bound: "
               f"pipeline fill/drain {g['fill_drain_s']:.3f} s, busiest stage above balance {g['imbalance_s']:.3f} s "
               f"(whole units {g['granularity_s']:.3f} s, traded for fill/drain, links or memory "
               f"{g['balance_traded_s']:.3f} s)")
    if pr.memory_binding is not None:
        m, gib = pr.memory_binding, 2 ** 30
        typer.echo(f"memory: {m['device']} cannot hold units {m['units'][0]}-{m['units'][1] - 1} "
                   f"({m['need_bytes'] / gib:.2f} GiB needed, {m['free_bytes'] / gib:.2f} GiB free after the margin), "
                   f"the faster cuts {m['unlimited_cuts'][1:-1]} ({m['unlimited_value_s']:.3f} s) would give it: "
                   f"this plan fits, at {m['value_s']:.3f} s")
    if pr.host_experts is not None:
        h, gib = pr.host_experts, 2 ** 30
        where = "; ".join(f"stage {j} ({st.host}/{st.device}) {n} MoE blocks, {h['host_bytes'][j] / gib:.2f} GiB"
                          for j, (st, n) in enumerate(zip(result.plan.stages, h["blocks"])) if n)
        typer.echo(f"experts: kept in the host's RAM and run by its CPU where the GPU cannot hold them: {where}; "
                   f"predicted {h['value_s']:.3f} s against {h['cut_elsewhere_value_s']:.3f} s for the cuts "
                   f"{h['cut_elsewhere'][1:-1]} that memory alone allows")
    for line in pr.assumptions:
        typer.echo(f"assumed: {line}")
    if pr.decode is not None:
        dec = pr.decode
        typer.echo(f"predicted decode ({pr.objective} objective): {dec.tokens_per_s:.1f} tokens/s "
                   f"for {pr.batch} sequences in {dec.groups} groups; a group's step per stage "
                   + ", ".join(f"{1000 * t:.1f}" for t in dec.stage_step_s) + " ms")
        if dec.speculative is not None:
            sp = dec.speculative
            typer.echo(f"predicted decode with --speculative (K {sp['k_max']}, {sp['acceptance']:.0%} of proposals "
                       f"accepted: per-token acceptance {sp['alpha']:.2f}, {sp['proposed_per_step']:.2f} proposed and "
                       f"{sp['tokens_per_step']:.2f} tokens per step): {sp['tokens_per_s']:.1f} tokens/s "
                       f"({sp['tokens_per_s'] / dec.tokens_per_s:.2f}x); a group's step per stage "
                       + ", ".join(f"{1000 * t:.1f}" for t in sp["stage_step_s"]) + " ms")


def _print_comparison(rows: list[dict], result) -> None:
    from rich.console import Console
    from rich.table import Table

    pr = result.plan.predicted
    table = Table(title=f"predicted prefill of {pr.batch} x {pr.seq_len} tokens on {len(result.cost.entries)} "
                        f"devices")
    for col in ("method", "latency s", "tokens/s", "max memory / free", "x HPipe"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        worst = max(m / f for m, f in zip(r["memory_bytes"], pr.memory_free_bytes))
        table.add_row(r["method"], f"{r['makespan_s']:.3f}", f"{r['throughput_tokens_per_s']:.0f}",
                      f"{worst:.0%}" + ("" if r["fits"] else " OOM"), f"{r['ratio_to_hpipe']:.2f}")
    b = result.bound.makespan_s
    table.add_row("lower bound (no plan is faster)", f"{b:.3f}", f"{pr.seq_len * pr.batch / b:.0f}", "-",
                  f"{b / pr.makespan_s:.2f}")
    Console().print(table)


def _log_dir(path: str | None) -> str | None:
    """--log-dir: created now, so a directory that cannot be written is one line before any stage starts."""
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise HpipeError(f"--log-dir {path}: cannot write there ({e.strerror}); give a writable directory") from None
    if not os.access(path, os.W_OK):
        raise HpipeError(f"--log-dir {path}: cannot write there; give a writable directory")
    return os.path.abspath(path)


@app.command()
@runtime_options
@stage_hosts_options
def launch(
    prompts: str = typer.Option(..., "--prompts", help="JSONL: {\"id\", \"prompt\"} or {\"id\", \"input_ids\"}"),
    out: str = typer.Option(..., "--out", help="results JSONL, one line per prompt as it finishes"),
    max_new_tokens: int = typer.Option(MAX_NEW_TOKENS, "--max-new-tokens"),
    temperature: float = typer.Option(BATCH_SAMPLING.temperature, "--temperature", help="0 = greedy (below 1e-5)"),
    top_k: int = typer.Option(BATCH_SAMPLING.top_k, "--top-k", help="keep the k most likely tokens (0: off; ties kept)"),
    top_p: float = typer.Option(BATCH_SAMPLING.top_p, "--top-p", help="nucleus: keep tokens while the mass above is < p"),
    min_p: float = typer.Option(BATCH_SAMPLING.min_p, "--min-p", help="drop tokens below min_p x the most likely"),
    repetition_penalty: float = typer.Option(BATCH_SAMPLING.repetition_penalty, "--repetition-penalty",
                                             help="over prompt and output tokens"),
    frequency_penalty: float = typer.Option(BATCH_SAMPLING.frequency_penalty, "--frequency-penalty",
                                            help="x count of each output token"),
    presence_penalty: float = typer.Option(BATCH_SAMPLING.presence_penalty, "--presence-penalty",
                                           help="once per output token"),
    seed: int = typer.Option(0, "--seed"),
    logits_out: str | None = typer.Option(None, "--logits-out", help=".npz of logits per prompt id"),
    timeline_out: str | None = typer.Option(None, "--timeline-out", help="the measured run per stage (compute, "
                                             "prepare, wait, send), next to the plan's predicted prefill: .html, "
                                             ".png (needs matplotlib) or .json"),
    resume: bool = typer.Option(False, "--resume", help="skip prompts whose ids are already in --out"),
    model: str | None = typer.Option(None, "--model", help="load this model instead of the plan's"),
    quiet: bool = typer.Option(False, "--quiet", help="do not stream the workers' logs"),
    log_dir: str | None = LOG_DIR,
    runtime: RuntimeConfig = None,
    hosts: StageHosts = None,
):
    """Run a plan: start the stage workers and pipeline the prompts through them."""
    if timeline_out:
        launcher.check_timeline_out(timeline_out)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty)
    settings = launcher.LaunchSettings(runtime=runtime, max_new_tokens=max_new_tokens, params=params, seed=seed,
                                       logits_out=logits_out, resume=resume, log_dir=_log_dir(log_dir))
    files = launcher.read_job_files(prompts, out, settings)
    if hosts.inventory is None:
        launcher.prestart_local(hosts.plan_path)
    job = launcher.prepare(hosts.plan_path, prompts, out, settings, model=model, progress=_note, files=files)
    if job.skipped:
        _note(f"--resume: skipping {len(job.skipped)} prompts already in {out}")
    if job.plan.mode == "sidp":
        return _launch_replicas(job, hosts.plan_path, out, settings, hosts.inventory is None, quiet, timeline_out)
    if hosts.inventory is not None:
        report = launcher.launch_cluster(job, hosts.plan_path, hosts.inventory, out, settings,
                                         accept_new_keys=hosts.accept_new_keys, push=hosts.push,
                                         host_timeout_s=hosts.host_timeout_s, quiet=quiet, recover=hosts.recover)
    else:
        report = launcher.launch_local(job, hosts.plan_path, out, settings, quiet=quiet)
    if report.plan is not None:      # a lost host's stages were planned again: the run is checked against that plan
        job = dataclasses.replace(job, plan=report.plan)
    _print_launch(launcher.write_run_summary(job, report.output, out, timeline_out), out, hosts)


def _launch_replicas(job, plan_path: str, out: str, settings, local: bool, quiet: bool, timeline_out: str | None):
    """A SiDP plan's batch job: its replicas, each a whole model, on this machine."""
    launcher.check_replicas(job.plan, plan_path, local, timeline_out)
    report = launcher.launch_replicas(job, plan_path, out, settings, log=_note, quiet=quiet)
    _print_replicas(report, out)
    if timeline_out:
        launcher.write_mode_trace(timeline_out, report.traces)


@app.command()
@runtime_options
@stage_hosts_options
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0 opens it to the network)"),
    port: int = typer.Option(8000, "--port", help="0: any free port (the 'serving ... on' line names it)"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="HPIPE_API_KEY",
                                       help="require 'Authorization: Bearer KEY' on /v1 (or set HPIPE_API_KEY)"),
    served_model_name: str | None = typer.Option(None, "--served-model-name",
                                                 help="the model name clients ask for (default: the plan's)"),
    max_queue: int = typer.Option(MAX_QUEUE, "--max-queue",
                                  help="requests waiting beyond --max-batch before 429"),
    model: str | None = typer.Option(None, "--model", help="load this model instead of the plan's"),
    quiet: bool = typer.Option(True, "--quiet/--verbose", help="stream the workers' logs (--verbose)"),
    log_dir: str | None = LOG_DIR,
    runtime: RuntimeConfig = None,
    hosts: StageHosts = None,
):
    """Serve a plan behind an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    if max_queue < 0:
        raise HpipeError(f"--max-queue must be >= 0, got {max_queue}")
    with launcher.listen_socket(host, port) as sock:      # the port is ours before the stages start
        settings = launcher.LaunchSettings(runtime=runtime, serve=True, background_compile=True,
                                           log_dir=_log_dir(log_dir))
        if hosts.inventory is None:
            launcher.prestart_local(hosts.plan_path)
        job = launcher.prepare_model(hosts.plan_path, settings, model=model, progress=_note)
        if job.tokenizer is None:
            raise HpipeError(f"{job.source.name}: the model has no tokenizer files; hpipe serve needs one")
        client = PipelineClient(job, hosts.plan_path, settings, hosts.inventory, accept_new_keys=hosts.accept_new_keys,
                                push=hosts.push, host_timeout_s=hosts.host_timeout_s, max_queue=max_queue, log=_note,
                                quiet=quiet, recover=hosts.recover)
        _note(f"starting {len(job.plan.stages)} stages of {job.plan.model.name} ...")
        launcher.serve_http(client, served_model_name or job.plan.model.name, host, sock, api_key, _note,
                            hosts.cluster)


def _print_replicas(report, out: str) -> None:
    """A SiDP job's end: its throughput, and per replica its share and resident bytes (Pss: shared
    pages count 1/n to each of the n processes mapping them)."""
    tokens = sum(r["output_tokens"] for r in report.replicas)
    summary = {"version": 1, "mode": "sidp", "results": len(report.results), "wall_s": report.wall_s,
               "output_tokens": tokens, "tokens_per_s": tokens / report.wall_s if report.wall_s else None,
               "replicas": report.replicas, "traces": report.traces}
    Path(out + ".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if report.wall_s:
        typer.echo(f"{len(report.results)} prompts done -> {out}; {tokens} tokens in {report.wall_s:.2f} s "
                   f"({summary['tokens_per_s']:.1f} tok/s) on {len(report.replicas)} replicas: " + "; ".join(
                       f"{r['device']} {r['requests']} prompts" + (
                           f", weights mapped {r['weights_rss_bytes'] / 1e6:.0f} MB (Pss "
                           f"{r['weights_pss_bytes'] / 1e6:.0f} MB)" if r.get("weights_rss_bytes") else "")
                       for r in report.replicas))


def _print_launch(summary: dict, out: str, hosts: StageHosts) -> None:
    check, s, busy = summary["plan_check"], summary["run"], summary["busy_fraction"]
    if check:
        pf, mf = check["predicted_for"], check["measured_for"]
        typer.echo(f"prefill: predicted {check['predicted_makespan_s']:.3f} s for {pf['batch']} x {pf['seq_len']} "
                   f"tokens, measured {check['measured_makespan_s']:.3f} s for {mf['prompts']} prompts of "
                   f"{mf['prompt_tokens']} tokens ({check['relative_difference']:+.0%}); stage busy predicted "
                   + ", ".join(f"{x:.2f}" for x in check["predicted_stage_busy_s"] or []) + " s, measured "
                   + ", ".join(f"{x:.2f}" for x in check["measured_stage_busy_s"]) + " s")
        if check.get("predicted_with_measured_compute_s") is not None:
            typer.echo(f"prefill with the stages' measured compute in the plan's pipeline: "
                       f"{check['predicted_with_measured_compute_s']:.3f} s")
        for i, line in enumerate(launcher.decode_check_lines(check.get("decode"))):
            typer.echo(line, err=i > 0)         # the terms off, to stderr
        for line in check["off"]:
            if not line.startswith("decode"):
                typer.echo(f"off by more than {check['tolerance']:.0%}: {line}", err=True)
    typer.echo(f"{summary['prompts_done']} prompts done -> {out}; "
               f"{s.get('generated_tokens', 0)} tokens in {s.get('wall_s', 0):.2f} s "
               f"({s.get('tokens_per_s') or 0:.1f} tok/s); busy " +
               ", ".join(f"stage {r} {b:.0%}" for r, b in busy.items()))
    if s.get("options", {}).get("compile_cold"):
        where = "" if hosts.cluster is None else f" --cluster {hosts.cluster}"
        typer.echo(f"decode ran eagerly: `hpipe warmup{where} --plan {hosts.plan_path}` compiles its steps once on "
                   f"each host (1-3 minutes on 2 cores; add the run's --speculative if it has one); runs then take about 0.7x "
                   f"the time a token")
    if s.get("prefix_hit_tokens"):
        typer.echo(f"prefix cache: {s['prefix_hit_tokens']} of {s['prefix_query_tokens']} prompt tokens were cached "
                   f"({s['prefix_hit_tokens'] / max(1, s['prefix_query_tokens']):.0%}) and not prefilled again")
    if s.get("spec_proposed_tokens"):
        typer.echo(f"speculative decoding: {s['spec_accepted_tokens']} of {s['spec_proposed_tokens']} proposed tokens "
                   f"accepted ({s['spec_accepted_tokens'] / s['spec_proposed_tokens']:.0%})")
    hops = {k: v for k, v in summary.get("links", {}).items() if k.split("->")[0] != "0" or k == "0->1"}
    if hops:
        typer.echo("messages per link (metadata / data): " + ", ".join(
            f"{k} {v.get('meta_msgs', 0)} / {v.get('data_msgs', 0)}" for k, v in sorted(hops.items())))


cluster_app = typer.Typer(help="Check the hosts of a cluster inventory.")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("check")
def cluster_check(
    inventory_path: str = typer.Argument(..., metavar="CLUSTER", help="cluster inventory TOML"),
    plan_path: str | None = typer.Option(None, "--plan", help="also check this plan's devices and memory"),
    model: str | None = typer.Option(None, "--model", help="check that this model is on every host "
                                                            "(default: the plan's)"),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """The launch preflight alone: reach every host, compare versions, devices, memory and the model."""
    from rich.console import Console


    inventory = formats.load_inventory(inventory_path)
    plan_obj = formats.load_plan(plan_path) if plan_path else None
    names = launcher.plan_hosts(plan_obj, inventory) if plan_obj else [h.name for h in inventory.hosts]
    spec = model or (plan_obj.model.name if plan_obj else None)
    config = None
    if plan_obj is not None:
        config = models.load_config(models.resolve_model(spec, progress=_note).path)
        models.check_plan_matches(plan_obj, config, spec)

    conns = ssh.connect_all(inventory, names, accept_new_host_keys, log=_note)
    try:
        slices = list(plan_obj.pipeline_prediction.slices) if plan_obj and plan_obj.pipeline_prediction else []
        checks = launcher.preflight(conns, plan=plan_obj, config=config, model_spec=spec, kv_tokens=0,
                           microbatch_tokens=memory.microbatch_tokens(slices), kernels=True)
    finally:
        for c in conns.values():
            c.close()
    console = Console()
    Console(width=max(console.width, 150)).print(launcher.check_table(checks))
    launcher.refuse_failed(checks)
    typer.echo(f"all {len(checks)} hosts ready")


@app.command()
def warmup(
    model: str = typer.Option("smollm2", "--model", help="'smollm2', a Hugging Face directory or a .gguf file"),
    quantize: str | None = QUANTIZE,
    dtype: str | None = typer.Option(None, "--dtype", help="activations: float32 (default), bfloat16 or float16"),
    kv_dtype: str | None = KV_DTYPE_OPTION,
    threads: str | None = typer.Option(None, "--threads", help="the CPU threads of the stages that will run here, "
                                       "comma-separated (inductor builds its kernels for one count; a launch gives "
                                       "each CPU stage the host's cores over its CPU stages); default: all cores"),
    cluster: str | None = typer.Option(None, "--cluster", help="every host of this inventory with a CPU at once, "
                                       "over SSH (with --plan: the plan's hosts, each with its stages' threads)"),
    plan_path: str | None = typer.Option(None, "--plan", help="the plan's model, weights, dtypes, and its stages' "
                                         "own graphs at their threads (as `hpipe launch --local` runs them; with "
                                         "--cluster: each host its stages)"),
    speculative: str = typer.Option("off", "--speculative", help="the --speculative the launches and servers will "
                                    "run with (ngram[:K], draft:MODEL[:K]): their verification steps' graphs too"),
    units: str | None = typer.Option(None, "--units", help="only the graphs of stages holding these units, A-B "
                                     "each (as `hpipe plan` prints a stage), comma-separated; default: every graph a "
                                     "stage of the model can call"),
    accept_new_host_keys: bool = ACCEPT_NEW_HOST_KEYS,
):
    """Compile a model's decode graphs on this host (or every host of --cluster) once: later launches
    and servers of it with --compile auto (the default) run them (about 0.7x an eager step), loading
    them in ~2 s a stage (saved as code, not traced again)."""
    if cluster is not None:
        if units is not None:
            raise HpipeError("--units is each host's with --cluster: give --plan, and each host compiles its stages")
        _warm_cluster(cluster, plan_path, model, quantize, dtype, kv_dtype, threads, speculative, accept_new_host_keys)
        return
    if plan_path is not None:
        if (quantize, dtype, kv_dtype, threads, units) != (None,) * 5:
            raise HpipeError("--plan sets --quantize, --dtype, --kv-dtype, --threads and --units (its stages as "
                             "`hpipe launch --local` runs them here); leave them out")
        plan = formats.load_plan(plan_path)
        model, quantize, dtype, kv_dtype = plan.model.name, plan.weights, plan.dtype, plan.kv_dtype
        threads, units = _local_stages(plan, plan_path)
    import time

    from hpipe import quant, runtime

    counts = _thread_counts(threads)
    step_tokens = Speculation.parse(speculative).step_tokens
    source = models.resolve_model(model, progress=_note)
    config = models.load_config(source.path)
    weights, dtype, kv_dtype = (quant.stage_weights(_weights(model, quantize), "cpu"), formats.activation_dtype(dtype),
                                _kv_dtype(kv_dtype))
    t = time.time()
    unit_ranges = _unit_ranges(units, models.num_units(config)) if units is not None else None
    graphs = runtime.warm_compile(source, config, weights, dtype, _note, counts, kv_dtype, step_tokens, unit_ranges)
    typer.echo(f"{source.name}: {graphs} decode graphs compiled and warm on this host ({time.time() - t:.0f} s; "
               f"weights {weights}, {dtype}, KV {kv_dtype}, {' and '.join(map(str, counts))} threads); runs with "
               f"--compile auto (the default) use them")


def _warm_cluster(cluster: str, plan_path: str | None, model: str, quantize, dtype, kv_dtype, threads,
                  speculative: str, accept_new_keys: bool) -> None:
    """`hpipe warmup --cluster`: the plan's settings (or the options) on every host at once."""
    if threads is not None:
        raise HpipeError("--threads is each host's with --cluster: the inventory's `threads`, else its cores over "
                         "its CPU stages")
    inventory = formats.load_inventory(cluster)
    plan = formats.load_plan(plan_path) if plan_path is not None else None
    if plan is not None:
        if (quantize, dtype, kv_dtype) != (None, None, None):
            raise HpipeError("--plan sets --quantize, --dtype and --kv-dtype; leave them out")
        model, quantize, dtype, kv_dtype = plan.model.name, plan.weights, plan.dtype, plan.kv_dtype
        launcher.plan_hosts(plan, inventory)           # every stage's host is in the inventory
    settings = {"--quantize": str(_weights(model, quantize)), "--dtype": formats.activation_dtype(dtype),
                "--kv-dtype": _kv_dtype(kv_dtype), "--speculative": speculative}
    Speculation.parse(speculative)       # refused here, not on every host
    import time

    t = time.time()
    spec = launcher.remote_model_spec(models.resolve_model(model, progress=_note))
    done = launcher.warm_hosts(inventory, spec, settings, plan, accept_new_keys, typer.echo)
    typer.echo(f"{len(done)} host(s) warm in {time.time() - t:.0f} s; launches and servers with --compile auto use "
               f"their graphs")


def _unit_ranges(text: str, n_units: int) -> list[range]:
    """--units "0-20,21-61" -> [range(0, 21), range(21, 62)], each within the model's units."""
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        a, sep, b = part.partition("-")
        if not (sep and a.isdigit() and b.isdigit() and int(a) <= int(b) < n_units):
            raise HpipeError(f"--units {text!r}: {part!r} is not A-B with 0 <= A <= B < {n_units} (the model's units), "
                             f"e.g. --units 0-20,21-{n_units - 1}")
        out.append(range(int(a), int(b) + 1))
    if not out:
        raise HpipeError("--units: give at least one range A-B")
    return out


def _local_stages(plan: formats.Plan, plan_path: str) -> tuple[str, str]:
    """--threads and --units of a plan's CPU stages as `hpipe launch --local` runs them on this host."""
    cpu = [(st, t) for st, t in zip(plan.stages, launcher.threads_per_stage([st.device for st in plan.stages]))
           if st.device == "cpu"]
    if not cpu:
        raise HpipeError(f"{plan_path}: no CPU stage, and GPU stages compile nothing ahead (they replay CUDA graphs)")
    return (",".join(sorted({str(t) for _, t in cpu})),
            ",".join(f"{st.units[0]}-{st.units[1] - 1}" for st, _ in cpu))


def _thread_counts(text: str | None) -> list[int]:
    """--threads "1,2" -> [1, 2]; None -> this host's cores (one stage alone on it)."""
    counts = sorted(set(int_list(text, "--threads") or [os.cpu_count() or 1]))
    if counts[0] < 1:
        raise HpipeError(f"--threads {text!r}: thread counts are >= 1 (e.g. --threads 1,2)")
    return counts


@app.command()
def demo(
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    stages: int = typer.Option(2, "--stages"),
):
    """Plan a 2-stage local pipeline on the default model and answer a question about a long document."""

    run_demo(stages=stages, max_new_tokens=max_new_tokens)


@app.command()
def version():
    """Print hpipe's version."""
    typer.echo(f"hpipe {__version__}")


# typer 0.2x carries its own copy of click (`typer._click`): a bad option raises that copy's errors,
# which click's own classes do not catch (every unknown option printed a traceback). Both, by name.
CLICK_ERRORS = tuple({c for c in (*click.BadParameter.__mro__, *typer.BadParameter.__mro__)
                      if c.__name__ == "ClickException"})
ABORTS = tuple({click.exceptions.Abort, typer.Abort})


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        # a program started in the background by a shell begins with SIGINT ignored; hpipe's
        # teardown (stop every worker, keep the results) must still run on `kill -INT`
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        app(args=argv, standalone_mode=False)
        return 0
    except HpipeError as e:
        typer.echo("hpipe: error: " + " ".join(str(e).split()), err=True)
        return 2
    except ABORTS:
        typer.echo("hpipe: interrupted", err=True)
        return 130
    except CLICK_ERRORS as e:       # a bad option or value: one line, as hpipe's own errors
        where = getattr(getattr(e, "ctx", None), "command_path", None) or "hpipe"
        typer.echo(f"hpipe: error: {where}: {' '.join(e.format_message().split()).rstrip('.')}; `{where} --help` lists "
                   f"what it takes", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        typer.echo("hpipe: interrupted", err=True)
        return 130


def run() -> None:
    """The `hpipe` command: `main`, then the exit without the interpreter's teardown
    (`hpipe.lifeline.exit_now`); a local launch forks its fork server from this process
    (`forkserver.command_process`). Callers of `main` in a process of their own (the tests) keep
    the ordinary exit and a fork server of its own."""
    from hpipe.launcher import forkserver
    from hpipe.lifeline import exit_now

    forkserver.command_process()
    exit_now(main())


if __name__ == "__main__":
    run()
