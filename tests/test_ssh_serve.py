"""`hpipe serve --cluster`, `hpipe warmup --cluster` and `--push-model` against the emulated hosts
(tests/netns_hosts.py): the second file of host tests, beside test_ssh.py's launches and refusals,
so that pytest-xdist's two workers run the two at once (each builds its own network). Needs root and
openssh-server; skips with the reason otherwise.

    pytest -m hosts          # these and test_ssh.py's
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from browser import browser, open_page, wait_until
from browser import unavailable_reason as browser_missing
from netns_hosts import elastic_profile, set_link
# the hosts (a cluster of this module's own: the fixture's scope), the plan and the undisturbed run
from test_ssh import cluster, plan_and_prompts, undisturbed  # noqa: F401
from test_ssh import REASON, ROOT, error_line, hpipe, kill_worker, wait_until_clean

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(REASON is not None, reason=f"emulated hosts: {REASON}")]


# --------------------------------------------------------------------------------------------
# Only each host's part of the model (--push-model)

@pytest.mark.slow
def test_push_model_copies_only_each_hosts_shards(cluster, tiny_models, tmp_path):
    """A sharded checkpoint: --push-model copies to each host the shards its stages read,
    checksummed; a second launch copies nothing and gives the same tokens."""
    import shutil

    from hpipe import models

    src = tmp_path / "only-here-model"
    shutil.copytree(tiny_models["qwen2"], src)
    config = models.load_config(src)
    n_units = models.num_units(config)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) >= 3
    plan = tmp_path / "plan.json"
    cuts = f"{n_units // 3},{2 * n_units // 3}"
    assert hpipe("plan", "--model", src, "--cluster", cluster.inventory_path, "--cuts", cuts, "-o", plan,
                 cwd=tmp_path).returncode == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [5 + i, 9, 11, 40, 7]}) + "\n"
                               for i in range(2)))
    # where each host keeps pushed models: ask the hosts (their user's home need not be this HOME)
    from hpipe import formats, ssh

    inventory = formats.load_inventory(cluster.inventory_path)
    conns = ssh.connect_all(inventory, [h.name for h in inventory.hosts], log=lambda msg: None)
    try:
        homes = {name: ssh.probe(conn)["home"] for name, conn in conns.items()}
    finally:
        for conn in conns.values():
            conn.close()
    for home in set(homes.values()):
        shutil.rmtree(Path(home) / ".cache" / "hpipe" / "pushed", ignore_errors=True)
    # a model a host does not have is refused by the preflight
    line = error_line(hpipe("cluster", "check", cluster.inventory_path, "--model", tmp_path / "absent", cwd=tmp_path))
    assert "host h0" in line and "absent" in line and "--push-model" in line, line
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", tmp_path / "a.jsonl",
              "--max-new-tokens", "6", "--push-model", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    copied = {line.split(":")[1].strip(): line for line in r.stderr.splitlines() if "model files copied" in line}
    assert set(copied) == {"h0", "h1", "h2"}, r.stderr
    for host, line in copied.items():
        needed, total = (int(x) for x in line.split("(")[1].split(" weight shards")[0].split(" of "))
        assert total == len(shards) and 1 <= needed < total, line      # only the shards of its own units
    for host, line in copied.items():   # the hosts share this file system: read what each was given
        remote_dir = Path(line.rsplit(" to ", 1)[1].strip())
        assert remote_dir.is_relative_to(Path(homes[host]) / ".cache" / "hpipe" / "pushed"), line
        present = [name for name in shards if (remote_dir / name).exists()]
        assert present, line
        for name in present:
            assert (remote_dir / name).read_bytes() == (src / name).read_bytes()
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", tmp_path / "b.jsonl",
              "--max-new-tokens", "6", "--push-model", "--quiet", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr.count(": 0 of ") == 3, r.stderr
    ids = [{x["id"]: x["output_ids"] for x in map(json.loads, (tmp_path / f).read_text().splitlines())}
           for f in ("a.jsonl", "b.jsonl")]
    assert ids[0] == ids[1] and len(ids[0]) == 2


def test_push_model_sends_each_host_a_gguf_of_its_own_stages(cluster, tmp_path):
    """A GGUF mixture-of-experts file over the three hosts: --push-model sends each host a GGUF of only
    its stages' tensors (the file's blocks as they are, checked by hash) beside the whole file's
    config, not the whole file, and the tokens are those of the same cuts run here on the whole file."""
    from conftest import write_moe_gguf
    from hpipe import formats, models, quant
    from hpipe.request import Request
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner
    from test_moe import BLOCK_TYPES

    here = tmp_path / "moe-only-here"
    here.mkdir()
    path = write_moe_gguf(here / "moe.gguf", BLOCK_TYPES)
    hpipe("plan", "--model", path, "--cluster", cluster.inventory_path, "--cuts", "3,6", "-o", tmp_path / "plan.json",
          cwd=tmp_path, check=True)
    prompts = [[300 + i, 9, 11, 40, 7] for i in range(2)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    r = hpipe("launch", tmp_path / "plan.json", "--cluster", cluster.inventory_path, "--prompts", tmp_path / "p.jsonl",
              "--out", tmp_path / "hosts.jsonl", "--max-new-tokens", "6", "--push-model", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    copied = [line for line in r.stderr.splitlines() if "model files copied" in line]
    assert len(copied) == 3, r.stderr           # each host its own directory (they share a file system here)
    for line in copied:
        sent = list(Path(line.rsplit(" to ", 1)[1].strip()).glob("*.gguf"))
        assert len(sent) == 1 and sent[0].stat().st_size < 0.7 * path.stat().st_size, (line, sent)
    got = {x["id"]: x["output_ids"] for x in map(json.loads, (tmp_path / "hosts.jsonl").read_text().splitlines())}
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    plan = formats.load_plan(tmp_path / "plan.json")
    runners = [StageRunner(source, config, range(*st.units), weights=quant.WeightFormat("gguf"), kv_dtype=plan.kv_dtype)
               for st in plan.stages]
    want = run_inprocess(runners, [Request(i, f"p{i}", tuple(p), max_new_tokens=6, eos_ids=frozenset())
                                   for i, p in enumerate(prompts)], plan.slicing.slices_for, max_batch=2)
    for name, ids in got.items():        # a stop at an end-of-text token leaves a prefix
        assert ids and ids == want[name]["output_ids"][:len(ids)], (name, ids, want[name]["output_ids"])


# --------------------------------------------------------------------------------------------
# Serving on hosts

@pytest.mark.slow
def test_serve_on_hosts_answers_like_launch_and_ctrl_c_leaves_nothing(cluster, plan_and_prompts, undisturbed,
                                                                     tmp_path):
    """`hpipe serve --cluster`: requests reach stage 0 through its remote wrapper's stdin; greedy
    answers (streamed and not) equal `hpipe launch --cluster`'s, and Ctrl-C stops every host. The
    server starts on two hosts; the third, added to its inventory, joins on SIGHUP."""
    import openai

    from hpipe.net import free_port
    from hpipe import models
    plan, prompts = plan_and_prompts
    questions = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[:2]]
    # the launch's first 12 tokens, one prompt at a time as the server gets them below: the same
    # micro-batches, the same numbers (the plan's weights are quantized, whose kernels round inputs
    # to bf16: see test_serve.py)
    tokenizer = models.load_tokenizer(models.resolve_model("smollm2").path)
    launched = {k: tokenizer.decode(v[:12], skip_special_tokens=True) for k, v in undisturbed.items()}
    full = Path(cluster.inventory_path).read_text()
    inventory = tmp_path / "inventory.toml"          # h0 and h1 (h2's block left out)
    inventory.write_text("[[hosts]]".join(b for b in full.split("[[hosts]]") if 'name = "h2"' not in b))
    two = tmp_path / "two.json"        # the 3-stage plan's slicing: the same numbers as the launch's
    slices = str(json.loads(Path(plan).read_text())["slicing"]["count"])
    hpipe("plan", "--model", "smollm2", "--cluster", inventory, "--num-slices", slices, "-o", two, cwd=tmp_path,
          check=True)
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(two), "--cluster",
                             str(inventory), "--port", str(port), "--max-model-len", "512",
                             "--kv-pages", "64", "--compile", "off"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        inventory.write_text(full)
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 180
        while "rejoined h2" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.3)
        assert "h2 added" in (tmp_path / "serve.log").read_text()
        whole = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": questions[0]}],
                                               max_tokens=12, temperature=0).choices[0].message.content
        streamed = "".join(ch.delta.content or "" for ev in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": questions[1]}], max_tokens=12, temperature=0,
            stream=True) for ch in ev.choices)
        assert whole == launched["q0"] and streamed == launched["q1"]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert wait_until_clean(cluster, 2.0) == [], (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# A host lost and taken back while serving (launcher/elastic.py)

class Served:
    """`hpipe serve --cluster` in the background, its log, and the openai client."""

    def __init__(self, cluster, plan: Path, tmp_path: Path, *extra: str):
        import openai

        from hpipe.net import free_port
        self.port, self.log = free_port(), tmp_path / "serve.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(plan), "--cluster",
                                          str(cluster.inventory_path), "--port", str(self.port), "--max-model-len",
                                          "512", "--kv-pages", "128", "--max-batch", "12", "--compile", "off",
                                          *extra],
                                         stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=300)
        self.until(lambda: self.health()[0] == 200, 300, "the server never became ready")

    def text(self) -> str:
        return self.log.read_text()

    def get(self, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, "{}"

    def health(self) -> tuple[int, dict]:
        status, body = self.get("/health")
        return status, json.loads(body)

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    def until(self, ok, within: float, what: str) -> None:
        deadline = time.time() + within
        while not ok():
            assert self.proc.poll() is None and time.time() < deadline, f"{what}:\n{self.text()}"
            time.sleep(0.3)

    def chats(self, questions: list[str], during=None) -> list[str]:
        """Every question as a streaming greedy chat at once; `during()` runs once every stream has
        had its first piece. Returns the texts (any error fails the test)."""
        import threading
        texts, errors = [""] * len(questions), []
        begun = threading.Barrier(len(questions) + 1)

        def one(i: int) -> None:
            first = True
            try:
                for ev in self.client.chat.completions.create(
                        model="smollm2", messages=[{"role": "user", "content": questions[i]}], max_tokens=24,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    for ch in ev.choices:
                        texts[i] += ch.delta.content or ""
                    if first and texts[i]:
                        first = False
                        begun.wait(timeout=300)
            except Exception as e:  # noqa: BLE001 - what the client saw
                errors.append(repr(e))
                begun.abort()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        begun.wait(timeout=300)
        if during is not None:
            during()
        for t in threads:
            t.join(timeout=300)
        assert not errors, (errors, self.text())
        return texts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


QUESTIONS = [f"{q} ({i})" for i, q in enumerate(["What is the capital of France?", "Name three colours.",
                                                  "Count from one to ten.", "What is 2 + 2?"] * 3)]


@pytest.mark.slow
def test_serve_goes_on_through_a_lost_host_and_takes_it_back(cluster, tmp_path):
    """`hpipe serve --cluster` on 3 hosts (a float32 plan from a profile), 12 streaming chats at once:
    (a) one host's stage worker SIGKILLed mid-stream, (b) another host's link taken down mid-stream:
    every stream completes without an error with the undisturbed run's greedy text, /metrics counts
    the recoveries and the resumed requests, and each host, back, is taken into the pipeline again.
    Then two hosts down at once: the one left cannot hold the model, so requests get a 503 with the
    cause and /health says degraded, until the hosts return."""
    plan = tmp_path / "plan.json"
    profile = elastic_profile([h.spec.name for h in cluster.hosts], tmp_path / "profile.json")
    hpipe("plan", "--model", "smollm2", "--cluster", cluster.inventory_path, "--profile", profile, "--seq-len",
          "64", "-o", plan, cwd=tmp_path, check=True)
    assert [s["host"] for s in json.loads(plan.read_text())["stages"]] == ["h0", "h1", "h2"]
    served = Served(cluster, plan, tmp_path, "--heartbeat-timeout", "3", "--log-dir", str(tmp_path / "stages"))
    pages = contextlib.ExitStack()
    try:
        undisturbed = served.chats(QUESTIONS)
        # the live page (tests/test_dashboard.py) watches: the lost host's event row comes
        page = open_page(pages.enter_context(browser()), f"http://127.0.0.1:{served.port}", None) \
            if browser_missing() is None else None
        assert served.chats(QUESTIONS, during=lambda: kill_worker(cluster, "h1")) == undisturbed
        assert served.metric("hpipe_recoveries_total") == 1 and served.metric("hpipe_requests_resumed_total") >= 1
        if page is not None:
            wait_until(page, "document.querySelector(\"#events tr[data-kind='lost'][data-host='h1']\") !== null")
            row = page.inner_text("#events tr[data-kind='lost']")
            assert "lost h1" in row and "h1/cpu" in row and page.problems == [], row
        served.until(lambda: served.metric("hpipe_rejoins_total") == 1, 120, "h1 was not taken back")
        assert "hpipe: h1 answers again" in served.text()     # (the next round runs on the three hosts)

        def link_down() -> None:
            set_link(cluster, "h2", up=False)
        try:
            assert served.chats(QUESTIONS, during=link_down) == undisturbed
        finally:
            set_link(cluster, "h2", up=True)
        assert served.metric("hpipe_recoveries_total") == 2
        served.until(lambda: served.metric("hpipe_rejoins_total") == 2, 120, "h2 was not taken back")

        import openai
        for name in ("h1", "h2"):
            set_link(cluster, name, up=False)
        try:
            served.until(lambda: served.health()[0] == 503, 120, "never degraded")
            status, body = served.health()
            assert body["status"] == "degraded" and "cannot hold the model" in body["error"], body
            with pytest.raises(openai.APIStatusError) as refused:
                served.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=4)
            assert refused.value.status_code == 503 and "cannot hold the model" in str(refused.value)
        finally:
            for name in ("h1", "h2"):
                set_link(cluster, name, up=True)
        served.until(lambda: served.health() == (200, {"status": "ok"}), 180, "never recovered from degraded")
        assert served.chats(QUESTIONS[:4]) == undisturbed[:4]
        assert "Traceback" not in served.text()
    finally:
        pages.close()
        served.stop()
    assert wait_until_clean(cluster, 5.0) == [], served.text()


def test_warmup_on_every_host_at_once_then_the_default_launch_runs_compiled(cluster, tiny_models, tmp_path):
    """`hpipe warmup --cluster FILE --plan plan.json`: each host of the plan compiles its graphs with
    the plan's settings and the threads its stage will run with, a line per host as it goes; a
    launch with default flags then finds every host warm (no stage says it decodes eagerly) and
    runs compiled graphs."""
    plan = tmp_path / "plan.json"
    hpipe("plan", "--model", tiny_models["llama"], "--cluster", cluster.inventory_path, "-o", plan, cwd=tmp_path,
          check=True)
    r = hpipe("warmup", "--cluster", cluster.inventory_path, "--plan", plan, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    hosts = [st["host"] for st in json.loads(plan.read_text())["stages"]]
    for host in hosts:
        assert f"{host}: compiling for 1 thread(s)" in r.stdout, r.stdout
        assert any(line.startswith(f"{host}: ") and "decode graphs compiled and warm" in line
                   for line in r.stdout.splitlines()), r.stdout
    assert f"{len(set(hosts))} host(s) warm" in r.stdout
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "input_ids": [5, 6, 7, 8, 9]}) + "\n")
    out = tmp_path / "out.jsonl"
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", tmp_path / "p.jsonl", "--out", out,
              "--max-new-tokens", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decode runs eagerly" not in r.stderr + r.stdout and "hpipe warmup" not in r.stdout
    options = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]["options"]
    assert options["compiled"] and not options["compile_cold"]
