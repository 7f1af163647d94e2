"""Real servers for the team tests: a PostgreSQL cluster and an MLflow tracking server, on loopback.

PostgreSQL is Debian's `postgresql` package (.ci/run installs it when missing): the server the docs
tell a team to run, started here with initdb + pg_ctl in a throwaway folder. PostgreSQL refuses to
run as root, so under root (CI) it runs as the package's `postgres` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kokoro_opt.serve.spawn import free_port
from tests.needs import missing


def _postgres_bin() -> Path | None:
    found = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)), None)
    return Path(found).parent if found else None


def _missing(what: str) -> None:
    missing(what, "install it (Debian: apt-get install postgresql) to run this test")  # .ci/run installs it


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A PostgreSQL cluster on a free loopback port; yields its base URL (no database name)."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        _missing("PostgreSQL's initdb/pg_ctl not found")
    as_root = os.geteuid() == 0
    prefix: list[str] = ["runuser", "-u", "postgres", "--"] if as_root else []
    base = Path(tempfile.mkdtemp(prefix="kokoro-opt-pg-"))  # not under pytest's 0700 root-owned tmp
    data, port = base / "data", free_port()
    if as_root:
        shutil.chown(base, "postgres")
    base.chmod(0o755)

    def run(*args: str) -> None:
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=120, check=False)
        if done.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed: {done.stderr or done.stdout}")

    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "kokoro", "--auth=trust", "--no-sync", "-E", "UTF8")
        options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(base / "server.log"), "-w", "start")
        try:
            yield f"postgresql://kokoro@127.0.0.1:{port}"
        finally:
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def create_database(server: str, name: str) -> str:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: Path) -> Iterator[str]:
    """`mlflow server` with a database backend and a proxied artifact store; yields its http:// URI."""
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
        "--artifacts-destination", artifacts.resolve().as_uri(), "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = artifacts.parent / f"mlflow-server-{port}.log"
    artifacts.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url, server, 120):
            raise RuntimeError(f"mlflow server did not start: {log.read_text()[-2000:]}")
        yield url
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def wait_healthy(url: str, server: subprocess.Popen[Any], timeout: float, path: str = "/health") -> bool:
    """Poll GET {url}{path} until 200; False if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    return False
