"""`hpipe profile`: runs the measurement workers, or the catalog's estimates, and writes a profile.

Local devices are measured one after another (concurrent runs would share the CPU cores), each by
the worker command `python -m hpipe.profiler.measure` that the SSH launcher will run unchanged on remote
hosts; devices with the same identity are measured once and the result stands for all of them.
Links are measured for every ordered pair of devices (and, for CPU devices, between two processes
on the same one, as two local stages would use it). A device or link that fails is reported in
the profile's `errors` and the others go on; what was measured is written.
"""

from __future__ import annotations

import datetime
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hpipe import __version__, formats, models, ssh
from hpipe.errors import HpipeError
from hpipe.reports import parse
from hpipe.profiler import catalog
from hpipe.grid import heldout_error
from hpipe.net import free_port

LINK_TIMEOUT_S = 300        # one link's two workers (a quick measurement takes seconds)

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HPIPE_JOB_TOKEN=secrets.token_hex(16))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _reports(proc):
    """Yields the worker's report objects as they come; log lines are kept for error messages."""
    tail = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        msg = parse(line)
        if msg is not None:
            yield msg
        else:
            tail = (tail + [line])[-5:]
    proc.wait()


def profile_header(model_spec: str, config, dtype: str, max_seq_len: int, quick: bool, weights: str = "none",
                   kv_dtype: str = formats.KV_DTYPE) -> dict:
    name = model_spec if model_spec in (models.DEFAULT_MODEL, *models.ARCHITECTURES) else \
        str(Path(model_spec).expanduser().resolve())
    return {
        "version": formats.PROFILE_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "created_by": f"hpipe {__version__}",
        "model": {"name": name, "family": config.model_type, "units": models.num_units(config),
                  "blocks": models.num_blocks(config), "fingerprint": models.fingerprint(config)},
        "dtype": dtype, "kv_dtype": kv_dtype, "weights": weights, "max_seq_len": max_seq_len, "quick": quick,
        "bytes": models.unit_bytes(config, dtype, weights, kv_dtype).to_json(), "devices": [], "links": [], "errors": [],
    }


def _device_names(devices: list[str]) -> dict[str, str]:
    """A cheap identity per device, to measure each kind once."""
    names = {}
    for d in devices:
        if d.startswith("cuda"):
            import torch

            if torch.cuda.is_available():
                index = int(d.split(":")[1]) if ":" in d else 0
                names[d] = torch.cuda.get_device_name(index) if index < torch.cuda.device_count() else d
            else:
                names[d] = d
        else:
            names[d] = d
    return names


def _follow_measurement(messages, progress, task) -> tuple[dict | None, str | None]:
    """Shows a measurement worker's reports on the progress bar; returns (device profile, error)."""
    result, error = None, None
    for msg in messages:
        kind = msg.pop("type")
        if kind == "estimate":
            progress.update(task, total=msg["points"], note=f"estimated {msg['seconds']:.0f} s")
        elif kind == "progress":
            progress.update(task, completed=msg["done"])
        elif kind == "device_profile":
            result = msg
        elif kind == "error":
            error = msg["message"]
    return result, error


def _device_entry(result: dict, host: str, device: str) -> dict:
    entry = {"id": f"{host}/{device}", "host": host, "device": device,
             "type": result["identity"].get("name", device), **result}
    entry.pop("max_seq_len", None), entry.pop("dtype", None)
    return entry


def _add_link(profile: dict, a: dict, b: dict, link: dict, measured_between: str | None = None) -> None:
    for src, dst, key in ((a, b, "forward"), (b, a, "backward")):
        if (src["id"], dst["id"]) in {(x["src"], x["dst"]) for x in profile["links"]}:
            continue
        entry = {"src": src["id"], "dst": dst["id"], "backend": link["backend"], "source": "measured", **link[key]}
        if measured_between:
            entry["measured_between"] = measured_between
        profile["links"].append(entry)


