"""The live page of `hpipe serve` (`GET /`) and the one JSON object it polls (`GET /hpipe/state`).

The page is one self-contained file, `hpipe/data/dashboard.html` (its script and style inline, no
network beyond this server: it works on a LAN without the internet). Its Content-Security-Policy
lets only that script run (by its hash) and the page talk only to this server: the page writes
whatever a client or the model sent (prompts, answers, error text, host names) as text, and a
script that got in by another way would not run either.

`state()` reads what /metrics, /hpipe/events and the plan file read: the client's stats and
metrics, its running plan, the stages' pulses (launcher/pulses.py); it keeps nothing of its own.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from dataclasses import dataclass
from importlib import resources

from hpipe import formats, models
from hpipe.launcher.pulses import WINDOW_S

__all__ = ["PAGE", "state"]

TIMELINE_S = 6.0         # the live run chart's last seconds
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Page:
    html: str
    policy: str          # the Content-Security-Policy it is served with

    @classmethod
    def load(cls) -> Page:
        html = (resources.files("hpipe") / "data" / "dashboard.html").read_text(encoding="utf-8")

        def hashes(tag: str) -> str:
            return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
                            for body in re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S))
        return cls(html, f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
                         "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                         "frame-ancestors 'none'")


PAGE = Page.load()


def plan_view(plan: formats.Plan, config) -> dict:
    view = {"mode": plan.mode, "dtype": plan.dtype, "kv_dtype": plan.kv_dtype, "weights": plan.weights,
            "cuts": [s.units[0] for s in plan.stages[1:]], "units": models.num_units(config),
            "slices": None, "seq_len": None, "batch": None, "predicted": None}
    pr = plan.pipeline_prediction
    if pr is not None:
        view.update(slices=pr.slices, seq_len=pr.seq_len, batch=pr.batch,
                    predicted={"prefill_s": pr.makespan_s, "prefill_tokens_per_s": pr.throughput_tokens_per_s,
                               "utilization": pr.utilization,
                               "decode_tokens_per_s": pr.decode.tokens_per_s if pr.decode else None,
                               "decode_step_s": pr.decode.stage_step_s if pr.decode else None})
    return view


def stage_view(rank: int, stage: formats.StagePlan, config, pulses) -> dict:
    last = pulses.latest(rank)
    return {"rank": rank, "host": stage.host, "device": stage.device, "units": list(stage.units),
            "blocks": models.units_text(config, *stage.units), "weights": stage.weights,
            "host_experts": stage.host_experts, "busy": pulses.busy(rank),
            "decode_step_s": pulses.step_s(rank, "decode"), "decode_rows": pulses.rows(rank, "decode"),
            "prefill_tokens_per_s": pulses.tokens_per_s(rank, "prefill"),
            "held_bytes": last.held_bytes if last else None, "device_bytes": last.device_bytes if last else None,
            "kv_bytes": last.kv_bytes if last else None, "seen_s_ago": round(time.time() - last.t, 2) if last else None}


def latency(histogram) -> dict:
    return {"count": histogram.count, **{f"p{round(100 * q)}": histogram.quantile(q) for q in QUANTILES}}


def state(client, model_name: str) -> dict:
    """Everything the page shows, from the server's own sources (see the module's docstring)."""
    plan, config, pulses = client.plan or client.job.plan, client.job.config, client.output.pulses
    s, m = client.stats, client.metrics
    health = client.health()[1]
    return {
        "model": model_name, "t": time.time(), "health": health, "window_s": WINDOW_S,
        "deterministic": bool(client.info and client.info.deterministic), "policy": client.settings.runtime.policy,
        "plan": plan_view(plan, config),
        "stages": [stage_view(r, st, config, pulses) for r, st in enumerate(plan.stages)],
        "timeline": {"seconds": TIMELINE_S,
                     "stages": [pulses.intervals(r, TIMELINE_S) for r in range(len(plan.stages))]},
        "requests": {"running": s.get("running", 0), "waiting": s.get("waiting", 0), "open": client.load(),
                     "finished": dict(sorted(m.finished.items())), "rejected": m.rejected, "resumed": m.resumed,
                     "prompt_tokens": m.prompt_tokens, "generation_tokens": m.generation_tokens,
                     "preemptions": s.get("preemptions", 0)},
        "latency": {"ttft_s": latency(m.ttft), "tpot_s": latency(m.tpot)},
        "kv": {"used": s.get("pages_used", 0), "free": client.pages_free(),
               "cached": s.get("pages_cached", 0), "bytes_per_token": client.kv_bytes_per_token(),
               "dtype": plan.kv_dtype},
        "prefix_cache": {"hit_tokens": s.get("prefix_hit_tokens", 0), "query_tokens": s.get("prefix_query_tokens", 0)},
        "speculation": {"proposed": s.get("spec_proposed_tokens", 0), "accepted": s.get("spec_accepted_tokens", 0)},
        "events": [e.as_dict() for e in m.events], "degraded": client.degraded,
    }
