"""The layout is the architecture: floors of components, imports only sideways or down, no cycles,
no other component's private names, and one import name in the installed distribution.

FLOORS is the one table of the layout; a new module must find its place in it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# where each folder of the repository lands in the `hpipe` package (pyproject's package-dir)
SOURCE_DIRS = {"hpipe": "hpipe", "planner": "hpipe.planner", "profiler": "hpipe.profiler",
               "launcher": "hpipe.launcher"}

FLOORS = {
    0: ["hpipe", "hpipe.errors", "hpipe.formats", "hpipe.models", "hpipe.reports", "hpipe.request", "hpipe.memory",
        "hpipe.net", "hpipe.grid", "hpipe.lifeline"],                                    # ground: errors, formats, models, reports
    1: ["hpipe.sampling", "hpipe.runtime", "hpipe.ssh"],               # what runs on a host
    2: ["hpipe.profiler", "hpipe.planner", "hpipe.launcher"],          # the three commands' machinery
    3: ["hpipe.cli", "hpipe.demo", "hpipe.__main__"],                  # the top: nothing imports these
}
ENTRY_POINTS = {("hpipe.__main__", "hpipe.cli"),                     # `python -m hpipe` runs the CLI
                ("hpipe.cli", "hpipe.demo")}                          # `hpipe demo` runs the demo


def modules(source_dirs: dict[str, str], root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file under the source folders."""
    out = {}
    for folder, package in source_dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def component_of(module: str, floors: dict[int, list[str]]) -> str | None:
    best = None
    for names in floors.values():
        for c in names:
            if (module == c or module.startswith(c + ".")) and (best is None or len(c) > len(best)):
                best = c
    return best


def imports_of(module: str, path: Path, known: set[str]):
    """(imported module, imported names, line) for every import of an hpipe module in the file,
    at any depth (an import inside a function counts like any other)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hpipe":
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hpipe":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            for sub in submodules:
                yield sub, [], node.lineno
            rest = [n for n in names if f"{target}.{n}" not in known]
            if rest or not submodules:
                yield target, rest, node.lineno


def violations(source_dirs: dict[str, str], root: Path, floors: dict[int, list[str]]) -> list[str]:
    floor_of = {c: f for f, names in floors.items() for c in names}
    top = max(floors)
    mods = modules(source_dirs, root)
    problems, edges = [], set()
    for mod, path in mods.items():
        src = component_of(mod, floors)
        if src is None:
            problems.append(f"{path.relative_to(root)}: module {mod} has no place in FLOORS")
            continue
        for target, names, line in imports_of(mod, path, set(mods)):
            dst = component_of(target, floors)
            where = f"{path.relative_to(root)}:{line}"
            if dst is None:
                problems.append(f"{where}: imports {target}, which has no place in FLOORS")
                continue
            if dst == src:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{where}: {src} imports private names {private} of {dst}")
            if (src, dst) in ENTRY_POINTS:
                continue
            if floor_of[dst] == top:
                problems.append(f"{where}: {src} imports {dst}, a top-floor module that nothing imports")
            elif floor_of[dst] > floor_of[src]:
                problems.append(f"{where}: upward import: {src} (floor {floor_of[src]}) imports {dst} "
                                f"(floor {floor_of[dst]})")
            else:
                edges.add((src, dst))   # sideways or down: allowed unless it closes a cycle
    problems += [f"import cycle between components: {' -> '.join(c)}" for c in cycles(edges)]
    return problems


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_repository_keeps_its_floors():
    assert violations(SOURCE_DIRS, ROOT, FLOORS) == []


def test_every_package_says_what_it_offers():
    for folder, package in SOURCE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            tree = ast.parse(init.read_text())
            names = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
            assert "__all__" in names, f"{init.relative_to(ROOT)} has no __all__"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


def test_the_check_catches_upward_imports_cycles_and_private_names(tmp_path):
    """The check itself can fail: a small tree with each kind of fault."""
    _write(tmp_path, {
        "hpipe/__init__.py": "",
        "hpipe/formats.py": "def helper():\n    from hpipe.planner import make  # a lazy upward import\n",
        "hpipe/cli.py": "from hpipe.planner import make\n",
        "hpipe/runtime/__init__.py": "from hpipe.ssh import go\n",
        "hpipe/ssh/__init__.py": "from hpipe.runtime import run\n",
        "planner/__init__.py": "from hpipe.runtime.stage import _private\nfrom hpipe import cli\n",
        "launcher/__init__.py": "from ..planner import make\n",
    })
    found = violations({"hpipe": "hpipe", "planner": "hpipe.planner", "launcher": "hpipe.launcher"}, tmp_path, FLOORS)
    text = "\n".join(found)
    assert "upward import: hpipe.formats (floor 0) imports hpipe.planner (floor 2)" in text
    assert "import cycle between components: hpipe.runtime -> hpipe.ssh -> hpipe.runtime" in text
    assert "hpipe.planner imports private names ['_private'] of hpipe.runtime" in text
    assert "hpipe.planner imports hpipe.cli, a top-floor module" in text
    assert len(found) == 4, found   # the relative import launcher -> planner is sideways and allowed


@pytest.mark.slow
def test_the_wheel_holds_one_import_name(tmp_path):
    src = tmp_path / "src"   # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "bench",
                                                             "profiles", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("hpipe-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["hpipe"]
    assert {n.split("/")[0] for n in names} == {"hpipe", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                + ".dist-info"}
    for sub in ("planner/profiled.py", "profiler/measure.py", "launcher/jobs.py", "ssh/remote_wrapper.py",
                "runtime/worker.py"):
        assert f"hpipe/{sub}" in names
