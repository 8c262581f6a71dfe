"""The README's commands table is the CLI's: a row for every command, and every option a row or the
runtime-settings table names is one that command takes (`hpipe COMMAND --help`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from hpipe import cli
from serving import start_serve

README = Path(__file__).resolve().parent.parent / "README.md"


def commands() -> dict[str, set[str]]:
    """'hpipe plan', 'hpipe cluster check', ... -> the options each takes."""
    out = {}
    for name, command in typer.main.get_command(cli.app).commands.items():
        for sub, leaf in (getattr(command, "commands", None) or {None: command}).items():
            out[" ".join(x for x in ("hpipe", name, sub) if x)] = {o for p in leaf.params
                                                                   for o in (*p.opts, *p.secondary_opts)}
    return out


def table(heading: str) -> list[list[str]]:
    """The rows of the first table after `heading`, as cells."""
    text = README.read_text().split(heading, 1)[1]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    block = []
    for line in text.splitlines()[text.splitlines().index(rows[0]):]:
        if not line.startswith("|"):
            break
        block.append([c.strip() for c in line.strip("|").split("|")])
    return block[2:]


def test_the_readme_fits_a_newcomers_five_minutes():
    assert len(README.read_text().splitlines()) <= 300


def test_every_command_has_a_row_and_every_option_named_is_the_commands():
    cli_commands = commands()
    rows = {re.search(r"`(hpipe [a-z ]+)`", r[0]).group(1): r for r in table("## Commands")}
    assert set(rows) == set(cli_commands), set(rows) ^ set(cli_commands)
    for name, row in rows.items():
        named = set(re.findall(r"(--[a-z][a-z-]*)", " ".join(row[2:])))
        assert named <= cli_commands[name], (name, named - cli_commands[name])
    settings = {o for r in table("Runtime settings") for o in re.findall(r"(--[a-z][a-z-]*)", r[0] + r[2])}
    for name in ("hpipe launch", "hpipe serve"):
        assert settings <= cli_commands[name], (name, settings - cli_commands[name])


def code_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of the README, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), re.M | re.S)


def commands_of(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def needs_no_cluster(block: str) -> bool:
    """A block to run here: not the set-up one (`make demo`, `make test`: CI runs those itself) nor
    one for hosts of one's own (`cluster.toml`: tests/test_ssh.py runs those commands on emulated
    hosts)."""
    lines = commands_of(block)
    return not any(line.startswith("make ") or "cluster.toml" in line.split("#")[0] for line in lines)


@pytest.mark.slow
def test_the_readmes_commands_run_as_written(tmp_path):
    """Every shell and Python block of the README that needs no cluster of one's own, run in order
    as written (bash -e), in a fresh directory that has the repository's profiles/examples: the
    quick start (plan, prompts, launch), serving (a warmup of its plan, then the server up while
    the curl and the Python client ask it, then Ctrl-C), planning from measurements and the More
    block. A block's
    `hpipe serve` line is its last: it runs in the background until the server answers."""
    blocks = code_blocks()
    runs = [(lang, text) for lang, text in blocks if lang in ("sh", "python") and needs_no_cluster(text)]
    assert len(blocks) - len(runs) == 2 and len(runs) >= 6, [t[:60] for _, t in blocks]
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "examples").symlink_to(README.parent / "profiles" / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    server = None
    try:
        for lang, text in runs:
            serve = [line for line in commands_of(text) if line.startswith("hpipe serve")]
            assert not serve or commands_of(text)[-1] == serve[0], "an `hpipe serve` line ends its block"
            asks = ":8000" in text                # the curl and the Python client ask the server before them
            if server is not None and (serve or not asks):
                stop(server)
                server = None
            script = text.replace(serve[0], "") if serve else text
            cmd = [sys.executable, "-c", script] if lang == "python" else ["bash", "-e", "-o", "pipefail", "-c", script]
            r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0 and "Traceback" not in r.stderr, f"{text}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            assert r.stdout.strip() or not asks, f"{text}: no answer"
            if serve:
                log = tmp_path / f"serve-{len(list(tmp_path.glob('serve-*')))}.log"
                server = start_serve(["bash", "-c", f"exec {serve[0].split('#')[0]}"], log, 8000, within=300,
                                     cwd=tmp_path, env=env)[0], log
        assert (tmp_path / "results.jsonl").read_text().count("\n") == 2       # the two prompts, answered
    finally:
        if server is not None:
            stop(server)


def stop(server: tuple[subprocess.Popen, Path]) -> None:
    proc, log = server
    os.killpg(proc.pid, signal.SIGINT)                   # Ctrl-C, as the README says
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"hpipe serve did not stop on Ctrl-C: {log.read_text()[-3000:]}") from None
    assert proc.returncode in (0, 130) and "Traceback" not in log.read_text(), log.read_text()[-3000:]
