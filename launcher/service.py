"""`hpipe serve`'s service: a plan's pipeline (`PipelineClient`) behind the OpenAI-compatible app
(`launcher/api.py`) on uvicorn, from the stages' start to their end.

A stage that fails ends the open requests with its error and stops the server a moment later (the
error events reach their clients first); SIGHUP reads the cluster inventory again (hosts added to
it join the pipeline); at the end, whatever ended it (Ctrl-C too), the service's single streams
are checked against the plan's decode prediction and its events are said, through `log`.
"""

from __future__ import annotations

import socket
import threading

from hpipe.errors import HpipeError
from hpipe.launcher.jobs import decode_check, decode_check_lines
from hpipe.launcher.serving import PipelineClient

__all__ = ["listen_socket", "serve_http"]


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before the stages start: a port out of range or
    taken, or a host that does not resolve, is found in a second, not a minute, and the port is this
    server's from then on (checked free, then bound once the stages were up, it went meanwhile to
    another process's pick of a free port: seen in the test suite). Port 0: any free one, which the
    "serving ... on" line names. A connection made before the server is ready waits in the backlog."""
    if not 0 <= port < 65536:
        raise HpipeError(f"--port must be in 0..65535 (0: any free port), got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise HpipeError(f"--host {host!r}: cannot resolve it ({e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # a restart while the last one's connections close
    try:
        sock.bind(addr)
        sock.listen(2048)                                         # uvicorn's backlog
    except OSError as e:
        sock.close()
        raise HpipeError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port (0: any free one) "
                         "or --host") from None
    return sock


def serve_http(client: PipelineClient, name: str, host: str, sock: socket.socket, api_key: str | None, log,
               inventory_file: str | None = None) -> None:
    """Starts the client's stages, serves `name` on `sock` (`listen_socket`'s, for `host`) until
    Ctrl-C or a stage's failure (raised as the HpipeError that says it), and closes everything."""
    import uvicorn

    from hpipe.launcher.api import create_app

    job, server = client.job, None

    def failed(cause: str) -> None:
        if client.ready.is_set():
            log(f"a stage failed; open requests were ended with the error; stopping the server: {cause}")
        if server is not None:   # a moment for the error events to reach their clients
            threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()

    client.on_failure = failed
    if inventory_file is not None:       # the inventory read again: hosts added to it join the pipeline
        import signal
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=client.reload_inventory,
                                                                 args=(inventory_file,), daemon=True).start())
    try:
        client.start()
        ready = client.info
        app = create_app(client, job.tokenizer, name, int(job.config.vocab_size), api_key)
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        log(f"serving {name} on http://{host}:{port}/v1 ({len(job.plan.stages)} stages, policy "
            f"{client.settings.runtime.policy}, KV pool {ready.kv_pages} pages x {ready.page_size} tokens, max model "
            f"length {ready.max_model_len}); the live page at http://{host}:{port}/; Ctrl-C stops every stage")
        if client.failure is None:
            server.run(sockets=[sock])
    finally:
        sock.close()
        client.close()
        # the service's single streams against the plan's decode prediction (Ctrl-C ends here too)
        for line in decode_check_lines(decode_check(client.plan or job.plan, client.output.timelines)):
            log(line)
        for event in client.metrics.events:
            log(f"event: {event.line()}")
    if client.failure is not None:     # a stage failed (a shutdown asked for is not a failure)
        raise HpipeError(client.failure)
