"""Helpers shared by the server tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples (all labels) from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@contextlib.contextmanager
def serving_with_engine(artifact: Any, config: Any) -> Iterator[tuple[str, Any]]:
    """A real server (uvicorn on a free loopback port) serving `artifact`, warmed: (its URL, its engine, which a test
    may watch or steer)."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import Engine, running
    from kokoro_opt.serve.metrics import Metrics

    selection = resolve_artifact(str(artifact.path))
    engine = Engine(selection, config, Metrics())
    with running(selection, config, engine=engine) as base:
        yield base, engine


def held_after_first_job(engine: Any) -> contextlib.AbstractContextManager[threading.Event]:
    """The engine's worker stops after a request's first job, its audio handed out, until the block ends or the
    yielded event is set. What a test then sees of the rest of the request follows from the engine's order,
    not from how fast the model or the machine is."""
    return _held(engine, before=False)


def held_before_first_job(engine: Any) -> contextlib.AbstractContextManager[threading.Event]:
    """The engine's worker waits before it runs any unit, until the block ends or the yielded event is set: no
    request gets its first audio meanwhile, however fast the model or the machine is."""
    return _held(engine, before=True)


@contextlib.contextmanager
def _held(engine: Any, before: bool) -> Iterator[threading.Event]:
    release, step = threading.Event(), engine.mode.step

    def held(stream: Any, tokens: list[int], last: bool) -> None:
        if before:
            release.wait(60)
        step(stream, tokens, last)
        if not before and stream.jobs == 1 and not last:
            release.wait(60)

    engine.mode.step = held
    try:
        yield release
    finally:
        release.set()
        engine.mode.step = step


def record_evaluations(tracking_uri: str, metrics: list[tuple[str, dict[str, float | None]]]) -> None:
    """Finished evaluation records as `best` and `tune` read them, one per (artifact id, metrics), each within the
    quality budget unless its metrics say otherwise: for artifacts this machine cannot evaluate (a Mac's Core ML),
    or that a test ranks by figures it chooses."""
    from mlflow.tracking import MlflowClient

    from kokoro_opt.evaluate.tracking_store import EXPERIMENT_PREFIX, KIND_TAG

    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment(EXPERIMENT_PREFIX + "evaluations")
    for artifact_id, chosen in metrics:
        run = client.create_run(experiment, tags={KIND_TAG: "evaluation", "artifact_id": artifact_id, "is_reference": "false"})
        for key, value in ({"rtf_p50": 0.1, "bad_outputs": 0.0, "pesq_mean": 4.2} | chosen).items():
            if value is not None:  # None: a metric that evaluation did not have
                client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id)
