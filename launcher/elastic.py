"""A cluster that goes on when a host drops out and takes it back when it returns (`hpipe serve
--cluster`, `hpipe launch --cluster`).

    a stage fails (exits, its host's SSH session or link dies, or the host is silent for
    --heartbeat-timeout) -> its host is lost -> plan again over the hosts still up -> start that
    pipeline -> every open request resumes where it stood (its prompt and the tokens it generated,
    `Request.output_ids`) ... the lost host answers SSH again for REJOIN_AFTER_S -> plan over all
    hosts -> switch when the prediction gains more than REJOIN_GAIN (or the survivors could not hold
    the model at all)

`Replanner` makes the plans: from the profile the run's plan was made with (the same seq_len, batch,
objective and memory margin, a device left out where that is faster), or, for a plan made without
one, equal cuts over the devices left. `HostWatch` asks the lost hosts' sshd in the background.
`Recovery` is the record of one event and its phases, as /metrics and the run summary show them.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field

from hpipe import formats, planner, ssh
from hpipe.errors import HpipeError
from hpipe.launcher.jobs import StageFailure

__all__ = ["REJOIN_AFTER_S", "REJOIN_GAIN", "Elastic", "HostWatch", "Recovery", "Replanner", "ssh_answers"]

REJOIN_AFTER_S = 3.0     # a lost host answers SSH this long before it is taken back, doubled each time
MAX_REJOIN_AFTER_S = 300.0   # the same host is lost again (a flapping link, a worker killed again and again)
REJOIN_GAIN = 0.05       # ... and the plan with it is predicted this much faster (or the service is degraded)
PROBE_EVERY_S = 1.0


@dataclass
class Recovery:
    """One event: a host lost (`kind` "lost") or taken back ("rejoined"), and its phases in seconds:
    notice (silence before the launcher knew), replan, start (connect, preflight, load, until stage
    0 is ready), reprefill (until every resumed request had its next token), and the seconds
    without service (from the failure to the first token after it)."""

    kind: str
    host: str
    cause: str
    t: float = field(default_factory=time.time)
    old_stages: list[str] = field(default_factory=list)
    new_stages: list[str] = field(default_factory=list)
    predicted_old_s: float | None = None
    predicted_new_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    resumed: int = 0
    outage_s: float | None = None
    degraded: str | None = None          # the survivors could not hold the model: why

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items())
        return (f"{self.kind} {self.host}: {' -> '.join(self.old_stages)} => {' -> '.join(self.new_stages) or '-'}"
                f"; {self.resumed} requests resumed; {phases}"
                + (f"; {self.outage_s:.2f} s without service" if self.outage_s is not None else ""))


def stage_names(plan: formats.Plan) -> list[str]:
    return [f"{s.host}/{s.device}[{s.units[0]}-{s.units[1] - 1}]" for s in plan.stages]


class Replanner:
    """Plans over the hosts still up, as the run's plan was made: its devices in their order, then
    the inventory's others (a device the first plan left out may serve now)."""

    def __init__(self, plan: formats.Plan, config, model_name: str, inventory: formats.Inventory | None = None,
                 log=None):
        self.plan, self.config, self.name = plan, config, model_name
        self.devices = [(s.host, s.device) for s in plan.stages]
        self.devices += [d for d in (inventory.devices() if inventory else []) if d not in self.devices]
        path = plan.pipeline_prediction.profile if plan.pipeline_prediction is not None else None
        self.profile_path = path if path and os.path.exists(path) else None
        self.profile = formats.load_profile(path) if self.profile_path else None
        if path and self.profile is None and log is not None:
            log(f"hpipe: the plan's profile {path} is not here: a lost host's stages are planned again with "
                f"equal cuts (run from where the plan was made to plan from it)")

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(h for h, _ in self.devices))

    def predicted_s(self, plan: formats.Plan) -> float | None:
        """What the plan balances, as its profile predicts it (None without a profile)."""
        if self.profile is None or plan.pipeline_prediction is None:
            return None
        return plan.pipeline_prediction.objective_s()

    def plan_for(self, up: set[str]) -> formats.Plan:
        """The plan over the devices of the hosts in `up`; HpipeError when they cannot hold the model."""
        devices = [d for d in self.devices if d[0] in up]
        if not devices:
            raise HpipeError("no host of the plan is up")
        plan = self.plan
        if self.profile is None:
            return planner.make_plan(self.name, self.config, devices, None, list(plan.slicing.lengths) or None,
                                     plan.slicing.count, plan.slicing.granularity, plan.dtype, plan.weights,
                                     plan.kv_dtype)
        pr = plan.pipeline_prediction
        try:
            result = planner.search_plan(self.profile, self.profile_path, self.name, self.config, devices,
                                         pr.seq_len, pr.batch, None, planner.MARGIN if pr.margin is None else pr.margin,
                                         plan.dtype, plan.slicing.granularity, "inventory", allow_drop=len(devices) > 1,
                                         overlap=pr.overlap_sends, objective=pr.objective,
                                         new_tokens=pr.decode.new_tokens if pr.decode else 128)
        except (planner.Infeasible, HpipeError) as e:
            raise HpipeError(f"the hosts still up ({', '.join(sorted(up))}) cannot hold the model: "
                             f"{' '.join(str(e).split())}") from None
        return result.plan


