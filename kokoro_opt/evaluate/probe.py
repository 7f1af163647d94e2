"""The memory and profile probe: a fresh process per model under test, so its peak resident memory
is its own (the evaluating process holds every other model), plus the ONNX Runtime profile of a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kokoro_opt.evaluate import metrics as M
from kokoro_opt.evaluate.runners import Plan, Runner
from kokoro_opt.machine import proc_status_kib
from kokoro_opt.recipe import EvaluateConfig


def probe_runner(r: Runner, plan: Plan, config: EvaluateConfig) -> dict[str, Any]:
    """Peak RSS of a fresh process that loads the model and speaks the longest utterance, plus (ONNX)
    the ORT profile of that run. It runs in a temporary cwd: ORT writes its trace file there."""
    i = max(range(len(plan.tokens)), key=lambda j: len(plan.tokens[j]))
    spec = {
        "runner": {
            "label": r.label,
            "artifact_id": r.artifact_id,
            "kind": r.kind,
            "folder": str(Path(r.folder).resolve()),
            "manifest": {},
            "weights_dir": str(Path(r.weights_dir).resolve()) if r.weights_dir else None,
        },
        "tokens": plan.tokens[i],
        "voice": plan.utterances[i].voice,
        "speed": plan.utterances[i].speed,
        "threads": config.threads,
        "profile": config.profile,
    }
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="kokoro-opt-probe-") as cwd:
        done = subprocess.run(
            [sys.executable, "-m", "kokoro_opt.evaluate.probe"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=1800,
            check=False,
        )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def rss_mb(field_name: str = "VmHWM") -> float:
    """Peak (VmHWM) or current (VmRSS) resident memory of this process in MB.

    Not ru_maxrss on Linux: a child inherits its parent's peak across fork+exec, so every probe
    would report the RSS of the evaluating process that spawned it.
    """
    if (kib := proc_status_kib(field_name)) is not None:
        return kib / 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def main() -> None:
    spec = json.loads(sys.stdin.read())
    baseline = rss_mb("VmRSS")
    fields = spec["runner"]
    weights_dir = Path(fields["weights_dir"]) if fields["weights_dir"] else None
    runner = Runner(**{**fields, "folder": Path(fields["folder"]), "weights_dir": weights_dir})
    profile = bool(spec["profile"]) and runner.kind == "onnx"
    runner.load(int(spec["threads"]), profile=profile)
    for _ in range(2):  # warm-up, then the run whose profile is kept (op_type_times reads the last run)
        runner.synth_tokens(spec["tokens"], spec["voice"], float(spec["speed"]))
    op_times: dict[str, float] = {}
    if profile:
        for trace in runner.profiled.end_profiling():  # model.onnx's, or a fused artifact's front and segments
            for op, seconds in M.op_type_times(json.loads(trace.read_text(encoding="utf-8"))).items():
                op_times[op] = op_times.get(op, 0.0) + seconds
            trace.unlink()
    op_times = dict(sorted(op_times.items(), key=lambda item: -item[1]))  # largest first, over every trace summed
    print(json.dumps({"peak_rss_mb": rss_mb(), "baseline_rss_mb": baseline, "op_times": op_times}))


if __name__ == "__main__":
    main()
