"""hpipe: plan and launch pipeline-parallel LLM inference on mixed commodity hardware."""

__version__ = "0.1.0"
