"""A stage's compiled decode graphs kept as code on this host.

Each graph function a stage calls (`stage.graph_plan`: a run of whole blocks, a block, a cut block's
half) is compiled ahead of time (`torch.compile(...).aot_compile`: dynamo's trace and inductor's
kernels at once) for every kind of step that needs a graph of its own (`stage.decode_shapes`), and
the result is saved in a directory of its own under inductor's cache (`graph_dir`). A later start
loads the files: about 0.01 s a graph after the process's first, which pays ~1.5 s for inductor's
set-up, where dynamo re-traced every graph from its cache (2-3 s each: a stage of blocks and cut
halves spent 10-15 s of its start re-tracing, SmolLM2's one-graph stage 7.5 s).

A call takes the first of its function's graphs whose guards pass (dynamo's own, less those on the
modules (as `torch.compile` ran them here before: a block's every parameter checked on every call
cost more than its norms) and those a file cannot keep; `_kept_guards`): tensors' dtypes and ranks,
which sizes are 1, the relations between sizes the trace assumed, the grad mode. The graph used
last goes first: a decode step is mostly the kind of the one before it. A step no graph serves
compiles one, saved for every later start. The other stages of this host wait on the directory's
lock while one compiles and then load its graph: stages of the same layout starting together under
`--compile on` compiled the same graphs at once, one copy each (a 2-stage tiny model: 6 compiles of
~9 s on two cores, where 3 do).

A graph directory is named by everything its graphs bake in (`graph_dir`'s text) and by the code
they were traced from: torch's and transformers' versions and the hash of hpipe's own sources, so
that a changed line of hpipe never runs a graph traced from the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import threading
from functools import cache
from pathlib import Path

import torch

__all__ = ["Graph", "compiled", "graph_dir", "remember_vector_checks", "source_hash"]

_COMPILED = [0]              # graphs this process compiled (tests: a warm start compiles none)
_LOCK = threading.Lock()


def compiled() -> int:
    """How many graphs this process has compiled (not loaded) so far."""
    return _COMPILED[0]


@cache
def source_hash() -> str:
    """The hash of hpipe's own source files (Python and the kernels' C): what the graphs trace."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h", ".cpp")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def graph_dir(text: str) -> Path:
    """The directory of the graphs whose function, modules and settings `text` describes."""
    import transformers

    from hpipe.config import inductor_cache_dir

    full = repr((text, torch.__version__, transformers.__version__, source_hash()))
    return inductor_cache_dir() / "hpipe-graphs" / hashlib.sha256(full.encode()).hexdigest()[:32]


@cache
def remember_vector_checks() -> None:
    """Inductor's checks that this host's C++ compiler builds, and a process loads, vector code of
    each set the CPU has (AVX2, AVX-512, its VNNI and BF16 parts, ...), made once a host rather than
    once a process. Inductor makes them in every process that compiles or loads a CPU graph: a
    compile of a probe (kept in its cache) and, each, a Python process that loads the result (3 of
    them, ~0.7 s of CPU, on an AVX-512 host: the test suite's stage starts ran 216, 48 s). An answer
    holds while the compiler and torch stay: the first check of a probe leaves it in inductor's cache
    (`hpipe-vec-isa/`), a later process reads it. Inductor's settings are untouched, so are its cache
    keys; where inductor no longer has the method, its own checks run."""
    from torch._inductor import cpp_builder, cpu_vec_isa

    from hpipe.config import inductor_cache_dir

    check_build = getattr(cpu_vec_isa.VecISA, "check_build", None)
    if check_build is None or getattr(check_build, "remembered", False):
        return
    try:
        compiler = Path(shutil.which(cpp_builder.get_cpp_compiler()) or "").resolve()
        identity = (torch.__version__, str(compiler), compiler.stat().st_mtime_ns, platform.machine(),
                    cpu_vec_isa.x86_isa_checker())
    except Exception:  # noqa: BLE001 - no compiler found: inductor says so itself when it compiles
        return

    def remembered(isa, code: str) -> bool:
        text = repr((identity, str(isa), isa.build_arch_flags(), code))
        mark = inductor_cache_dir() / "hpipe-vec-isa" / hashlib.sha256(text.encode()).hexdigest()[:24]
        with contextlib.suppress(OSError):
            known = mark.read_text().split("\n", 1)[0]
            if known in ("good", "bad"):
                return known == "good"
        good = check_build(isa, code)
        with contextlib.suppress(OSError):      # a cache we cannot write: the next process checks again
            mark.parent.mkdir(parents=True, exist_ok=True)
            tmp = mark.with_name(f".{mark.name}.{os.getpid()}")
            tmp.write_text(f"{'good' if good else 'bad'}\n{text}\n")
            os.replace(tmp, mark)
        return good

    remembered.remembered = True
    cpu_vec_isa.VecISA.check_build = remembered


