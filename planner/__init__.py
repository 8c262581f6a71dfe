"""hpipe's planner: turns a model and a profile into a plan file.

Data flows one way: profiler -> profile file -> planner -> plan file -> launcher -> runtime.
The algorithms are pure functions (numpy in, result objects out); see planner/README.md.
"""

from hpipe.planner.partition import Infeasible, Partition, partition_layers
from hpipe.planner.simulate import Timeline, simulate
from hpipe.planner.slicing import Slicing, slice_sequence
from hpipe.planner.uniform import make_plan, uniform_cuts

__all__ = ["Infeasible", "Partition", "Slicing", "Timeline", "make_plan", "partition_layers", "simulate",
           "slice_sequence", "uniform_cuts"]
