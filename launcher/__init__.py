"""hpipe's launcher: prepares a job from a plan and prompts, starts the stage workers (local
processes, or remote hosts over SSH) as a `Launch` the batch job and the server each drive, collects
their reports into the results file; `serving` runs the same workers as a service and
`api` puts the OpenAI HTTP API in front of it, `service` runs the two on uvicorn (`hpipe serve`); `elastic` keeps a cluster going when
a host drops out or comes back."""

from hpipe.launcher.cluster import (check_table, launch_cluster, plan_hosts, preflight, refuse_failed,
                                    remote_model_spec, start_cluster, warm_hosts)
from hpipe.launcher.jobs import (HEARTBEAT_TIMEOUT_S, TOLERANCE, Launch, LaunchSettings, PreparedJob, busy_fractions, decode_check, decode_check_lines,
                                 encode_prompt, plan_check,
                                 prepare, prepare_model, read_job_files, write_run_summary)
from hpipe.launcher.local import launch_local, prestart_local, start_local, threads_per_stage
from hpipe.launcher.overheads import decode_terms
from hpipe.launcher.replicas import ReplicaReport, check_replicas, launch_replicas, write_mode_trace
from hpipe.launcher.run_chart import check_timeline_out, predicted_timeline, write_run_timeline
from hpipe.launcher.service import listen_socket, serve_http

__all__ = ["HEARTBEAT_TIMEOUT_S", "TOLERANCE", "Launch", "LaunchSettings", "PreparedJob", "ReplicaReport", "check_replicas", "launch_replicas", "listen_socket", "write_mode_trace", "busy_fractions", "check_table", "check_timeline_out", "decode_check", "decode_check_lines", "decode_terms", "encode_prompt",
           "launch_cluster", "launch_local", "plan_check", "plan_hosts", "prestart_local", "predicted_timeline", "preflight", "prepare", "prepare_model", "read_job_files",
           "refuse_failed", "remote_model_spec", "serve_http", "start_cluster", "start_local", "threads_per_stage", "warm_hosts", "write_run_summary", "write_run_timeline"]
