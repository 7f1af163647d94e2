"""What an evaluation hands back (EvalResult) and how it is shown: rich tables, JSON, PNG plots."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kokoro_opt.tables import print_table


@dataclass
class EvalResult:
    """One model's numbers from one evaluation (or from MLflow when the evaluation was already logged)."""

    label: str  # what the tables show
    artifact_id: str
    kind: str  # onnx | torch
    external: bool = False  # a peer (kokoro-onnx int8, PyTorch eager), not a kokoro-opt build
    reference_id: str | None = None  # the fp32 export its quality is measured against
    is_reference: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    utterances: list[dict[str, Any]] = field(default_factory=list)  # per-utterance rows
    op_times: dict[str, float] = field(default_factory=dict)  # seconds per ORT op type, one run
    notes: list[str] = field(default_factory=list)
    run_id: str | None = None
    skipped: bool = False  # found already logged with the same settings: not measured again
    samples: dict[str, Any] = field(default_factory=dict, repr=False)  # a few clips for WAVs and plots; not in JSON
    machine: dict[str, Any] = field(default_factory=dict)  # kokoro_opt.machine.fingerprint() of where it was measured
    span_ms: tuple[int, int] | None = None  # when its measuring session started and ended (epoch ms)

    def metric(self, name: str) -> float:
        value = self.metrics.get(name, math.nan)
        return float(value) if value is not None else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "artifact_id": self.artifact_id,
            "kind": self.kind,
            "external": self.external,
            "reference_id": self.reference_id,
            "is_reference": self.is_reference,
            "run_id": self.run_id,
            "skipped": self.skipped,
            "metrics": {k: _finite(v) for k, v in sorted(self.metrics.items())},
            "op_times": self.op_times,
            "notes": self.notes,
            "utterances": [{k: _finite(v) if isinstance(v, float) else v for k, v in row.items()} for row in self.utterances],
            "machine": self.machine,
        }


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def results_json(results: list[EvalResult], extra: dict[str, Any] | None = None) -> str:
    return json.dumps({**(extra or {}), "results": [r.to_json() for r in results]}, indent=2, sort_keys=True)


# ---- tables ---------------------------------------------------------------------------------------

# (header, metric, format): short headers so the table fits an 80-column terminal.
COLUMNS: list[tuple[str, str, str]] = [
    ("MB", "size_mb", "{:.0f}"),
    ("RTF p50", "rtf_p50", "{:.3f}"),
    ("speedup", "speedup_vs_reference", "{:.2f}x"),
    ("TTFA s", "ttfa_p50", "{:.2f}"),
    ("PESQ", "pesq_mean", "{:.2f}"),
    ("PESQ phr", "phrase_pesq_mean", "{:.2f}"),
    ("MCD dB", "mcd_mean", "{:.2f}"),
    ("WER Δ", "wer_delta", "{:+.3f}"),
    ("RSS MB", "peak_rss_mb", "{:.0f}"),
]
DETAIL_COLUMNS: list[tuple[str, str, str]] = [
    ("load s", "load_seconds", "{:.2f}"),
    ("lat p50", "latency_p50", "{:.3f}"),
    ("lat p90", "latency_p90", "{:.3f}"),
    ("RTF p90", "rtf_p90", "{:.3f}"),
    ("PESQ min", "pesq_min", "{:.2f}"),
    ("phr min", "phrase_pesq_min", "{:.2f}"),
    ("phr lat", "phrase_latency_p50", "{:.3f}"),
    ("phr speedup", "phrase_speedup_vs_reference", "{:.2f}x"),
    ("dur =%", "durations_equal_pct", "{:.0f}"),
    ("4-12k dB", "high_band_db_mean", "{:+.2f}"),
    ("WER", "wer", "{:.3f}"),
    ("bad", "bad_outputs", "{:.0f}"),
    ("edge ok", "edge_inputs_ok", "{:.0f}"),
    ("CoreML parts", "coreml_partitions", "{:.0f}"),  # ONNX Runtime's Core ML partition analysis (ep_support)
    ("CoreML nodes", "coreml_node_share", "{:.0%}"),
]
CAPTION = (
    "speedup: vs the fp32 export of the same weights, measured interleaved in this session; "
    "PESQ/MCD/WER Δ vs that export (PESQ phr: the short-phrase slice); * = the fp32 reference itself; "
    "(peer) = not built by kokoro-opt"
)


def _cell(result: EvalResult, metric: str, fmt: str) -> str:
    value = result.metric(metric)
    return fmt.format(value) if math.isfinite(value) else "–"


def results_table(results: list[EvalResult], title: str, columns: list[tuple[str, str, str]] = COLUMNS) -> Table:
    table = Table(title=title, title_justify="left", caption=CAPTION, caption_justify="left")
    table.add_column("artifact", no_wrap=True)
    shown = [c for c in columns if any(math.isfinite(r.metric(c[1])) for r in results)]  # no all-empty columns
    for header, _, _ in shown:
        table.add_column(header, justify="right", no_wrap=True)
    for r, name in zip(results, distinct_labels(results), strict=True):
        name += ("*" if r.is_reference else "") + (" (peer)" if r.external else "")
        table.add_row(name, *(_cell(r, metric, fmt) for _, metric, fmt in shown))
    return table


def distinct_labels(results: list[EvalResult]) -> list[str]:
    """Each result's label, with its id's first 8 digits where two share a name (two builds of one recipe)."""
    labels = [r.label for r in results]
    return [r.label + (f" {r.artifact_id[:8]}" if labels.count(r.label) > 1 else "") for r in results]