def _kept_guards(entries) -> list[bool]:
    """Dynamo's guards a saved graph checks: not the modules' (`skip_guard_on_all_nn_modules_unsafe`:
    blocks share a graph only where `stage._signature` agrees), not globals' (the directory's name
    holds what the code reads: hpipe's sources, the settings) and none a file cannot keep."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    on_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [keep and not (g.is_global or g.guard_type in unsaved) for keep, g in zip(on_modules, entries)]


@contextlib.contextmanager
def _locked(directory: Path):
    """The directory's lock, held across processes (released by the kernel if its holder dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class Graph:
    """One graph function's compiled graphs on this host: those saved in `directory`, loaded now,
    and those its calls compile (saved there)."""

    def __init__(self, fn, directory: Path, settings: dict[str, object], tracing):
        """settings: dynamo's (`stage.DYNAMO_SETTINGS`), set before a trace; tracing(args): the
        context a trace of these arguments runs in (the KV pool's marks)."""
        remember_vector_checks()
        self.fn, self.dir, self.settings, self.tracing = fn, directory, settings, tracing
        self.graphs: list = []
        self.seen: set[str] = set()
        self._load_new()

    def _load_new(self) -> None:
        """The directory's graphs not loaded yet (another stage of this host may have saved some)."""
        if not self.dir.is_dir():
            return
        for path in sorted(self.dir.glob("*.graph")):
            if path.name in self.seen:
                continue
            self.seen.add(path.name)
            try:
                # built under inference mode, as the steps run: a guard's expected dispatch keys are
                # the tensor's and the thread's (outside it, ADInplaceOrView, which no step's has)
                with open(path, "rb") as f, torch.inference_mode():
                    graph = torch.compiler.load_compiled_function(f)
            except Exception:  # noqa: BLE001 - a file cut short, or unreadable: compiled again if needed
                continue
            graph.disable_guard_check()          # `__call__` checks them, once a call
            self.graphs.append(graph)

    def __call__(self, *args):
        graph = self._serving(args)
        if graph is None:
            # one trace at a time in a process (dynamo's state), one compile at a time in a directory
            with _LOCK, _locked(self.dir):
                self._load_new()
                graph = self._serving(args) or self._compile(args)
        return graph(*args)

    def _serving(self, args):
        for i, graph in enumerate(self.graphs):
            if graph.guard_check(*args):
                if i:
                    self.graphs.insert(0, self.graphs.pop(i))
                return graph
        return None

    def _compile(self, args):
        for name, value in self.settings.items():
            setattr(torch._dynamo.config, name, value)
        options = {"guard_filter_fn": _kept_guards, "cpp_wrapper": True}
        with self.tracing(args):
            graph = torch.compile(self.fn, fullgraph=True, dynamic=True, options=options).aot_compile((args, {}))
        data = type(graph).serialize(graph).serialized_data
        name = hashlib.sha256(data).hexdigest()[:24] + ".graph"
        tmp = self.dir / f".{name}.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / name)          # whole or absent, for a stage loading beside us
        self.seen.add(name)
        graph.disable_guard_check()
        self.graphs.insert(0, graph)
        _COMPILED[0] += 1
        return graph
