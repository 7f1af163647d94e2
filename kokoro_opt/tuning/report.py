"""The study's results: the Pareto front, the scalarised pick the server uses, tuned.json, the table."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from kokoro_opt.artifacts import write_json_atomic
from kokoro_opt.select import TUNED_FILE
from kokoro_opt.tuning.config import BestConfig
from kokoro_opt.tuning.measure import Comparison
from kokoro_opt.tuning.records import redact, study_key
from kokoro_opt.tuning.space import TrialSettings

MAXIMIZE = "MAXIMIZE"


def scores(front: list[Any], directions: list[str], names: list[str], rule: BestConfig) -> dict[int, float]:
    """Trial number -> score: each objective scaled to [0, 1] across the front (0 = its best value), weighted, summed."""
    total = dict.fromkeys((t.number for t in front), 0.0)
    for i, name in enumerate(names):
        weight = rule.weights.get(name, 0.0)  # type: ignore[call-overload]
        values = [t.values[i] for t in front]
        lo, hi = min(values), max(values)
        for t in front:
            gap = (hi - t.values[i]) if directions[i] == MAXIMIZE else (t.values[i] - lo)
            total[t.number] += weight * (gap / (hi - lo) if hi > lo else 0.0)
    return total


def pick_best(study: Any, names: list[str], rule: BestConfig) -> tuple[Any | None, dict[int, float], str]:
    """(winning trial, scores of the front, a note). The winner is on the Pareto front and, if any
    front trial keeps up with playback (rule.max_rtf_p50), one of those."""
    front = sorted(study.best_trials, key=lambda t: t.number)
    if not front:
        return None, {}, "no complete trials yet"
    directions = [d.name for d in study.directions]
    fast = [t for t in front if rule.max_rtf_p50 is None or t.values[1] <= rule.max_rtf_p50]
    note = "" if fast else f"no front trial has RTF p50 <= {rule.max_rtf_p50}: picked among all of the front"
    pool = fast or front
    score = scores(pool, directions, names, rule)
    best = min(pool, key=lambda t: (score[t.number], t.number))
    return best, score, note


def tuned_json(study: Any, storage: str, trial: Any, settings: TrialSettings, names: list[str], metric: str,
               comparison: Comparison | None, score: float) -> dict[str, Any]:  # fmt: skip
    from kokoro_opt.machine import fingerprint

    attrs = trial.user_attrs["settings"]
    data: dict[str, Any] = {
        "artifact_id": settings.artifact_id,
        "artifact": attrs["artifact"],
        "model_format": attrs["model_format"],
        "study": study.study_name,
        "storage": redact(storage),
        "study_key": study_key(storage, study),  # storage, name and creation uid: one study among same-named ones
        "trial": trial.number,
        "session": asdict(settings.session),
        "chunking": settings.chunking,
        "objectives": dict(zip(names, trial.values, strict=True)),
        "quality_metric": metric,
        "score": score,
        "machine": fingerprint(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if comparison is not None:
        data["vs_defaults"] = comparison.to_json()
        data["ttfa_ratio"] = comparison.ratio
        # Applied only where it beat the defaults side by side: a study's winner among noisy trials can be slower.
        data["applied"] = comparison.ratio < 1.0
        if not data["applied"]:
            data["not_applied"] = (
                f"trial {trial.number} gave first audio in {comparison.tuned_p50 * 1000:.0f} ms against the defaults' "
                f"{comparison.defaults_p50 * 1000:.0f} ms, measured side by side"
            )
    return data


def write_tuned(root: Path, data: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / TUNED_FILE
    write_json_atomic(path, data)
    return path


def previous_tuned(root: Path) -> dict[str, Any] | None:
    """The tuned.json `tune` wrote under `root` before, as written; None when there is none or it does not parse.
    Only `tune` reads it this way (to skip a measured winner, to show one): `serve` validates it (select.read_tuned)."""
    path = root / TUNED_FILE
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def ratio_line(vs: dict[str, Any]) -> str:
    """One line from a comparison's JSON (Comparison.to_json, tuned.json's vs_defaults)."""
    d, t, r = vs["defaults_ttfa_p50"], vs["tuned_ttfa_p50"], vs["ttfa_ratio"]
    head = f"TTFA p50 on {vs['artifact_id'][:8]}: defaults {_ms(d)} ms, tuned {_ms(t)} ms"
    if r >= 1.0:
        return f"{head} -> ratio {r:.2f}: not sooner than the defaults, so not applied (serve keeps the defaults)"
    return f"{head} -> ratio {r:.2f} ({1 / r:.2f}x sooner first audio)"


def _ms(value: float) -> str:
    return f"{1000 * value:.0f}"


def _session_cell(session: dict[str, Any]) -> str:
    """'2t seq all', '2t par/2 extended', plus the provider and its options when not the CPU one."""
    mode = str(session.get("execution_mode", "?"))[:3]
    threads = f"{session.get('intra_op_num_threads')}t {mode}" + (
        f"/{session.get('inter_op_num_threads')}" if mode == "par" else ""
    )
    cell = f"{threads} {session.get('graph_optimization_level', '?')}"
    provider = str((session.get("providers") or ["?"])[0]).replace("ExecutionProvider", "")
    options = (session.get("provider_options") or [{}])[0]
    if provider != "CPU":
        cell += f" {provider} " + ",".join(f"{k}={v}" for k, v in options.items())
    return cell


def front_table(study: Any, names: list[str], metric: str, rule: BestConfig) -> Table:
    best, score, _ = pick_best(study, names, rule)
    front = sorted(study.best_trials, key=lambda t: t.values[0])
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    table = Table(title=f"study '{study.study_name}': Pareto front of {summary} trials (* = the pick)", box=box.SIMPLE_HEAD)
    quality = "quality" in names
    for column in (
        "trial",
        "artifact",
        "ORT session",
        "chunks",
        "TTFA ms",
        "RTF",
        *([metric.upper()] if quality else []),
        "score",
    ):
        table.add_column(column, justify="left" if column in ("artifact", "ORT session", "chunks") else "right")
    for t in front:
        s = t.user_attrs.get("settings", {})
        chunking = s.get("chunking", {})
        name = str(s.get("artifact", "?")).split("@")[0] + (".ort" if s.get("model_format") == "ort" else "")
        row = [
            f"{t.number}{'*' if best is not None and t.number == best.number else ''}",
            name,
            _session_cell(s.get("session", {})),
            f"{chunking.get('first_chunk_tokens')}/{chunking.get('chunk_tokens')}/{chunking.get('crossfade_ms'):g}"
            + (f" w{chunking['first_window_steps']}" if chunking.get("first_window_steps") else "")
            + (f" c{chunking['context_words']}" if "context_words" in chunking else ""),
            _ms(t.values[0]),
            f"{t.values[1]:.3f}",
            *([f"{t.values[2]:.2f}"] if quality else []),
            f"{score[t.number]:.2f}" if t.number in score else "-",
        ]
        table.add_row(*row)
    table.caption = (
        "chunks = first/later tokens/crossfade ms, w = first window steps, c = words of context at a cut; "
        "score: the recipe's best rule, lowest wins; "
        "the pick is served only where it beat the defaults side by side (its `applied` field in tuned.json)"
    )
    return table
