"""Which evaluated artifact is best: the fastest that passes the quality budget in the mode it will be served
(windowed for an artifact that streams windowed), measured on this machine first; among speed-ups within 3% of
each other, the one a listener hears sooner. A pure policy over the evaluation runs MLflow holds
(kokoro_opt.select serves it)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kokoro_opt.evaluate.tracking_store import KIND_TAG, existing_client, machine_from_tags, our_experiments


def best_evaluated(
    tracking_uri: str | None,
    min_pesq: float,
    available: Callable[[str], bool] | None = None,
    machine_id: str | None = None,
    min_phrase_pesq: float | None = None,
) -> dict[str, Any] | None:
    """Among evaluated kokoro-opt artifacts (not peers) whose mean PESQ-WB vs fp32 is >= min_pesq on
    the sentences and >= min_phrase_pesq on the short-phrase slice (where it was scored), and that
    produced no NaN/silent output (the fp32 reference passes by definition): the fastest.

    Fastest by the speedup over fp32 measured side by side in the same session: RTFs measured in
    different sessions are not comparable on a noisy machine. Runs without that ratio rank after, by
    RTF p50. Each artifact's newest evaluation counts; artifacts `available` rejects are skipped.
    With `machine_id`, only evaluations measured on that machine rank first (the best artifact and
    its speed-up depend on the CPU); when there is none, the best measured elsewhere is returned
    with `measured_here` False and a reason that says so."""
    opened = existing_client(tracking_uri)
    if opened is None:
        return None  # nothing evaluated yet
    _, client = opened
    ids = our_experiments(client)
    runs = client.search_runs(ids, f"tags.{KIND_TAG} = 'evaluation' and attributes.status = 'FINISHED'") if ids else []
    if machine_id is not None:
        mine = [r for r in runs if r.data.tags.get("machine.id") == machine_id]
        here = _fastest_passing(mine, min_pesq, min_phrase_pesq, available)
        if here is not None:
            return {**here, "measured_here": True, "reason": here["reason"] + f", measured on this machine (id {machine_id})"}
    best = _fastest_passing(runs, min_pesq, min_phrase_pesq, available)
    if best is None or machine_id is None:
        return best
    elsewhere = best["machine"]
    return {
        **best,
        "measured_here": False,
        "reason": best["reason"] + f", measured on another machine ({elsewhere.get('cpu', '?')}, id {elsewhere.get('id', '?')}): "
        "none of this machine's own yet",
    }


TTFA_TIE = 0.03  # speed-ups within 3% of the fastest are a tie: the sooner first audio wins


SERVED_KEYS = ("pesq_mean", "phrase_pesq_mean", "ttfa_p50")  # what a listener gets differs between the modes


def served(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics of the mode `serve` uses for this artifact: windowed where it streams windowed by default
    (evaluate logs `served_windowed`), else the whole decoding's."""
    prefix = "windowed_" if metrics.get("served_windowed") == 1.0 else ""
    return {key: metrics[prefix + key] for key in SERVED_KEYS if prefix + key in metrics} | {"windowed": float(bool(prefix))}


def budget_problem(metrics: dict[str, float], min_pesq: float | None, min_phrase_pesq: float | None) -> str | None:
    """Why an evaluation misses a quality budget, judged by what a listener of the served mode hears (`served`);
    None: within it. `min_pesq` None: PESQ is not what the budget reads (a WER budget); it still needs clean output."""
    if metrics.get("bad_outputs", 1.0) != 0.0:
        return "NaN or silent output in its evaluation"
    heard = served(metrics)
    mode = "windowed " if heard["windowed"] else ""
    pesq, phrases = heard.get("pesq_mean", math.nan), heard.get("phrase_pesq_mean", math.nan)
    if min_pesq is not None and not math.isfinite(pesq):
        return f"its evaluation has no {mode}PESQ (no fp32 reference)"
    if min_pesq is not None and pesq < min_pesq:
        return f"{mode}PESQ {pesq:.2f} < budget {min_pesq}"
    if min_phrase_pesq is not None and math.isfinite(phrases) and phrases < min_phrase_pesq:
        return f"{mode}short-phrase PESQ {phrases:.2f} < budget {min_phrase_pesq}"
    return None


def _fastest_passing(
    runs: list[Any], min_pesq: float, min_phrase_pesq: float | None, available: Callable[[str], bool] | None
) -> dict[str, Any] | None:
    newest: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r.info.start_time, reverse=True):
        newest.setdefault(run.data.tags.get("artifact_id", ""), run)
    passing = []
    for artifact_id, run in newest.items():
        tags, m = run.data.tags, run.data.metrics
        if tags.get("external") == "true" or "rtf_p50" not in m or m.get("bad_outputs", 1.0) != 0.0:
            continue
        if available is not None and not available(artifact_id):
            continue
        if tags.get("is_reference") == "true" or budget_problem(m, min_pesq, min_phrase_pesq) is None:
            passing.append(run)
    if not passing:
        return None

    def speedup(run: Any) -> float | None:
        if run.data.tags.get("is_reference") == "true":
            return 1.0
        return run.data.metrics.get("speedup_vs_reference")

    def ttfa(run: Any) -> float:
        return served(run.data.metrics).get("ttfa_p50", math.inf)

    measured = [run for run in passing if speedup(run)]
    if measured:
        fastest = max(speedup(run) or 0.0 for run in measured)
        best = min((run for run in measured if speedup(run) >= (1 - TTFA_TIE) * fastest), key=ttfa)
    else:
        best = min(passing, key=lambda run: run.data.metrics["rtf_p50"])
    m, tags = best.data.metrics, best.data.tags
    heard = served(m)
    is_reference = tags.get("is_reference") == "true"
    mode = "windowed" if heard["windowed"] else "whole"
    quality = "the fp32 reference" if is_reference else f"{mode} PESQ {heard.get('pesq_mean', math.nan):.2f} >= {min_pesq}"
    if not is_reference and min_phrase_pesq is not None:
        scored = "phrase_pesq_mean" in heard
        quality += f", phrases {heard['phrase_pesq_mean']:.2f} >= {min_phrase_pesq}" if scored else ", phrases not scored"
    pace = f"{speedup(best):.2f}x fp32, " if speedup(best) and not is_reference else ""
    first = f"first audio {heard['ttfa_p50']:.3f} s ({mode}), " if "ttfa_p50" in heard else ""
    return {
        "artifact_id": tags["artifact_id"],
        "run_id": best.info.run_id,
        "rtf_p50": m["rtf_p50"],
        "pesq_mean": heard.get("pesq_mean"),
        "windowed": bool(heard["windowed"]),
        "machine": machine_from_tags(tags),
        "reason": f"fastest evaluated artifact passing the quality budget: {tags.get('artifact_name', '?')} "
        f"{pace}{first}RTF p50 {m['rtf_p50']:.3f}, {quality}, no NaN/silent output (MLflow run {best.info.run_id})",
    }
