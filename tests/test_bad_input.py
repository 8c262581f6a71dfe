"""Bad input gets one clear line naming what is wrong and where, a non-zero exit, no traceback;
a crash after k prompts leaves k complete results and --resume finishes the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpipe.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def one_error_line(err, *needles):
    lines = [l for l in err if l.startswith("hpipe: error:")]
    assert len(lines) == 1, err
    assert not any("Traceback" in l for l in err), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, needle", [(["launch", "plan.json", "--bogus"], "No such option: --bogus"),
                                          (["plan", "--stages", "x"], "'--stages'"),
                                          (["bogus"], "No such command 'bogus'")])
def test_a_bad_option_or_command_is_one_line_naming_it(capsys, argv, needle):
    """What the command line's parser refuses (typer's own copy of click raises it) is one line like
    hpipe's own errors, with where to look, and exit code 2: no traceback."""
    code, err = run_cli(capsys, *argv)
    assert code == 2
    one_error_line(err, needle, "--help")
    assert len(err) == 1, err


@pytest.fixture
def llama_plan(tiny_models, tmp_path):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tiny_models["llama"]), "--stages", "2", "-o", str(plan)]) == 0
    return plan


def test_unknown_and_missing_model(capsys, tmp_path):
    code, err = run_cli(capsys, "plan", "--model", "no-such-model", "--stages", "2", "-o", str(tmp_path / "p.json"))
    assert code == 2
    one_error_line(err, "no-such-model")
    code, err = run_cli(capsys, "plan", "--model", str(tmp_path / "missing.gguf"), "--stages", "2",
                        "-o", str(tmp_path / "p.json"))
    assert code == 2
    one_error_line(err, "missing.gguf", "not found")
    (tmp_path / "emptydir").mkdir()
    code, err = run_cli(capsys, "plan", "--model", str(tmp_path / "emptydir"), "--stages", "2", "-o", "x.json")
    one_error_line(err, "config.json")


def test_cuts_out_of_range(capsys, tiny_models, tmp_path):
    for cuts in ("0", "10", "5,3", "4,4"):
        code, err = run_cli(capsys, "plan", "--model", str(tiny_models["llama"]), "--stages",
                            str(len(cuts.split(",")) + 1), "--cuts", cuts, "-o", str(tmp_path / "p.json"))
        assert code == 2
        one_error_line(err, "--cuts")
    code, err = run_cli(capsys, "plan", "--model", str(tiny_models["llama"]), "--stages", "3", "--cuts", "4",
                        "-o", str(tmp_path / "p.json"))
    one_error_line(err, "3 stages need 2")


def test_plan_for_another_model(capsys, tiny_models, llama_plan, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"), "--model", str(tiny_models["gpt2"]))
    assert code == 2
    one_error_line(err, "plan was made for model", "gpt2")


def test_plan_file_with_bad_fields(capsys, llama_plan, tmp_path):
    data = json.loads(llama_plan.read_text())
    data["stages"][1]["units"] = [5, 99]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    (tmp_path / "p.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    code, err = run_cli(capsys, "launch", str(bad), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"))
    assert code == 2
    one_error_line(err, "bad.json", "stages[1].units")
    data["stages"][0]["device"] = "gpu0"
    bad.write_text(json.dumps(data))
    code, err = run_cli(capsys, "launch", str(bad), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"))
    one_error_line(err, "stages[0].device", "gpu0")
    data = json.loads(llama_plan.read_text())
    for count, needles in ((-1, ("stages[0].host_experts", "negative")),
                           (2, ("plan stage 0: host_experts 2", "hold 0 MoE blocks; use at most 0"))):
        data["stages"][0]["host_experts"] = count          # a dense model's stage has no experts to keep
        bad.write_text(json.dumps(data))
        code, err = run_cli(capsys, "launch", str(bad), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                            "--out", str(tmp_path / "o.jsonl"))
        assert code == 2
        one_error_line(err, *needles)


def test_prompt_longer_than_context(capsys, llama_plan, tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "long", "input_ids": [5] * 500}) + "\n")
    code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "20")
    assert code == 2
    one_error_line(err, "'long'", "500 tokens", "context of 512")
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "long", "input_ids": [5] * 400, "max_new_tokens": 200}) + "\n")
    code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "20")
    assert code == 2
    one_error_line(err, "'long'", "400 tokens", "its max_new_tokens 200", "context of 512")


