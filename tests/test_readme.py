"""The README's commands table is the CLI's: a row for every command, and every option a row or the
runtime-settings table names is one that command takes (`hpipe COMMAND --help`)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from hpipe import cli

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
