"""The report lines workers print on stdout for their launcher: `@@hpipe {json}`, one object per
line with a "type" (result, timeline, summary, error, estimate, progress, device_profile,
link_profile). Everything else a worker prints is a log line. Defined once, here."""

from __future__ import annotations

import json
import sys
import threading

MARKER = "@@hpipe "
_LOCK = threading.Lock()     # a serving worker reports from several threads: whole lines only


def emit(kind: str, **data) -> None:
    line = MARKER + json.dumps({"type": kind, **data}) + "\n"
    with _LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def parse(line: str) -> dict | None:
    """The report on this line, or None for a log line."""
    if not line.startswith(MARKER):
        return None
    try:
        return json.loads(line[len(MARKER):])
    except json.JSONDecodeError:
        return None