@pytest.mark.parametrize("content,needles", [
    ('{"id": "a", "input_ids": [1, 2]}\n{"id": "b", "input_ids": [1, 2]\n', ("line 2", "not valid JSON")),
    ('{"id": "a", "input_ids": [1, 2]}\n\n{"id": "a", "input_ids": [3]}\n', ("line 3", "used twice")),
    ('{"id": "a", "text": "hi"}\n', ("line 1", "unknown key 'text'")),
    ('{"id": "a", "input_ids": [1, -2]}\n', ("line 1", "input_ids")),
    ('[1, 2, 3]\n', ("line 1", "expected an object")),
    ('{"id": "a", "input_ids": [1], "sampling": {"top_p": 0}}\n', ("line 1: sampling", "top_p=0", "(0, 1]")),
    ('{"id": "a", "input_ids": [1], "sampling": {"temp": 1}}\n', ("line 1: sampling", "unknown key 'temp'")),
    ('{"id": "a", "input_ids": [1], "sampling": 0.7}\n', ("line 1: sampling", "expected an object")),
    ('{"id": "a", "input_ids": [1], "max_new_tokens": 0}\n', ("line 1: max_new_tokens", "at least 1", "got 0")),
    ('{"id": "a", "input_ids": [1], "max_new_tokens": "8"}\n', ("line 1: max_new_tokens", "got '8'")),
])
def test_malformed_prompts(capsys, llama_plan, tmp_path, content, needles):
    (tmp_path / "p.jsonl").write_text(content)
    code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"))
    assert code == 2
    one_error_line(err, "p.jsonl", *needles)
    assert not (tmp_path / "o.jsonl").exists()


def test_existing_results_need_resume(capsys, llama_plan, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    (tmp_path / "o.jsonl").write_text('{"version": 1, "id": "z", "output_ids": [], "text": "", "ttft_s": 0, '
                                      '"tpot_s": 0}\n')
    code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"))
    one_error_line(err, "o.jsonl", "--resume")
    # the job's own files are read before its model (at once, not after the model's loading): the
    # same line where the model is not there at all
    for prompts, out, needles in (("p.jsonl", "o.jsonl", ["o.jsonl", "--resume"]),
                                  ("none.jsonl", "new.jsonl", ["none.jsonl", "not found"])):
        code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--model", str(tmp_path / "gone"),
                            "--prompts", str(tmp_path / prompts), "--out", str(tmp_path / out))
        assert code == 2
        one_error_line(err, *needles)


