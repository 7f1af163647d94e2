"""Screenshots of MLflow's UI for the docs: the runs table and the compare view of three evaluated artifacts.

    .venv/bin/python benchmarks/mlflow_screenshots.py --tracking-uri sqlite:///experiments/mlflow.db --out docs/img

Starts `mlflow ui` on a free loopback port (or uses an http:// --tracking-uri as is) and drives Debian's headless
chromium (`apt-get install chromium`) over --remote-debugging-pipe: localStorage picks the table's columns and keeps
the MLflow Assistant panel shut, the page is shot once the runs show. Nothing is written to the tracking store.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlencode

EVALUATIONS = "tags.kokoro_opt_kind = 'evaluation'"
PREFER = ("fp32", "int8-mixed")  # artifact_name tags; a peer (tag external=true) makes the third
SPEED, QUALITY, COST = (
    ["speedup_vs_reference", "rtf_p50", "ttfa_p50"],
    ["pesq_mean", "pesq_min", "mcd_mean", "wer_delta"],
    ["size_mb", "peak_rss_mb"],
)
HEADLINE = [*SPEED, *QUALITY, *COST]
# MLflow 3.x UI state in localStorage: the assistant's first-visit flag; the runs table's state per experiment-id list
# (ag-grid column ids; the run name already says the recipe, so no recipe.name or experiment column)
ASSISTANT_SEEN = "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"
TABLE_STATE = "MLflowLocalStorage-1.1-ExperimentPage-{ids}-ReactComponentState"
METRIC_COLUMNS = [f"metrics.`{m}`" for m in HEADLINE]
TABLE = {
    "selectedColumns": METRIC_COLUMNS,
    "columnOrder": ["attributes.`Run Name`", "runDateAndNestInfo", "duration", *METRIC_COLUMNS],
    "columnWidths": {"attributes.`Run Name`": 215, **dict.fromkeys(METRIC_COLUMNS, 95), METRIC_COLUMNS[0]: 150},
}
ROWS_BOTTOM = "Math.max(...[...document.querySelectorAll('.ag-row')].map(r => r.getBoundingClientRect().bottom)) + 16"
# compare view: its parallel-coordinates plot defaults to the first 3 differing params (built_with.*) and one metric;
# set the React component's state to recipe.name + headline metrics, cost to quality (colour: the last, pesq_mean)
PLOT = [*COST, *SPEED[::-1], *QUALITY[::-1]]
PLOT_AXES = """(() => {
  const b = [...document.querySelectorAll('button')].find(e => e.textContent.trim() === 'Clear All');
  let f = b && b[Object.keys(b).find(k => k.startsWith('__reactFiber$'))];
  while (f && !(f.stateNode && f.stateNode.handleMetricsSelectChange)) f = f.return;
  if (f) f.stateNode.setState({selectedParamKeys: ['recipe.name'], selectedMetricKeys: %s});
  return f ? innerHeight : 0;
})()"""


class Chromium:
    """Headless chromium over the DevTools protocol: NUL-terminated JSON, we write its fd 3, it writes fd 4."""

    def __init__(self, exe: str, width: int, height: int) -> None:
        to_chrome, self.out = os.pipe()
        self.inp, from_chrome = os.pipe()

        def fds() -> None:  # in the child, via fds >= 10 so neither end clobbers the other
            os.dup2(fcntl.fcntl(to_chrome, fcntl.F_DUPFD, 10), 3)
            os.dup2(fcntl.fcntl(from_chrome, fcntl.F_DUPFD, 10), 4)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"]
        flags += ["--hide-scrollbars", f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"]
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.proc = subprocess.Popen([exe, *flags], close_fds=False, preexec_fn=fds, **quiet)  # type: ignore[call-overload]
        os.close(to_chrome), os.close(from_chrome)
        self.buf, self.last, self.session = b"", 0, ""
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self.last += 1
        message = {"id": self.last, "method": method, "params": params} | ({"sessionId": self.session} if self.session else {})
        os.write(self.out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self.buf:
                if not select.select([self.inp], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise TimeoutError(f"chromium did not answer {method} within {timeout:.0f} s")
                chunk = os.read(self.inp, 1 << 20)
                if not chunk:
                    raise ConnectionError(f"chromium exited (code {self.proc.poll()}) during {method}")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.last:  # anything else is an event
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def js(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True).get("result", {}).get("value")

    def wait(self, condition: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.js(f"(() => {{ try {{ return Boolean({condition}) }} catch {{ return false }} }})()"):
                return True
            time.sleep(0.5)
        return False

    def shot(self, url: str, png: Path, storage: dict[str, str], ready: str, timeout: float, then: str) -> None:
        """Seed localStorage on the server's origin, open url, wait for `ready`, run `then` (it returns the height
        to keep, px) and save a PNG."""
        base = url.split("/#/")[0]
        self.call("Page.navigate", url=f"{base}/health")  # a plain page of the same origin: the app does not run
        self.wait("location.pathname === '/health'", 20)
        self.js(";".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)})" for k, v in storage.items()))
        self.call("Page.navigate", url=url)
        height = self.js(then) if self.wait(ready, timeout) else None
        if not height:
            print(f"warning: the page did not show ({ready}) or could not be set up; screenshot as it is", file=sys.stderr)
        time.sleep(3)  # plots, column widths
        view = self.js("[innerWidth, innerHeight]")
        clip = {"x": 0, "y": 0, "width": view[0], "height": min(view[1], int(height or view[1])), "scale": 1}
        png.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png", clip=clip)["data"]))
        print(f"{png} ({png.stat().st_size // 1024} KB) <- {url}")

    def close(self) -> None:
        with contextlib.suppress(OSError, TimeoutError, RuntimeError):
            self.call("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.out), os.close(self.inp)


def start_ui(uri: str, log: IO[bytes]) -> tuple[str, subprocess.Popen[bytes]]:
    """`mlflow ui` with one worker on a free loopback port, in its own session so that its children stop with it."""
    from kokoro_opt.evaluate.tracking_store import require_answers

    require_answers(uri)  # a store from an older MLflow migrated first, as kokoro-opt's commands do: `mlflow ui` refuses it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", port]
    cmd += ["--workers", "1"]
    return f"http://127.0.0.1:{port}", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's session (uvicorn, job consumers), SIGKILL to whatever is left of it after 20 s."""
    os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    with contextlib.suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            server.poll()  # reap the leader, so that the group empties
            os.killpg(server.pid, 0)
            time.sleep(0.5)
        os.killpg(server.pid, signal.SIGKILL)


