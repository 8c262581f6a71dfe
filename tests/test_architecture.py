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
    0: ["hpipe", "hpipe.errors", "hpipe.config", "hpipe.formats", "hpipe.prediction", "hpipe.models", "hpipe.cpu_kernels", "hpipe.quant", "hpipe.quantized", "hpipe.experts", "hpipe.reports", "hpipe.protocol",
        "hpipe.request", "hpipe.memory",
        "hpipe.net", "hpipe.grid", "hpipe.lifeline", "hpipe.heap"],                                    # ground: errors, formats, models, reports
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


def module_cycles(source_dirs: dict[str, str], root: Path) -> list[list[str]]:
    """Cycles between modules, imports inside functions included (inside a component too: the
    floors check sees components only)."""
    mods = modules(source_dirs, root)
    return cycles({(m, t) for m, path in mods.items() for t, _, _ in imports_of(m, path, set(mods))
                   if t in mods and t != m})


def test_no_module_needs_one_that_needs_it_back():
    """Two modules that import each other, at any depth, are one concept in two files or a concept
    in the wrong one (`runtime_costs` ran launches from inside the launcher's run checks)."""
    assert module_cycles(SOURCE_DIRS, ROOT) == []


def test_the_module_check_catches_a_cycle_through_a_function(tmp_path):
    _write(tmp_path, {"launcher/__init__.py": "", "launcher/jobs.py": "from hpipe.launcher.terms import read\n",
                      "launcher/terms.py": "def measure():\n    from hpipe.launcher import jobs\n"})
    assert module_cycles({"launcher": "hpipe.launcher"}, tmp_path) == [
        ["hpipe.launcher.jobs", "hpipe.launcher.terms", "hpipe.launcher.jobs"]]