class HostWatch:
    """Asks the lost hosts' sshd every PROBE_EVERY_S (a real connection and login); `back()` names
    those that have answered without a miss for REJOIN_AFTER_S, doubled for each time the host was
    lost before (up to MAX_REJOIN_AFTER_S)."""

    def __init__(self, inventory: formats.Inventory, accept_new_keys: bool = False, checked: set[str] | None = None):
        self.inventory, self.accept_new_keys = inventory, accept_new_keys
        self.checked = checked if checked is not None else set()   # a lost host is checked whole again
        self.hosts = {h.name: h for h in inventory.hosts}
        self.lost: dict[str, float | None] = {}     # host -> since when it answers (None: it does not)
        self.losses: dict[str, int] = {}            # host -> times it was lost
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpipe-hostwatch", daemon=True)
        self.thread.start()

    def lose(self, host: str, count: bool = True) -> None:
        with self.lock:
            self.lost[host] = None
            self.checked.discard(host)
            self.losses[host] = self.losses.get(host, 0) + count

    def lose_silent(self, hosts: set[str]) -> list[str]:
        """Of `hosts`, those whose sshd does not answer now are lost; returns them."""
        silent = sorted(h for h in hosts if not self._answers(h))
        for h in silent:
            self.lose(h)
        return silent

    def regain(self, host: str) -> None:
        with self.lock:
            self.lost.pop(host, None)

    def down(self) -> set[str]:
        with self.lock:
            return set(self.lost)

    def back(self, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        with self.lock:
            return {h for h, since in self.lost.items() if since is not None and now - since >= self.hold_s(h)}

    def hold_s(self, host: str) -> float:
        return min(MAX_REJOIN_AFTER_S, REJOIN_AFTER_S * 2 ** max(0, self.losses.get(host, 0) - 1))

    def close(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(PROBE_EVERY_S):
            for name in list(self.down()):
                try:
                    ok = self._answers(name)
                except Exception:  # noqa: BLE001 - not back yet
                    ok = False
                with self.lock:
                    if name in self.lost:
                        self.lost[name] = (self.lost[name] or time.monotonic()) if ok else None

    def _answers(self, name: str) -> bool:
        return ssh_answers(self.inventory, name, self.accept_new_keys, self.hosts)


def ssh_answers(inventory: formats.Inventory, name: str, accept_new_keys: bool = False, hosts: dict | None = None) -> bool:
    """Whether the host's sshd takes a login now (3 s at most)."""
    host = (hosts or {h.name: h for h in inventory.hosts}).get(name)
    if host is None:
        return False
    settings = dataclasses.replace(inventory.ssh, connect_timeout_s=min(3.0, inventory.ssh.connect_timeout_s))
    try:
        conn = ssh.connect(host, settings, accept_new_keys, log=lambda *_: None)
    except Exception:  # noqa: BLE001 - any failure to log in is "not there"
        return False
    conn.close()
    return True


class Elastic:
    """The recovery of a cluster's pipeline, chosen once when `hpipe serve --cluster` starts
    (`PipelineClient.elastic`): what the client's run thread does when its pipeline ends
    (`next_plan`), what it does when a new one is ready (`ready`) and at the first tokens after it
    (`tokens`); a thread of its own takes returning hosts back (`_consider`)."""

    def __init__(self, client, inventory: formats.Inventory, accept_new_keys: bool = False):
        self.client, self.log = client, client.log
        self.replanner = Replanner(client.job.plan, client.job.config, client.job.plan.model.name, inventory,
                                   client.log)
        self.watch = HostWatch(inventory, accept_new_keys, client.checked)
        self.degraded: str | None = None       # the hosts up cannot hold the model: why
        self.event: Recovery | None = None     # the event under way (until its resumed requests have a token)
        self.switch: tuple[str, Recovery, object] | None = None   # a rejoin asked: the plan to start next,
                                                                  # its event, the launch it stopped
        self.t_fail = self.t_start = self.t_ready = 0.0
        self.pending: set[int] = set()         # requests resumed that have no token yet
        self.failed_starts = 0
        self.lock = threading.Lock()           # the event's bookkeeping: the report thread and the HTTP handlers
        self.plans = tempfile.mkdtemp(prefix="hpipe-plans-")
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._rejoin, name="hpipe-rejoin", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed.set()
        self.watch.close()

    # ------------------------------------------------------------------ the run thread
    def next_plan(self, error: HpipeError) -> str | None:
        """The pipeline ended with `error` (or a rejoin stopped it): the plan file to start next,
        None once the service closes while it waits; HpipeError when it cannot go on."""
        switch, self.switch = self.switch, None
        if switch is not None and switch[2] is self.client.launch:   # the stages the rejoin stopped
            path, self.event, _ = switch
            self.t_start = time.monotonic()
            return path
        starting = self.event if self.event is not None and "start" not in self.event.phases else None
        if self.event is not None and starting is None:    # lost again before every resumed request had a token
            self.client.metrics.events.append(self.event)
        self.event = None
        cause = " ".join(str(error).split())
        silent = error.silent_s if isinstance(error, StageFailure) else 0.0
        self.t_fail = time.monotonic() - silent
        event = Recovery("lost", "?", cause, old_stages=stage_names(self.client.plan))
        event.phases["notice"] = round(silent, 3)
        lost = self._blame(error, starting)
        if not lost:
            self.failed_starts += 1
            if self.failed_starts >= 3:
                raise HpipeError(f"the pipeline could not be started again: {cause}")
        event.host = ",".join(lost) or "?"
        self.log(f"hpipe: lost host {event.host}: {cause}")
        while not self.closed.is_set():
            up = set(self.replanner.hosts) - self.watch.down()
            t = time.monotonic()
            try:
                plan = self.replanner.plan_for(up)
            except HpipeError as e:
                self._degrade(str(e), event)
                if not self._wait_for_hosts():
                    return None
                continue
            event.phases["replan"] = round(time.monotonic() - t, 3)
            self.degraded = None
            return self._begin(plan, event)
        return None

    def _blame(self, error: HpipeError, starting: Recovery | None) -> list[str]:
        """The hosts lost with `error`: the failed stage's; for a start that failed, the hosts its
        error names, those whose sshd does not answer and, a rejoin's, the joining hosts."""
        if isinstance(error, StageFailure) and starting is None:
            self.watch.lose(error.host)
            return [error.host]
        up = set(self.replanner.hosts) - self.watch.down()
        named = {h for h in up if f"host {h} " in f"{error} " or f"host {h}:" in str(error)}
        if isinstance(error, StageFailure):
            named.add(error.host)
        if starting is not None and starting.kind == "rejoined":
            named |= set(starting.host.split(",")) & up
        for h in named:
            self.watch.lose(h)
        return sorted(named | set(self.watch.lose_silent(up - named)))

    def _begin(self, plan: formats.Plan, event: Recovery) -> str:
        event.new_stages = stage_names(plan)
        event.predicted_old_s = self.replanner.predicted_s(self.client.plan)
        event.predicted_new_s = self.replanner.predicted_s(plan)
        self.log(f"hpipe: planned again: {' -> '.join(event.new_stages)}"
                 + (f" ({event.predicted_new_s:.3f} s predicted, {event.predicted_old_s:.3f} s before)"
                    if event.predicted_new_s is not None and event.predicted_old_s is not None else "")
                 + "; starting it")
        self.event, self.t_start = event, time.monotonic()
        return self._plan_file(plan)

    def _plan_file(self, plan: formats.Plan) -> str:
        """The plan as the file the launch reads (and copies to the hosts)."""
        path = os.path.join(self.plans, f"plan-{secrets.token_hex(4)}.json")
        formats.write_plan(plan, path)
        return path

    def _degrade(self, why: str, event: Recovery) -> None:
        if self.degraded is None:
            self.log(f"hpipe: degraded: {why}; requests get 503 until a host returns")
        event.degraded = self.degraded = why
        self.client.end_open(f"the service is degraded: {why}")

    def _wait_for_hosts(self) -> bool:
        """Until a lost host answers again (it is counted up again); False once closed."""
        while not self.closed.wait(0.5):
            back = self.watch.back()
            if back:
                for h in back:
                    self.watch.regain(h)
                self.log(f"hpipe: {', '.join(sorted(back))} answers again; planning over it")
                return True
        return False

    # ------------------------------------------------------------------ the report thread
    def ready(self, resumed: list[int]) -> None:
        """The new pipeline's stage 0 is ready and has the open requests, `resumed` those it resumed."""
        if self.event is None:
            return
        self.failed_starts = 0
        self.t_ready = time.monotonic()
        self.event.phases["start"] = round(self.t_ready - self.t_start, 3)
        self.event.resumed = len(resumed)
        self.client.metrics.resumed += len(resumed)
        with self.lock:
            self.pending = set(resumed)
            if not self.pending:
                self._done()

    def tokens(self, indices) -> None:
        """These requests had a token (or ended): the event is over once every resumed one has."""
        if not self.pending:            # (every report's tokens come here: nothing to wait for, mostly)
            return
        with self.lock:
            if self.event is None or not self.pending:
                return
            self.pending.difference_update(indices)
            if not self.pending:
                self._done()

    def _done(self) -> None:
        event, now = self.event, time.monotonic()
        if event.resumed:
            event.phases["reprefill"] = round(now - self.t_ready, 3)
        event.outage_s = round(now - (self.t_fail if event.kind == "lost" else self.t_start), 3)
        self.client.metrics.events.append(event)
        self.event = None
        self.log(f"hpipe: {event.line()}")

    # ------------------------------------------------------------------ returning and new hosts
    def add_hosts(self, inventory: formats.Inventory) -> list[str]:
        """The inventory read again (SIGHUP): its hosts the pipeline does not know are watched like
        returning ones (each joins once its sshd answers, checked by the start's preflight, when the
        plan with it gains). Returns their names."""
        new = [h for h in inventory.hosts if h.name not in self.replanner.hosts]
        self.client.inventory = self.watch.inventory = inventory
        self.watch.hosts.update({h.name: h for h in inventory.hosts})
        for h in new:
            self.replanner.devices += [(h.name, d) for d in h.devices]
            self.watch.lose(h.name, count=False)
        return [h.name for h in new]

    def _rejoin(self) -> None:
        while not self.closed.wait(1.0):
            launch = self.client.launch
            if self.switch is None and self.event is None and self.degraded is None and self.client.accepting:
                back = self.watch.back()
                if back:
                    try:
                        self._consider(back, launch)
                    except Exception as e:  # noqa: BLE001 - the service goes on without the host
                        self.log(f"hpipe: {', '.join(sorted(back))}: not taken back: {type(e).__name__}: {e}")

    def _consider(self, back: set[str], launch) -> None:
        up = set(self.replanner.hosts) - (self.watch.down() - back)
        t = time.monotonic()
        try:
            plan = self.replanner.plan_for(up)
        except HpipeError as e:          # (a host the run's profile does not know): not asked again
            self.log(f"hpipe: {', '.join(sorted(back))} answers, but no plan takes it: {e}; left out (profile it "
                     f"with `hpipe profile --cluster` and plan again to use it)")
            for h in back:
                self.watch.regain(h)
                self.replanner.devices = [d for d in self.replanner.devices if d[0] != h]
            return
        for h in back:
            self.watch.regain(h)
        old, new = self.client.plan, plan
        old_s, new_s = self.replanner.predicted_s(old), self.replanner.predicted_s(new)
        gains = (len(new.stages) > len(old.stages) if old_s is None or new_s is None
                 else new_s < old_s * (1 - REJOIN_GAIN))
        what = f" ({new_s:.3f} s predicted against {old_s:.3f} s now)" if old_s and new_s else ""
        self.log(f"hpipe: {', '.join(sorted(back))} answers again; the plan with it: "
                 f"{' -> '.join(stage_names(new))}{what}: " + ("switching to it" if gains else "staying"))
        if not gains:
            return
        event = Recovery("rejoined", ",".join(sorted(back)), "answers again", old_stages=stage_names(old),
                         new_stages=stage_names(new), predicted_old_s=old_s, predicted_new_s=new_s)
        event.phases["replan"] = round(time.monotonic() - t, 3)
        path = self._plan_file(plan)
        def take() -> bool:             # the pipeline it was planned against, still serving: switch
            if self.event is not None:
                return False
            self.switch = (path, event, launch)
            return True

        if not self.client.while_serving(launch, take):
            self.log(f"hpipe: {', '.join(sorted(back))}: the pipeline changed meanwhile; considered again later")
            for h in back:
                self.watch.lose(h, count=False)
            return
        launch.stop()                  # the run thread takes the switch when the stages have ended