def test_a_log_dir_that_cannot_be_written(capsys, llama_plan, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    (tmp_path / "taken").write_text("a file, not a directory")
    code, err = run_cli(capsys, "launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"),
                        "--out", str(tmp_path / "o.jsonl"), "--log-dir", str(tmp_path / "taken" / "logs"))
    assert code == 2
    one_error_line(err, "--log-dir", "taken", "writable directory")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_crash_keeps_finished_results_and_resume_completes(tiny_models, llama_plan, tmp_path):
    prompts = [{"id": f"q{i}", "input_ids": [3 + i, 7, 9, 11 + i]} for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "hpipe.cli", "launch", str(llama_plan), "--local", "--prompts",
           str(tmp_path / "p.jsonl"), "--out", str(out), "--max-new-tokens", "200", "--max-batch", "1", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
        time.sleep(0.05)
    assert out.exists(), proc.communicate()
    workers = subprocess.run(["pgrep", "-f", f"hpipe.runtime.worker --plan {llama_plan}"], capture_output=True,
                             text=True).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[-1]), signal.SIGKILL)
    t_kill = time.time()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.time() - t_kill < 10
    errors = [l for l in stderr.splitlines() if l.startswith("hpipe: error:")]
    assert len(errors) == 1 and "stage 1" in errors[0] and "results were written" in errors[0], stderr
    kept = [json.loads(l) for l in out.read_text().splitlines()]
    assert 2 <= len(kept) < len(prompts)
    assert all(set(r) >= {"id", "output_ids", "text", "ttft_s", "tpot_s"} for r in kept)
    assert not subprocess.run(["pgrep", "-f", f"hpipe.runtime.worker --plan {llama_plan}"],
                              capture_output=True).stdout, "workers left running"
    # resume: only the missing ids run, and the file ends with every prompt once
    assert main(["launch", str(llama_plan), "--local", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out),
                 "--max-new-tokens", "200", "--max-batch", "1", "--resume", "--quiet"]) == 0
    final = [json.loads(l) for l in out.read_text().splitlines()]
    assert sorted(r["id"] for r in final) == sorted(p["id"] for p in prompts)
    assert final[:len(kept)] == kept


def test_the_stage_that_died_is_blamed_not_the_neighbours_it_took_down():
    """A stage killed mid-run makes its neighbours fail too (they report a lost peer), and their
    exits may be seen first: the launcher's line names the stage whose failure is its own."""
    from hpipe.launcher.jobs import root_failure
    assert root_failure({0: "exit code 2", 2: "exit code 2", 1: "killed by SIGKILL"}, {0, 2}) == (1, "killed by SIGKILL")
    assert root_failure({2: "exit code 2", 0: "exit code 1"}, {2}) == (0, "exit code 1")
    assert root_failure({0: "exit code 2"}, {0}) == (0, "exit code 2")      # only peers: the first seen


def test_a_failures_last_log_lines_are_the_stages_own_not_library_warnings(tmp_path):
    """Python's own warning text (its file:line header and the source line under it) stays out of
    the failure's "last log lines"; --log-dir keeps every line."""
    import warnings

    from hpipe.launcher.jobs import StageLogs
    warning = warnings.formatwarning("`past_key_values` is deprecated", FutureWarning, "/x/deprecation.py", 171,
                                     "    return func(*args, **kwargs)").rstrip("\n").split("\n")
    logs = StageLogs(2, str(tmp_path))
    for line in ["loading", *warning, "Traceback (most recent call last):", "  File \"x.py\", line 3",
                 "ValueError: boom", *warning]:
        logs.add(1, line)
    logs.close()
    assert len(warning) == 2 and logs.last(1) == ('loading | Traceback (most recent call last): | '
                                                  '  File "x.py", line 3 | ValueError: boom')
    assert (tmp_path / "stage-1.log").read_text().count("FutureWarning") == 2
    assert logs.last(0) == "" and (tmp_path / "stage-0.log").read_text() == ""


@pytest.mark.parametrize("devices,source,needle", [
    (("cpu", "cuda:0"), "host-pool", "mixes CPU and GPU replicas"),
    (("cuda:0", "cuda:0"), "shared-mapping", "GPU replicas on weights mapped in host memory"),
    (("cpu", "cpu"), "peer", "reads WaS weights from a peer GPU, but its replicas are CPUs")])