def class_names(source_dirs: dict[str, str], root: Path) -> dict[str, list[str]]:
    """Class name -> the modules that define one of that name (at any depth)."""
    out: dict[str, list[str]] = {}
    for mod, path in modules(source_dirs, root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and mod not in out.setdefault(node.name, []):
                out[node.name].append(mod)
    return out


def test_one_name_one_class():
    """A class name is defined in one module of the packages: two classes of one name are two
    concepts under one word (three `Timeline`s were: the simulated one, a stage's measured intervals
    and the report of them)."""
    assert {n: m for n, m in class_names(SOURCE_DIRS, ROOT).items() if len(m) > 1} == {}


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


# ---------------------------------------------------------------------------------- one definition per default
def literal_setting_defaults(source_dirs: dict[str, str], root: Path, settings: dict) -> list[str]:
    """Every place outside hpipe/config.py that declares a runtime setting's default again: a
    function parameter or a class field named after a setting with a literal default, or a CLI
    option (typer / argparse) for a setting's flag with a literal default."""
    flags = {s.flag: name for name, s in settings.items()}
    found = []
    for mod, path in modules(source_dirs, root).items():
        if mod == "hpipe.config":
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = lambda node: f"{path.relative_to(root)}:{node.lineno}"   # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults)) + \
                    [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                found += [f"{where(d)}: parameter {k.arg}={ast.unparse(d)}" for k, d in pairs
                          if k.arg in settings and isinstance(d, ast.Constant) and d.value is not None]
            elif isinstance(node, ast.ClassDef):
                found += [f"{where(f)}: field {f.target.id} = {ast.unparse(f.value)}" for f in node.body
                          if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                          and f.target.id in settings and isinstance(f.value, ast.Constant)
                          and f.value.value is not None]
            elif isinstance(node, ast.Call):
                strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                flag = next((s for s in strings if s in flags), None)
                if flag is None:
                    continue
                literal = [a for a in node.args[:1] if isinstance(a, ast.Constant) and not isinstance(a.value, str)]
                literal += [k.value for k in node.keywords if k.arg == "default" and isinstance(k.value, ast.Constant)]
                found += [f"{where(node)}: option {flag} with default {ast.unparse(d)}" for d in literal]
    return found


def test_every_runtime_default_is_declared_once():
    """RuntimeConfig holds every runtime setting's default: nothing else in the code declares one
    again, and launch and serve offer every setting under its flag with the config's default."""
    import typer

    from hpipe.cli import app
    from hpipe.config import DEFAULTS, SETTINGS

    assert literal_setting_defaults(SOURCE_DIRS, ROOT, SETTINGS) == []
    group = typer.main.get_command(app)
    for command in ("launch", "serve"):
        options = {opt: p for p in group.commands[command].params for opt in p.opts if opt.startswith("--")}
        for name, s in SETTINGS.items():
            assert s.flag in options, f"hpipe {command} has no {s.flag}"
            default = getattr(DEFAULTS, name)
            assert options[s.flag].default == (not default if s.negated else default), (command, s.flag)


def test_the_defaults_check_can_fail(tmp_path):
    from hpipe.config import SETTINGS
    _write(tmp_path, {
        "hpipe/__init__.py": "",
        "hpipe/a.py": "def f(page_size: int = 16, other=3):\n    pass\n",
        "hpipe/b.py": "class C:\n    max_batch: int = 16\n",
        "hpipe/c.py": "import typer\nX = typer.Option(8, '--iterations')\n",
        "hpipe/d.py": "def g(p):\n    p.add_argument('--kv-pages', type=int, default=0)\n",
        "hpipe/e.py": "from hpipe.config import DEFAULTS\ndef f(page_size: int = DEFAULTS.page_size):\n    pass\n",
    })
    found = literal_setting_defaults({"hpipe": "hpipe"}, tmp_path, SETTINGS)
    assert len(found) == 4 and all(f.split(":")[0] in ("hpipe/a.py", "hpipe/b.py", "hpipe/c.py", "hpipe/d.py")
                                   for f in found), found


# ---------------------------------------------------------------------------------- torch-free modules
TORCH_FREE = ["hpipe.config", "hpipe.protocol", "hpipe.request", "hpipe.runtime.pages", "hpipe.runtime.sequence",
              "hpipe.runtime.schedule", "hpipe.runtime.scheduler"]


def torch_importers(source_dirs: dict[str, str], root: Path, names: list[str]) -> list[str]:
    """Of `names`, those that import torch, directly or through the hpipe modules they import
    (package __init__ files aside: the modules' own imports)."""
    mods = modules(source_dirs, root)

    def imports(mod):
        tree = ast.parse(mods[mod].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)

    bad = []
    for name in names:
        seen, todo = set(), [name]
        while todo:
            mod = todo.pop()
            if mod in seen:
                continue
            seen.add(mod)
            for target in imports(mod):
                if target.split(".")[0] == "torch":
                    bad.append(f"{name} imports torch (through {mod})")
                elif target in mods and not mods[target].name == "__init__.py":
                    todo.append(target)
    return bad


def test_the_scheduler_and_the_schedule_know_nothing_of_torch(tmp_path):
    assert torch_importers(SOURCE_DIRS, ROOT, TORCH_FREE) == []
    _write(tmp_path, {"hpipe/__init__.py": "", "hpipe/a.py": "from hpipe.b import x\n", "hpipe/b.py": "import torch\n"})
    assert torch_importers({"hpipe": "hpipe"}, tmp_path, ["hpipe.a"]) == ["hpipe.a imports torch (through hpipe.b)"]


# ---------------------------------------------------------------------------------- one seam
def test_the_workers_reports_and_ops_are_written_in_one_module():
    """The runtime's reports and the ops into stage 0 are `hpipe.protocol` records: no other module
    writes one of their kinds by hand (`emit("result", ...)`) or spells an op's dict."""
    from hpipe.protocol import REPORTS
    found = []
    for mod, path in modules(SOURCE_DIRS, ROOT).items():
        if mod in ("hpipe.protocol", "hpipe.reports"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "emit" \
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in REPORTS \
                    and node.args[0].value != "error":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: emit({node.args[0].value!r})")
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "op" for k in node.keys):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: an op spelled by hand")
    assert found == []


# No function of the packages is over MAX_FUNCTION_LINES (2026-11-29: the last of the 21 that
# were, split). LONG_FUNCTIONS is where one would be allowed, at most its length then: keep it empty.
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS: dict[str, int] = {}


def function_lengths(source_dirs: dict[str, str], root: Path) -> dict[str, int]:
    """'folder/file.py:name' -> lines, for every function (methods and nested ones too)."""
    out = {}
    for folder in source_dirs:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{path.relative_to(root)}:{node.name}"
                    out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def test_no_function_grows_past_sixty_lines():
    long = {k: n for k, n in function_lengths(SOURCE_DIRS, ROOT).items() if n > MAX_FUNCTION_LINES}
    grown = {k: (n, LONG_FUNCTIONS.get(k, MAX_FUNCTION_LINES)) for k, n in long.items()
             if n > LONG_FUNCTIONS.get(k, MAX_FUNCTION_LINES)}
    assert grown == {}, f"over {MAX_FUNCTION_LINES} lines or longer than before (lines, allowed): {grown}"
    shorter = set(LONG_FUNCTIONS) - set(long)
    assert not shorter, f"within {MAX_FUNCTION_LINES} lines now: take them out of LONG_FUNCTIONS: {shorter}"


def redefined(source_dirs: dict[str, str], root: Path) -> list[str]:
    """'folder/file.py:Class.name' for every function a module or class defines twice: the second
    silently replaces the first (a property's setter and an overload's stubs aside)."""
    out = []
    for folder in source_dirs:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
                seen = set()
                for node in scope.body:
                    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    if any((isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter"))
                           or (isinstance(d, ast.Name) and d.id == "overload") for d in node.decorator_list):
                        continue
                    if node.name in seen:
                        owner = getattr(scope, "name", None)
                        out.append(f"{path.relative_to(root)}:{owner + '.' if owner else ''}{node.name}")
                    seen.add(node.name)
    return out


def test_no_function_is_defined_twice_in_one_scope(tmp_path):
    """A method written again under a name its class already has replaces the first without a word
    (a refactor gave the scheduler a second `_on_grid`; its tests failed far from the cause)."""
    assert redefined(SOURCE_DIRS, ROOT) == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("class A:\n    def f(self):\n        pass\n\n    def f(self, x):\n"
                                           "        pass\n\n    @property\n    def p(self):\n        pass\n\n"
                                           "    @p.setter\n    def p(self, v):\n        pass\n")
    assert redefined({"pkg": "pkg"}, tmp_path) == ["pkg/m.py:A.f"]
