"""`hpipe demo`: a 2-stage local pipeline with token slicing on the embedded default model,
answering a question about a document of ~1,700 tokens kept in hpipe/data/."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hpipe import formats, models

DATA = Path(__file__).parent / "data"


def run_demo(stages: int = 2, max_new_tokens: int = 48) -> None:
    from hpipe.launcher.jobs import LaunchSettings, busy_fractions, prepare
    from hpipe.launcher.local import launch_local
    from hpipe.planner import make_plan

    console = Console()
    work = models.cache_dir() / "demo"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with console.status("[bold]resolving the default model (first run converts the GGUF file, ~30 s)"):
        source = models.resolve_model(models.DEFAULT_MODEL)
        config = models.load_config(source.path)
    document = (DATA / "demo_document.md").read_text()
    question = (DATA / "demo_question.txt").read_text().strip()
    prompt = f"Read this report and answer the question.\n\n{document}\n\nQuestion: {question}"
    plan_path, prompts_path, out_path = work / "plan.json", work / "prompts.jsonl", work / "results.jsonl"
    plan = make_plan(models.DEFAULT_MODEL, config, [("local", "cpu")] * stages, num_slices=4)
    formats.write_plan(plan, plan_path)
    prompts_path.write_text(json.dumps({"id": "demo", "prompt": prompt}) + "\n")
    out_path.unlink(missing_ok=True)
    settings = LaunchSettings(max_new_tokens=max_new_tokens)
    job = prepare(str(plan_path), str(prompts_path), str(out_path), settings)
    n_prompt = len(job.requests[0].input_ids)
    with console.status(f"[bold]running {stages} stages on a {n_prompt}-token prompt"):
        report = launch_local(job, str(plan_path), str(out_path), settings, quiet=True)
    result = report.output.results[0]
    console.print(f"[bold]Question:[/bold] {question}")
    console.print(f"[bold]Answer:[/bold] {result['text'].strip()}\n")

    busy = busy_fractions(report.output.timelines)
    table = Table(title=f"hpipe demo: {stages}-stage pipeline, {models.DEFAULT_MODEL}")
    for col in ("stage", "device", "units", "first unit .. last unit", "load s", "busy"):
        table.add_column(col)
    for r, st in enumerate(plan.stages):
        tl = report.output.timelines.get(r, {})
        table.add_row(str(r), f"{st.host}/{st.device}", f"{st.units[0]}-{st.units[1] - 1}",
                      f"{models.unit_name(config, st.units[0])} .. {models.unit_name(config, st.units[1] - 1)}",
                      f"{tl.get('load_s', 0):.1f}", f"{busy.get(r, 0):.0%}")
    console.print(table)
    s = report.output.summary or {}
    slices = plan.slicing.slices_for(n_prompt)
    console.print(f"prompt {n_prompt} tokens in {len(slices)} slices {slices}; "
                  f"TTFT {result['ttft_s']:.2f} s; {len(result['output_ids'])} tokens at "
                  f"{1 / result['tpot_s'] if result['tpot_s'] else 0:.1f} tok/s decode; "
                  f"wall {s.get('wall_s', 0):.1f} s (total with start-up {time.time() - t0:.1f} s)")
    console.print(f"files: {plan_path}, {out_path}")
