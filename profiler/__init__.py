"""hpipe's profiler (`hpipe profile`): per-unit compute tables, memory and per-link latency and
bandwidth, written as a profile file (hpipe.formats) that the planner reads.

`measure` and `links` are the measurement workers (`python -m hpipe.profiler.measure`, run
unchanged on remote hosts over SSH); `run` orchestrates them; `catalog` holds device peaks for
estimated profiles. See profiler/README.md.
"""

from hpipe.profiler.measure import probe
from hpipe.profiler.run import profile_cluster, profile_estimate, profile_local, summarize

__all__ = ["probe", "profile_cluster", "profile_estimate", "profile_local", "summarize"]
