"""`hpipe demo`: what hpipe is for, on this machine, in about a minute: a measured profile -> the
planner's optimal plan (cuts, and a long prompt sliced longer first, shorter later) -> a pipeline
of local stages on the embedded default model (in its GGUF file's own 4/8-bit blocks) answering a
question about a ~1,700-token document -> the plan's predicted prefill against the measured one,
beside the uniform plan's prediction.

The profile is the one shipped in the checkout's profiles/ when it was measured on a CPU like this
one, else one measured here with --quick (about 30 s, kept in hpipe's cache for the next run).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hpipe import formats, launcher, models, planner, profiler
from hpipe.errors import HpipeError
from hpipe.profiler.measure import device_identity

DATA = Path(__file__).parent / "data"
DEMO_WEIGHTS = "gguf"       # the default model runs in its file's blocks
SHIPPED_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "smollm2-cpu-1thread-quick.json"


def profile_fits(path: Path, config, threads: int) -> bool:
    """A profile of the default model's quantized units on this kind of CPU (name and cores),
    measured with the threads each stage will get."""
    try:
        prof = formats.load_profile(path)
    except HpipeError:
        return False
    dev = prof.device("local/cpu")
    if dev is None or prof.model.fingerprint != models.fingerprint(config) or prof.weights != DEMO_WEIGHTS:
        return False
    import torch    # here: every `hpipe` command imports this module, and torch costs ~1 s of its start

    ident, here = dev.identity, device_identity("cpu", torch)
    return ident.get("name") == here["name"] and ident.get("cores") == here["cores"] and ident.get("threads") == threads


PROBE_TOLERANCE = 0.2     # a profile this far from a probe of the CPU today is measured again (the
                          # machine itself varies by about 15 % from run to run)


def demo_profile(config, threads: int, work: Path, console: Console) -> tuple[formats.Profile, str, str]:
    """(profile, its path, where it came from). A profile of this kind of CPU is still checked
    against the CPU as it runs today (`profiler.probe`: one block timed here): beyond
    PROBE_TOLERANCE it is measured again, and the demo says so, so that its predictions (and the
    bound no plan can beat) hold for the run that follows."""
    cached = work / "profile.json"
    why = "no profile of this CPU yet"
    for path, origin in ((SHIPPED_PROFILE, "shipped"), (cached, "measured here earlier")):
        if path.exists() and profile_fits(path, config, threads):
            prof = formats.load_profile(path)
            if prof.runtime is None:
                why = f"the {origin} profile has no runtime costs"
                continue
            ratio = profiler.probe(models.DEFAULT_MODEL, prof.devices[0], threads, DEMO_WEIGHTS)
            if abs(ratio - 1.0) <= PROBE_TOLERANCE:
                return prof, str(path), origin
            why = (f"the {origin} profile is {abs(ratio - 1):.0%} {'slower' if ratio < 1 else 'faster'} than this CPU "
                   f"runs today (one block timed now)")
    console.print(f"{why}: measuring one (--quick, {threads} thread per stage, about a minute)")
    with console.status("[bold]measuring"):
        prof = profiler.profile_local(models.DEFAULT_MODEL, ["cpu"], str(cached), True, None, "float32",
                                      threads=threads, weights=DEMO_WEIGHTS)
        prof = dataclasses.replace(prof, runtime=profiler.runtime_costs(int(config.vocab_size)))
        formats.write_profile(prof, cached)
    return prof, str(cached), "measured now"


def run_demo(stages: int = 2, max_new_tokens: int = 48) -> None:
    console = Console()
    work = models.cache_dir() / "demo"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with console.status("[bold]resolving the default model (a first run packs the GGUF file's blocks, ~15 s)"):
        source = models.resolve_model(models.DEFAULT_MODEL)
        config = models.load_config(source.path)
        tokenizer = models.load_tokenizer(source.path)
    document = (DATA / "demo_document.md").read_text()
    question = (DATA / "demo_question.txt").read_text().strip()
    prompt = f"Read this report and answer the question.\n\n{document}\n\nQuestion: {question}"
    plan_path, prompts_path, out_path = work / "plan.json", work / "prompts.jsonl", work / "results.jsonl"
    prompts_path.write_text(json.dumps({"id": "demo", "prompt": prompt}) + "\n")
    n_prompt = len(launcher.encode_prompt(tokenizer, formats.load_prompts(prompts_path)[0]))

    threads = launcher.threads_per_stage(["cpu"] * stages)[0]
    prof, prof_path, origin = demo_profile(config, threads, work, console)
    devices = [("local", "cpu")] * stages
    result = planner.plan_from_profile(prof, prof_path, models.DEFAULT_MODEL, config, devices, seq_len=n_prompt)
    formats.write_plan(result.plan, plan_path)
    # what hpipe replaces: uniform cuts and the prompt cut into equal slices
    n_units = models.num_units(config)
    uniform_slices = formats.Slicing(count=2 * stages).slices_for(n_prompt)
    uniform = planner.predict(result.cost, [0, *planner.uniform_cuts(n_units, stages), n_units], uniform_slices, 1)

    out_path.unlink(missing_ok=True)
    settings = launcher.LaunchSettings(max_new_tokens=max_new_tokens)
    job = launcher.prepare(str(plan_path), str(prompts_path), str(out_path), settings)
    with console.status(f"[bold]running {stages} stages on a {n_prompt}-token prompt"):
        report = launcher.launch_local(job, str(plan_path), str(out_path), settings, quiet=True)
    answer = report.output.results[0]
    console.print(f"[bold]Question:[/bold] {question}")
    console.print(f"[bold]Answer:[/bold] {answer['text'].strip()}\n")

    pr = result.plan.predicted
    check = launcher.plan_check(result.plan, report.output, [n_prompt])
    busy = launcher.busy_fractions(report.output.timelines)
    table = Table(title=f"hpipe demo: {stages}-stage pipeline, {models.DEFAULT_MODEL}, profile {origin}")
    for col in ("stage", "device", "units", "first .. last", "prefill busy: predicted", "measured", "whole run"):
        table.add_column(col)
    for r, st in enumerate(result.plan.stages):
        table.add_row(str(r), f"{st.host}/{st.device}", f"{st.units[0]}-{st.units[1] - 1}",
                      f"{models.unit_name(config, st.units[0])} .. {models.unit_name(config, st.units[1] - 1)}",
                      f"{pr.stage_busy_s[r]:.2f} s", f"{check['measured_stage_busy_s'][r]:.2f} s",
                      f"{busy.get(r, 0):.0%}")
    console.print(table)
    console.print(f"prompt {n_prompt} tokens in {len(pr.slices)} slices chosen by the DP (longer first, shorter "
                  f"later): {list(pr.slices)}")
    console.print(f"prefill: [bold]predicted {pr.makespan_s:.2f} s, measured {check['measured_makespan_s']:.2f} s"
                  f"[/bold] ({check['relative_difference']:+.0%}); the uniform plan (equal cuts, slices "
                  f"{uniform_slices}) predicts {uniform.makespan:.2f} s; no plan can beat "
                  f"{pr.lower_bound_s:.2f} s on these devices ({pr.ratio_to_lower_bound:.2f}x)")
    s = report.output.summary or {}
    console.print(f"decode: {len(answer['output_ids'])} tokens at "
                  f"{1 / answer['tpot_s'] if answer['tpot_s'] else 0:.1f} tok/s; wall {s.get('wall_s', 0):.1f} s "
                  f"(total with start-up {time.time() - t0:.1f} s)")
    console.print(f"files: {prof_path}, {plan_path}, {out_path}")