def test_sidp_groups_that_cannot_share_their_weights(capsys, tiny_models, tmp_path, devices, source, needle):
    """A SiDP group mixing CPU and GPU replicas, GPU replicas on a host mapping, CPU replicas
    reading a peer GPU: one line naming the group and what to set, before any replica starts."""
    import dataclasses

    from hpipe import formats

    one = tmp_path / "one.json"
    assert main(["plan", "--model", str(tiny_models["llama"]), "--stages", "1", "-o", str(one)]) == 0
    base = formats.load_plan(one)
    group = formats.SidpGroupPlan("local", (0, 1), tuple(b % 2 for b in range(base.model.blocks)), 0, source)
    group = dataclasses.replace(group, slots=group.slots_needed(0))
    plan = tmp_path / "sidp.json"
    formats.write_plan(dataclasses.replace(base, mode="sidp", sidp=(group,), stages=tuple(
        dataclasses.replace(base.stages[0], device=d) for d in devices)), plan)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": [5, 6, 7]}) + "\n")
    code, err = run_cli(capsys, "launch", str(plan), "--local", "--prompts", str(prompts), "--out",
                        str(tmp_path / "o.jsonl"))
    assert code == 2
    one_error_line(err, "sidp[0]", needle)
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()


def test_a_compile_that_fails_leaves_the_run_eager_with_one_line(tiny_models, tmp_path):
    """`--compile on` on a machine without a working C++ compiler (inductor's, named by $CXX) and no
    cached graphs: one line says the decode runs eagerly and why, and the job gives the tokens of
    `--compile off`."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tiny_models["llama"]), "--stages", "2", "-o", str(plan)]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": list(range(3, 40))}) + "\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    outputs = {}
    for setting in ("on", "off"):
        out = tmp_path / f"{setting}.jsonl"
        done = subprocess.run([sys.executable, "-m", "hpipe", "launch", str(plan), "--local", "--prompts", str(prompts),
                               "--out", str(out), "--max-new-tokens", "8", "--compile", setting],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        failed = [line for line in done.stderr.splitlines() if "its compile failed" in line]
        assert len(failed) == (2 if setting == "on" else 0), done.stderr    # one line per stage
        assert all("No working C++ compiler" in line for line in failed), failed
        outputs[setting] = json.loads(out.read_text().splitlines()[0])["output_ids"]
    assert outputs["on"] == outputs["off"]


def test_an_inductor_cache_path_with_a_space_is_refused_before_any_compile(tiny_models, tmp_path, monkeypatch):
    """Inductor's compiler command line splits a cache path at its space (g++: "input file ... is the
    same as output file"): a stage says so in one line, naming the path and what to set, before a
    compile spends its minute, and runs eagerly."""
    from hpipe import models
    from hpipe.runtime import graphs, stage
    from hpipe.runtime.stage import StageRunner

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "my cache"))
    path = tiny_models["llama"]
    config = models.load_config(path)
    runner = StageRunner(path, config, range(models.num_units(config)), compile="on", kv_dtype="float32")
    runner.kv.allocate(16)
    compiled, lines = graphs.compiled(), []
    stage.warm_up(runner, 16, lines.append)
    assert runner.decode_halves is runner.eager and graphs.compiled() == compiled
    assert len(lines) == 1 and "its compile failed" in lines[0] and "my cache" in lines[0], lines
    assert "has a space" in lines[0] and "HPIPE_CACHE" in lines[0], lines


@pytest.mark.parametrize("argv, needles", [
    (["warmup", "--plan", "plan.json", "--threads", "2"], ("--plan sets --quantize", "leave them out")),
    (["warmup", "--cluster", "c.toml", "--threads", "2"], ("--threads is each host's with --cluster",)),
    (["warmup", "--kv-dtype", "int8"], ("--kv-dtype 'int8'", "float16")),
    (["warmup", "--units", "0-62"], ("--units '0-62'", "B < 62", "--units 0-20,21-61")),
    (["warmup", "--units", "5-3,x"], ("'5-3' is not A-B",)),
    (["warmup", "--cluster", "c.toml", "--units", "0-3"], ("--units is each host's with --cluster",)),
    (["warmup", "--speculative", "ngram:99"], ("--speculative 'ngram:99'", "K must be"))])
def test_warmup_options_that_do_not_go_together_are_one_line(capsys, argv, needles):
    code, err = run_cli(capsys, *argv)
    assert code != 0
    one_error_line(err, *needles)
