"""hpipe's planner: turns a model and a profile into a plan file.

Data flows one way: profiler -> profile file -> planner -> plan file -> launcher -> runtime.
The algorithms are pure functions (numpy in, result objects out); see planner/README.md.

    result = plan_from_profile(profile, path, name, config, devices, seq_len)   # a PlanResult
    result.plan                     # the plan file's object (hpipe.formats.Plan)
    result.timeline, result.bound   # the simulated pipeline and the lower bound it is held against
    compare(result, granularity)    # the paper's baselines under the same cost model
    plan_sidp(profile, path, name, config, devices, seq_len, ...)   # SiDP: one replica per device (sidp.py)
"""

from hpipe.planner.bound import LowerBound, gap, lower_bound
from hpipe.planner.compare import compare
from hpipe.planner.partition import Infeasible, Partition, partition_layers
from hpipe.planner.profiled import (MARGIN, OBJECTIVES, CostModel, PlanResult, check_profile_matches, decode_prediction,
                                    decode_workload, objective_seconds, plan_from_profile, predict, slice_time_table,
                                    workload)
from hpipe.planner.request import PlanRequest, plan_request
from hpipe.planner.search import plan_profiled, search_plan
from hpipe.planner.sidp import SidpGroup, plan_sidp
from hpipe.planner.simulate import Timeline, simulate
from hpipe.planner.slicing import slice_sequence
from hpipe.planner.speculative import adaptive_proposals, speculative_decode
from hpipe.planner.timeline import PALETTE, plot_gantt, pyplot, svg_gantt, timeline_bars, write_timeline
from hpipe.planner.uniform import make_plan, uniform_cuts

__all__ = ["MARGIN", "OBJECTIVES", "PALETTE", "CostModel", "decode_prediction", "decode_workload", "objective_seconds", "Infeasible", "LowerBound", "Partition", "PlanRequest", "PlanResult", "SidpGroup", "Timeline",
           "adaptive_proposals", "check_profile_matches", "compare", "gap", "lower_bound", "make_plan", "partition_layers",
           "plan_from_profile", "plan_profiled", "plan_request", "plan_sidp", "plot_gantt", "predict", "pyplot", "search_plan", "simulate", "slice_sequence",
           "slice_time_table", "speculative_decode", "svg_gantt", "timeline_bars", "uniform_cuts", "workload", "write_timeline"]