def print_machine(console: Console, fp: dict[str, Any] | None = None) -> None:
    """The one-line machine description (default: this machine), whole even in a pipe or a file."""
    from kokoro_opt.machine import describe, fingerprint

    console.print(describe(fp or fingerprint()), soft_wrap=True, markup=False, highlight=False)


def print_results(results: list[EvalResult], console: Console) -> None:
    """This machine, the evaluation tables, then what was skipped or could not be measured, and where it was logged."""
    from kokoro_opt.machine import fingerprint, same_machine

    if not results:
        console.print("nothing evaluated")
        return
    here = fingerprint()
    print_machine(console, here)
    print_table(console, results_table(results, "evaluation"))
    print_table(console, results_table(results, "details (latency in seconds per utterance)", DETAIL_COLUMNS))
    for r in results:
        if r.skipped:
            console.print(f"{r.label}: already evaluated with these settings (MLflow run {r.run_id}); not measured again")
        elif r.run_id:
            console.print(f"{r.label}: logged to MLflow run {r.run_id}")
        if r.machine.get("id") and not same_machine(r.machine, here):
            console.print(f"{r.label}: measured on another machine (id {r.machine['id']}, {r.machine.get('cpu', '?')})")
        for note in r.notes:  # plain text: a note's "kokoro-opt[asr]" is no markup
            console.print(f"{r.label}: {note}", markup=False, highlight=False)


# ---- plots ----------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of points not dominated in (lower x, better y), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1] if higher_is_better else points[i][1]))
    front: list[int] = []
    best = -math.inf if higher_is_better else math.inf
    for i in order:
        y = points[i][1]
        if (y > best) if higher_is_better else (y < best):
            front.append(i)
            best = y
    return front


def pareto_png(results: list[EvalResult], path: Path) -> Path | None:
    """RTF vs PESQ (and vs WER when measured), Pareto front joined; None when nothing is plottable."""
    panels = [("pesq_mean", "PESQ-WB vs fp32 (higher is better)", True), ("wer", "WER (lower is better)", False)]
    panels = [p for p in panels if any(math.isfinite(r.metric(p[0])) and math.isfinite(r.metric("rtf_p50")) for r in results)]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (metric, ylabel, higher) in zip(axes[0], panels, strict=True):
        shown = [(r, name) for r, name in zip(results, distinct_labels(results), strict=True)
                 if math.isfinite(r.metric(metric)) and math.isfinite(r.metric("rtf_p50"))]  # fmt: skip
        points = [(r.metric("rtf_p50"), r.metric(metric)) for r, _ in shown]
        for (r, name), (x, y) in zip(shown, points, strict=True):
            ax.scatter([x], [y], marker="s" if r.external else "o", s=40)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        front = pareto_front(points, higher)
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "--", color="grey", linewidth=1)
        ax.set_xlabel("RTF p50 (synthesis time / audio time, lower is faster)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    peers = "; squares: peers" if any(r.external for r in results) else ""
    fig.suptitle(f"kokoro-opt: speed vs quality (dashed: the Pareto front{peers})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ops_png(op_times: dict[str, float], path: Path, title: str) -> Path | None:
    if not op_times:
        return None
    plt = _pyplot()
    top = list(op_times.items())[:12]
    total = sum(op_times.values())
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh([k for k, _ in reversed(top)], [100 * v / total for _, v in reversed(top)])
    ax.set_xlabel("% of kernel time (one utterance, ORT profile)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mel_png(reference: np.ndarray, test: np.ndarray, sample_rate: int, path: Path, title: str) -> Path:
    from kokoro_opt.evaluate.metrics import MEL_HOP, log_mel

    plt = _pyplot()
    mels = [10 / math.log(10) * log_mel(audio, sample_rate) for audio in (reference, test)]  # natural log -> dB
    top = max(float(m.max()) for m in mels)
    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=False)
    for ax, mel, name in zip(axes, mels, ("fp32 reference", "this artifact"), strict=True):
        seconds = mel.shape[1] * MEL_HOP / sample_rate
        # one colour scale for both panels, so that a colour is the same level in each
        shown = ax.imshow(
            mel, origin="lower", aspect="auto", cmap="magma", vmin=top - 80, vmax=top, extent=(0, seconds, 0, mel.shape[0])
        )
        ax.set_ylabel(f"{name}\nmel bin")
        fig.colorbar(shown, ax=ax, label="dB")
    axes[-1].set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ops_json(op_times: dict[str, float]) -> str:
    """The per-op profile as a file: seconds and share of the run per ONNX op type, largest first."""
    total = sum(op_times.values())
    rows = [{"op": op, "seconds": s, "share": s / total if total else 0.0} for op, s in op_times.items()]
    return json.dumps({"total_seconds": total, "ops": rows}, indent=2)


def precision_summary(folder: Path) -> dict[str, Any]:
    """What the artifact was built as: node counts per precision from its precision_map.json."""
    path = folder / "precision_map.json"
    if not path.is_file():
        return {}
    recorded = json.loads(path.read_text(encoding="utf-8"))
    counts = Counter(str(precision) for precision in recorded.get("nodes", {}).values())
    exceptions = {"fp32_exception_nodes": len(recorded["fp32_exceptions"])} if "fp32_exceptions" in recorded else {}
    return {**{f"{k}_nodes": v for k, v in sorted(counts.items())}, **exceptions}