def profile_local(model_spec: str, devices: list[str], out: str, quick: bool, max_seq_len: int | None,
                  dtype: str, console: Console | None = None, host: str = "local", threads: int = 0,
                  weights: str = "none", kv_dtype: str = formats.KV_DTYPE) -> formats.Profile:
    console = console or Console(stderr=True)
    source = models.resolve_model(model_spec, progress=lambda m: console.print(m))
    config = models.load_config(source.path)
    n = _longest_prompt(config, max_seq_len)
    for d in devices:
        formats.check_device("--devices", d, d)
    profile = profile_header(model_spec, config, dtype, n, quick, weights, kv_dtype)
    names = _device_names(devices)
    measured: dict[str, dict] = {}  # identity name -> device profile
    threads = threads or max(1, os.cpu_count() or 1)
    # where stderr is no terminal (a log), the bars show only at the end: a line per step as it comes
    step = (lambda text: None) if console.is_terminal else \
        (lambda text: console.print(f"{datetime.datetime.now():%H:%M:%S} {text}", highlight=False))
    with _bars(console) as progress:
        for d in devices:
            dev_id = f"{host}/{d}"
            if names[d] in measured:
                entry = dict(measured[names[d]], id=dev_id, host=host, device=d, measured_on=measured[names[d]]["id"])
                profile["devices"].append(entry)
                continue
            task = progress.add_task(f"{dev_id} units", total=None, note="starting")
            step(f"{dev_id}: measuring its units")
            cmd = [sys.executable, "-m", "hpipe.profiler.measure", "--model", str(source.gguf or source.path),
                   "--device", d, "--dtype", dtype, "--kv-dtype", kv_dtype, "--weights", weights,
                   "--max-seq-len", str(n), "--threads", str(threads)] + (["--quick"] if quick else [])
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                    stdin=subprocess.DEVNULL)
            result, error = _follow_measurement(_reports(proc), progress, task)
            stderr = proc.stderr.read()
            if result is None:
                error = error or f"exit code {proc.returncode}: {' | '.join(stderr.strip().splitlines()[-3:])}"
                profile["errors"].append({"host": host, "device": d, "message": error})
                progress.update(task, note=f"[red]failed: {error}")
                step(f"{dev_id}: failed: {error}")
                continue
            step(f"{dev_id}: done")
            entry = _device_entry(result, host, d)
            measured[names[d]] = entry
            profile["devices"].append(entry)
            progress.update(task, note="done")
        _measure_local_links(profile, host, quick, progress, step)
    if not profile["devices"]:
        raise HpipeError("no device could be profiled: " + "; ".join(f"{e['device']}: {e['message']}"
                                                                    for e in profile["errors"]))
    gpus = [d["device"] for d in profile["devices"] if d["device"].startswith("cuda")]
    if len(gpus) > 1:
        profile["peers"] = measure_peers(gpus, host, profile["errors"])
    return _written(profile, out)


def _written(profile: dict, out: str) -> formats.Profile:
    """The profile measured (its JSON, as the measurement built it), read as the planner will read
    it and written to `out`."""
    result = formats.parse_profile(profile, out)
    formats.write_profile(result, out)
    return result


def _longest_prompt(config, max_seq_len: int | None) -> int:
    """The longest prompt the tables reach: --max-seq-len (within the model's context), else 2,048."""
    ctx = models.context_length(config)
    if max_seq_len is not None and not 1 <= max_seq_len <= ctx:
        raise HpipeError(f"--max-seq-len {max_seq_len}: must be between 1 and the model's context ({ctx})")
    return min(max_seq_len or 2048, ctx)


