"""`kokoro-opt serve` in a child process on a free loopback port: what bench-serve and the soak benchmarks
measure, a server as a user starts it (its own process, its own memory)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

from kokoro_opt.errors import UserError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def spawned_server(args: list[str], timeout: float = 600.0) -> Iterator[str]:
    """`kokoro-opt serve <args>` in a subprocess on a free loopback port; yields its URL once /ready."""
    port = free_port()
    command = [sys.executable, "-m", "kokoro_opt.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: an unread pipe would block the server's logging
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + timeout
            while not _ready(url):
                if process.poll() is not None:
                    log.seek(0)
                    reason = startup_error(log.read().decode(errors="replace"))
                    raise UserError(f"the server exited with code {process.returncode}: {reason}")
                if time.monotonic() > deadline:
                    raise UserError("the server did not become ready in time", "check that the artifact loads: kokoro-opt say")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def startup_error(stderr: str) -> str:
    """What a server that failed to start said: its `error:` block on one line (the CLI's console
    wraps it at 80 columns when stderr is a file), else the last line, e.g. a traceback's exception."""
    lines = [line.strip() for line in stderr.strip().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    if not starts:
        return lines[-1] if lines else "(nothing on stderr)"
    return " ".join(line for line in lines[starts[-1] :] if line).removeprefix("error: ")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