def wait_healthy(base: str, server: subprocess.Popen[bytes] | None, log: IO[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            log.seek(0)
            sys.exit(f"error: mlflow ui exited with code {server.returncode}: {log.read().decode(errors='replace')[-800:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(1)
    sys.exit(f"error: {base}/health did not answer within {timeout:.0f} s")


def pick_runs(runs: list[Any]) -> list[Any]:
    """Of runs (newest first), the newest per artifact_id: an fp32, an int8-mixed and a peer, else the newest others."""
    newest: dict[str, Any] = {}
    for run in runs:
        newest.setdefault(run.data.tags.get("artifact_id", run.info.run_id), run)

    def rank(run: Any) -> int:
        name = run.data.tags.get("artifact_name", "")
        return PREFER.index(name) if name in PREFER else len(PREFER) + (run.data.tags.get("external") != "true")

    chosen: list[Any] = []
    for run in sorted(newest.values(), key=rank):  # stable: newest first within a rank
        if rank(run) > len(PREFER) or all(rank(c) != rank(run) for c in chosen):
            chosen.append(run)
    return chosen[:3]


def ids(values: list[str] | set[str]) -> str:
    """Sorted ids as JSON.stringify writes them: how the UI keys its routes and stored state."""
    return json.dumps(sorted(values), separators=(",", ":"))


def shoot(base: str, args: argparse.Namespace, chromium: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=base)
    experiments = {e.name: e.experiment_id for e in client.search_experiments() if e.name.startswith("kokoro-opt-")}
    newest_first = ["attributes.start_time DESC"]
    found = client.search_runs(list(experiments.values()), EVALUATIONS, order_by=newest_first) if experiments else []
    if not (runs := pick_runs(list(found))):
        sys.exit(f"error: no kokoro-opt evaluation runs in {args.tracking_uri}")
    print("runs:", ", ".join(r.info.run_name for r in runs))
    # one runs table over every experiment (recipe family, peers) holding evaluations, fastest first
    table = {r.info.experiment_id for r in found}
    query = {"experiments": ids(table), "searchFilter": EVALUATIONS, "orderByKey": "metrics.`speedup_vs_reference`"}
    query |= {"orderByAsc": "false", "workflowType": "machine_learning"}  # the "Model training" sidebar, not GenAI's
    runs_url = f"{base}/#/compare-experiments/s?{urlencode(query, quote_via=quote)}"
    compare_url = f"{base}/#/compare-runs?runs={quote(ids([r.info.run_id for r in runs]))}"
    compare_url += f"&experiments={quote(ids({r.info.experiment_id for r in runs}))}&workflowType=machine_learning"
    storage = {ASSISTANT_SEEN: "true", TABLE_STATE.format(ids=ids(table)): json.dumps(TABLE)}
    shown = " && ".join(f"document.body.innerText.includes({json.dumps(r.info.run_name)})" for r in runs)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        browser = Chromium(chromium, *args.size)
    except (OSError, TimeoutError, RuntimeError) as e:
        sys.exit(f"error: could not start {chromium}: {e}")
    try:
        ready = "document.querySelector('.ag-row') && document.body.innerText.includes('speedup_vs_reference')"
        browser.shot(runs_url, args.out / "mlflow-runs.png", storage, ready, args.timeout, ROWS_BOTTOM)
        axes = [m for m in PLOT if all(m in r.data.metrics for r in runs)]
        ready = f"{shown} && document.body.innerText.includes('Clear All')"
        browser.shot(compare_url, args.out / "mlflow-compare.png", storage, ready, args.timeout, PLOT_AXES % json.dumps(axes))
    finally:
        browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tracking-uri", default="sqlite:///experiments/mlflow.db", help="sqlite:///... store or http:// server")
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    ap.add_argument("--size", type=int, nargs=2, default=[1600, 1000], metavar=("WIDTH", "HEIGHT"), help="viewport, px")
    ap.add_argument("--timeout", type=float, default=90, help="seconds to wait for the UI to show the runs")
    ap.add_argument("--chromium", default="chromium")
    args = ap.parse_args()
    os.environ.update(MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")  # no usage reports: loopback only (and the server)
    chromium = shutil.which(args.chromium)
    if chromium is None:
        sys.exit(f"error: {args.chromium} not found: apt-get install chromium")
    uri: str = args.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        sys.exit(f"error: no MLflow store at {uri}: run kokoro-opt evaluate first")
    with tempfile.TemporaryFile() as log:
        base, server = (uri.rstrip("/"), None) if uri.startswith("http://") else start_ui(uri, log)
        try:
            wait_healthy(base, server, log)
            shoot(base, args, chromium)
        finally:
            if server is not None:
                stop(server)


if __name__ == "__main__":
    main()
