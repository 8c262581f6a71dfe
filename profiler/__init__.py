"""hpipe's profiler (`hpipe profile`): per-unit compute tables, memory and per-link latency and
bandwidth, written as a profile file (hpipe.formats) that the planner reads.

`measure` and `links` are the measurement workers (`python -m hpipe.profiler.measure`, run
unchanged on remote hosts over SSH); `run` orchestrates them; `catalog` holds device peaks for
estimated profiles; `runtime_costs` the runtime's own per-token costs. See profiler/README.md.
"""

from hpipe.profiler.measure import probe
from hpipe.profiler.run import profile_cluster, profile_estimate, profile_local, summarize
from hpipe.profiler.runtime_costs import runtime_costs

__all__ = ["probe", "profile_cluster", "profile_estimate", "profile_local", "runtime_costs", "summarize"]
