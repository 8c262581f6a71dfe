"""hpipe's profiler (`hpipe profile`): per-unit compute tables and per-link latency/bandwidth.

Not built yet: see profiler/README.md and the profiler issue. It will write profile files that
the planner reads; it may import hpipe.models and hpipe.runtime, never planner or launcher.
"""
