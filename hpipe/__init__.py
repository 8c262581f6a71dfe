"""hpipe: plan and launch pipeline-parallel LLM inference on mixed commodity hardware.

The package, floor by floor (each imports only from its own floor or below; see
tests/test_architecture.py):
- ground: `errors`, `formats` (the file formats), `models` (models and their units), `request`
  (one request and its sampling parameters), `memory` (the one memory model), `reports` (the
  workers' report lines), `grid` (a profile table's fitted cost), `net`;
- `runtime` (the stage workers), `sampling`, `ssh` (the SSH layer);
- `profiler`, `planner`, `launcher` (from the repository's top-level folders of those names);
- top: `cli` and `demo`, which nothing imports.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