def _bars(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def _measure_local_links(profile: dict, host: str, quick: bool, progress: Progress, step) -> None:
    """Every pair of this machine's profiled devices once (a link's measurement times both
    directions, `_add_link`), and each CPU with itself (two local stages' hop)."""
    ok = profile["devices"]
    pairs = [(a, b) for i, a in enumerate(ok) for b in ok[i + 1:]] + [(a, a) for a in ok if a["device"] == "cpu"]
    for a, b in pairs:
        task = progress.add_task(f"link {a['id']} -> {b['id']}", total=None, note="")
        step(f"link {a['id']} -> {b['id']}: measuring")
        try:
            link = measure_link(a["device"], b["device"], quick)
        except HpipeError as e:
            profile["errors"].append({"host": host, "device": f"{a['device']}->{b['device']}", "message": str(e)})
            progress.update(task, note=f"[red]failed: {e}")
            step(f"link {a['id']} -> {b['id']}: failed: {e}")
            continue
        _add_link(profile, a, b, link)
        progress.update(task, total=1, completed=1,
                        note=f"{link['forward']['alpha_s'] * 1e6:.0f} us, "
                             f"{link['forward']['beta_bytes_per_s'] / 1e9:.2f} GB/s")


def measure_peers(gpus: list[str], host: str, errors: list) -> list[dict]:
    """Real copies between every ordered pair of this host's GPUs (SiDP's WaS source from a peer)."""
    proc = subprocess.run([sys.executable, "-m", "hpipe.profiler.measure", "--peers", ",".join(gpus)],
                          capture_output=True, text=True, env=_env(), stdin=subprocess.DEVNULL)
    for msg in filter(None, map(parse, proc.stdout.splitlines())):
        if msg.get("type") == "peer_profile":
            return [{**p, "src": f"{host}/{p['src']}", "dst": f"{host}/{p['dst']}"} for p in msg["peers"]]
    errors.append({"host": host, "device": ",".join(gpus), "message": "the peer copy probe failed: "
                   + " | ".join(proc.stderr.strip().splitlines()[-2:])})
    return []


def measure_link(dev_a: str, dev_b: str, quick: bool) -> dict:
    port = free_port()
    env = _env()
    # rank 0 reports on stdout; both ranks' stderr go to one file, so that neither blocks on a pipe
    # nobody reads while the other is waited for
    with tempfile.TemporaryFile("w+") as err:
        procs = [subprocess.Popen([sys.executable, "-m", "hpipe.profiler.links", "--rank", str(r), "--master-port",
                                   str(port), "--devices", f"{dev_a},{dev_b}"] + (["--quick"] if quick else []),
                                  stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=err, text=True,
                                  env=env, stdin=subprocess.DEVNULL) for r in (0, 1)]
        try:
            out = procs[0].communicate(timeout=LINK_TIMEOUT_S)[0]
            procs[1].wait(timeout=LINK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            raise HpipeError(f"link {dev_a} <-> {dev_b}: its two workers did not finish in {LINK_TIMEOUT_S} s "
                             f"and were stopped") from None
        err.seek(0)
        stderr = err.read()
    for line in out.splitlines():
        msg = parse(line)
        if msg is not None:
            if msg["type"] == "link_profile":
                return msg
            if msg["type"] == "error":
                raise HpipeError(msg["message"])
    raise HpipeError(f"link worker failed: {' | '.join(stderr.strip().splitlines()[-3:])}")


# --------------------------------------------------------------------------------------------
# Remote hosts, through the SSH layer (hpipe.ssh)


def _remote_reports(conn, argv: list[str], env: dict, tail: list[str], device: str, timeout_s: float = 30.0):
    """Runs a profiler worker for `device` on a host under the SSH wrapper and yields its reports as
    they come; stderr lines are kept in `tail` for error messages; a non-zero exit becomes an error
    report. A CPU device's worker is forked by the host's fork server, as a stage's is: the profile's
    first worker starts it (its imports, once a host), and the launch after the profile finds it."""
    import queue

    from hpipe.launcher.local import forked

    lines: queue.Queue = queue.Queue()
    proc = ssh.RemoteProcess(conn, argv, env, lines, conn.host.name, timeout_s=timeout_s, fork_server=forked(device))
    open_streams = 2
    try:
        while open_streams:
            try:
                _, name, line = lines.get(timeout=1.0)
            except queue.Empty:
                if proc.silent_s() > timeout_s:
                    yield {"type": "error", "message": f"no answer from host {conn.host.name} for {timeout_s:g} s"}
                    return
                continue
            if line is None:
                open_streams -= 1
                continue
            msg = parse(line) if name == "out" else None
            if msg is not None:
                yield msg
            else:
                tail[:] = (tail + [line])[-5:]
        code = proc.wait(timeout=10)
        if code not in (0, None):
            yield {"type": "error", "message": f"{proc.describe_exit(code)}: {' | '.join(tail[-3:])}"}
    finally:
        proc.stop()
        proc.close()


def _remote_free_port(conn) -> int:

    code, out, err = ssh.run_python(conn, "from hpipe.net import free_port\nprint(free_port())", [])
    if code != 0:
        raise HpipeError(f"host {conn.host.name}: cannot pick a port: {err.strip()[-200:]}")
    return int(out.strip().splitlines()[-1])


def profile_cluster(model_spec: str, inventory: formats.Inventory, out: str, quick: bool, max_seq_len: int | None,
                    dtype: str, accept_new_keys: bool = False, console: Console | None = None,
                    host_timeout_s: float = 30.0, weights: str = "none",
                    kv_dtype: str = formats.KV_DTYPE) -> formats.Profile:
    """Measures every device of every host (one host at a time, so that measurements do not share
    a network or a machine), then the link between every pair of hosts, over SSH. Devices of one
    host are measured as in `profile_local`; a link between two hosts is measured once, between
    their first devices, and stands for every device pair of those hosts."""
    import itertools
    from concurrent.futures import ThreadPoolExecutor


    console = console or Console(stderr=True)
    config = models.load_config(models.resolve_model(model_spec, progress=lambda m: console.print(m)).path)
    n = _longest_prompt(config, max_seq_len)
    profile = profile_header(model_spec, config, dtype, n, quick, weights, kv_dtype)
    names = [h.name for h in inventory.hosts]
    conns = ssh.connect_all(inventory, names, accept_new_keys, log=lambda m: console.print(m))
    try:
        with ThreadPoolExecutor(max_workers=len(conns)) as pool:
            probes = dict(zip(names, pool.map(lambda c: ssh.probe(c, model=model_spec), conns.values())))
        problems = [f"host {name}: {p}" for name in names for p in ssh.host_problems(probes[name])]
        if problems:
            raise HpipeError("preflight failed, nothing was measured: " + "; ".join(problems))
        with _bars(console) as progress:
            first: dict[str, dict] = {}
            for host in inventory.hosts:
                threads = host.threads or max(1, probes[host.name].get("cores") or 1)
                argv = [host.python, "-m", "hpipe.profiler.measure", "--model", model_spec, "--dtype", dtype,
                        "--kv-dtype", kv_dtype, "--weights", weights, "--max-seq-len", str(n), "--threads",
                        str(threads)] + (["--quick"] if quick else [])
                entries = _measure_host_devices(profile, conns[host.name], host, argv, threads, progress,
                                                host_timeout_s)
                if entries:
                    first[host.name] = entries[0]
                for a, b in itertools.permutations(entries, 2):   # devices inside one host
                    if a["id"] < b["id"]:
                        _measure_remote_link(profile, progress, conns, host, host, a, b, quick, host_timeout_s)
            hosts = {h.name: h for h in inventory.hosts}
            for ha, hb in itertools.combinations([h for h in names if h in first], 2):
                link = _measure_remote_link(profile, progress, conns, hosts[ha], hosts[hb], first[ha], first[hb],
                                            quick, host_timeout_s)
                if link is None:
                    continue
                for a in profile["devices"]:      # the host pair's link stands for all its device pairs
                    for b in profile["devices"]:
                        if a["host"] == ha and b["host"] == hb:
                            _add_link(profile, a, b, link, measured_between=f"{first[ha]['id']} {first[hb]['id']}")
    finally:
        for c in conns.values():
            c.close()
    if not profile["devices"]:
        raise HpipeError("no device could be profiled: " + "; ".join(f"{e['host']}/{e['device']}: {e['message']}"
                                                                    for e in profile["errors"]))
    return _written(profile, out)


def _measure_host_devices(profile: dict, conn, host: formats.Host, argv: list[str], threads: int,
                          progress: Progress, timeout_s: float) -> list[dict]:
    """Each device of one host, one after another (`argv`: the measurement worker, less its
    --device); their entries, also added to the profile (a failure to its errors)."""
    entries = []
    for d in host.devices:
        task = progress.add_task(f"{host.name}/{d} units", total=None, note="starting")
        tail: list[str] = []
        env = {**host.env, "PYTHONUNBUFFERED": "1"}
        result, error = _follow_measurement(_remote_reports(conn, [*argv, "--device", d], env, tail, d, timeout_s),
                                            progress, task)
        if result is None:
            error = error or " | ".join(tail[-3:])
            profile["errors"].append({"host": host.name, "device": d, "message": error})
            progress.update(task, note=f"[red]failed: {error}")
            continue
        entry = _device_entry(result, host.name, d)
        entry["threads"] = threads
        profile["devices"].append(entry)
        entries.append(entry)
        progress.update(task, note="done")
    return entries


def _measure_remote_link(profile, progress, conns, host_a, host_b, a: dict, b: dict, quick: bool,
                         timeout_s: float) -> dict | None:
    """profiler.links with rank 0 on host_a (the rendezvous) and rank 1 on host_b."""
    import secrets

    task = progress.add_task(f"link {a['id']} <-> {b['id']}", total=None, note="")
    try:
        port = _remote_free_port(conns[host_a.name])
    except HpipeError as e:
        profile["errors"].append({"host": host_a.name, "device": f"{a['id']}<->{b['id']}", "message": str(e)})
        return None
    token = secrets.token_hex(16)
    gens, tails = [], []
    for rank, (host, device) in enumerate(((host_a, a["device"]), (host_b, b["device"]))):
        argv = [host.python, "-m", "hpipe.profiler.links", "--rank", str(rank), "--master-addr", host_a.address,
                "--master-port", str(port), "--devices", f"{a['device']},{b['device']}"] + (["--quick"] if quick else [])
        tail: list[str] = []
        tails.append(tail)
        gens.append(_remote_reports(conns[host.name], argv, {**host.env, "HPIPE_JOB_TOKEN": token,
                                                              "PYTHONUNBUFFERED": "1"}, tail, device, timeout_s))
    # rank 1 must run while rank 0 reports: drain it in a thread
    import threading

    rank1_msgs: list[dict] = []
    t = threading.Thread(target=lambda: rank1_msgs.extend(gens[1]), daemon=True)
    t.start()
    link, error = None, None
    for msg in gens[0]:
        if msg["type"] == "link_profile":
            link = msg
        elif msg["type"] == "error":
            error = msg["message"]
    t.join(timeout=30)
    if link is None:
        error = error or next((m["message"] for m in rank1_msgs if m["type"] == "error"), None) or \
            " | ".join(tails[0][-2:] + tails[1][-2:])
        profile["errors"].append({"host": f"{host_a.name},{host_b.name}", "device": f"{a['id']}<->{b['id']}",
                                  "message": error})
        progress.update(task, note=f"[red]failed: {error}")
        return None
    _add_link(profile, a, b, link)
    progress.update(task, total=1, completed=1, note=f"{link['forward']['alpha_s'] * 1e6:.0f} us, "
                                                     f"{link['forward']['beta_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s")
    return link


# --------------------------------------------------------------------------------------------
# Estimated profiles


def estimated_tables(config, spec: catalog.DeviceSpec, dtype: str, max_seq_len: int, weights: str = "none",
                     kv_dtype: str | None = None) -> dict:
    from hpipe.profiler.measure import grid

    s_grid, c_grid = grid(max_seq_len, quick=False)
    tables = {}
    for kind in formats.UNIT_KINDS:
        cs = c_grid if kind == "attn" else [0]
        t = [[float(catalog.unit_time(config, kind, s, c, spec, dtype, weights, kv_dtype)) if s + c <= max_seq_len
              else None
              for c in cs] for s in s_grid]
        tables[kind] = {"s": s_grid, "c": cs, "t": t}
    return tables


def profile_estimate(model_spec: str, inventory: formats.Inventory, out: str, dtype: str,
                     max_seq_len: int | None, weights: str = "none",
                     kv_dtype: str = formats.KV_DTYPE) -> formats.Profile:
    config = models.config_for(model_spec)
    ctx = models.context_length(config)
    n = min(max_seq_len or 2048, ctx)
    profile = profile_header(model_spec, config, dtype, n, quick=False, weights=weights, kv_dtype=kv_dtype)
    by_type: dict[str, dict] = {}
    for host in inventory.hosts:
        if not host.device_types:
            raise HpipeError(f"{inventory.path}: hosts[{host.name}]: --estimate needs device_types "
                             f"(catalog names: {', '.join(catalog.CATALOG)})")
        for device, dtype_name in zip(host.devices, host.device_types):
            spec = catalog.spec(dtype_name)
            if dtype_name not in by_type:
                tables = estimated_tables(config, spec, dtype, n, weights, kv_dtype)
                by_type[dtype_name] = {"compute": tables, "fit_error": {k: heldout_error(v["s"], v["c"], v["t"])
                                                                        for k, v in tables.items()},
                                       "decode": catalog.estimated_decode_table(config, spec, dtype, n, weights,
                                                                                kv_dtype)}
            profile["devices"].append({
                "id": f"{host.name}/{device}", "host": host.name, "device": device, "type": dtype_name,
                "source": "estimated", "identity": {"name": spec.name, "catalog": dtype_name},
                "memory": {"free_bytes": int(spec.memory_gib * 2 ** 30 * 0.92), "total_bytes": int(spec.memory_gib * 2 ** 30)},
                **by_type[dtype_name]})
    for a in profile["devices"]:
        for b in profile["devices"]:
            if a is b:
                continue
            alpha, beta = inventory.link(a["host"], b["host"])
            profile["links"].append({"src": a["id"], "dst": b["id"], "backend": "estimated", "source": "estimated",
                                     "alpha_s": alpha, "beta_bytes_per_s": beta})
    return _written(profile, out)


def summarize(profile: formats.Profile) -> str:
    rows = []
    for d in profile.devices:
        att = d.compute["attn"]
        t_full = att.t[-1][0]
        rows.append(f"{d.id} ({d.type}, {d.source}): attention half at s={att.s[-1]} {t_full * 1e3:.2f} ms; "
                    f"fit error " + ", ".join(f"{k} {v:.1%}" for k, v in d.fit_error.items() if v is not None))
    for link in profile.links:
        rows.append(f"{link.src} -> {link.dst}: alpha {link.alpha_s * 1e6:.0f} us, "
                    f"beta {link.beta_bytes_per_s / 1e9:.3f} GB/s")
    for e in profile.errors:
        rows.append(f"FAILED {e['host']}/{e['device']}: {e['message']}")
    return "\n".join(rows)

