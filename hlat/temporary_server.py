"""The temporary Prefect server of a CLI command run without PREFECT_API_URL (Prefect's ephemeral mode), started so
that it outlives a Ctrl-C and never outlives the command.

Prefect starts its ephemeral server (`prefect.server.api.server.SubprocessASGIServer`: uvicorn in a child process)
in the command's process group, so a Ctrl-C in the terminal reached it too: the flow, interrupted, then had no API
to report its state to and spun on refused connections for minutes. And a command killed outright (SIGKILL) left
the server running, re-parented to PID 1.

Here the server is started before the flow, through Prefect's own class, with two changes of ours:

- its process runs in a session of its own (`start_new_session`), out of the terminal's process group: Ctrl-C
  interrupts the command alone, which reports the interruption and stops the server on its way out (Prefect's
  atexit handler);
- a watchdog process, started first and also in a session of its own, is sent the server's pid the moment it
  exists, over a pipe whose write end only this command holds; when the command ends, however it ends, the read
  returns end-of-file and the watchdog stops the server if it is still there (SIGTERM, then SIGKILL), after
  checking that the process is that server.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

WATCHDOG = r"""
import os, signal, sys, time
marker = ":".join(sys.argv[1:]).encode()  # given in two parts: this command line must not match it
pids = [int(line) for line in sys.stdin.buffer]  # one line per server started; end-of-file: the command has ended

def alive(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker in f.read()
    except OSError:
        return False

for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
    for pid in pids:
        if alive(pid):
            os.kill(pid, sig)
    deadline = time.monotonic() + wait
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
"""

SERVER_MARKER = "prefect.server.api.server:create_app"
"""What the server's command line holds (uvicorn's app factory argument): the watchdog kills no other process."""

_watchdog: subprocess.Popen[bytes] | None = None


class _SubprocessInOwnSession:
    """`subprocess` as Prefect's server module sees it: the same module, except that Popen starts its process in a
    session of its own, with its output appended to `output` (the command's log file) when given, and tells the
    watchdog its pid at once (a command killed while the server starts up leaves nothing either)."""

    def __init__(self, output: Path | None = None) -> None:
        self.output = output

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs.setdefault("start_new_session", True)
        with contextlib.ExitStack() as stack:
            if self.output is not None:
                kwargs.setdefault("stdout", stack.enter_context(self.output.open("ab")))
                kwargs.setdefault("stderr", subprocess.STDOUT)
            process = subprocess.Popen(*args, **kwargs)
        if _watchdog is not None and _watchdog.stdin is not None:
            _watchdog.stdin.write(f"{process.pid}\n".encode())
            _watchdog.stdin.flush()
        return process


def start_temporary_server(output: Path | None = None) -> str | None:
    """Start Prefect's ephemeral server now, out of the terminal's process group and watched; return its API URL.
    None, starting nothing, when the command talks to a configured API (PREFECT_API_URL) or ephemeral mode is off.
    The server's own output goes to `output`, the command's log file, when given: stopped as the command ends, it
    may log a traceback from its database pool (seen in CI), which does not belong on the user's terminal."""
    global _watchdog
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    import prefect.server.api.server as server_module

    if _watchdog is None:
        _watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, *SERVER_MARKER.partition(":")[::2]],
            stdin=subprocess.PIPE,  # its write end stays in this process alone (close_fds)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    server_module.subprocess = _SubprocessInOwnSession(output)  # type: ignore[assignment]
    server = server_module.SubprocessASGIServer()  # the instance Prefect's client uses when it needs an API
    server.start()
    return str(server.api_url)
