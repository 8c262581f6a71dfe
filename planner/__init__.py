"""hpipe's planner: turns a model (and, later, a profile) into a plan file.

Data flows one way: profiler -> profile file -> planner -> plan file -> launcher -> runtime.
This first version makes uniform plans and hand-made ones (`--cuts`, `--slices`); the DP planner
(HPipe's Algorithms 1 and 2) extends the same entry point.
"""

from planner.uniform import make_plan, uniform_cuts

__all__ = ["make_plan", "uniform_cuts"]
