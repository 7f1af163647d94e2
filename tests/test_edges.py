"""Edge capping (the `edges` stage): the decoder skips most of an utterance's edge silence when asked,
and changes nothing when not asked. Quality on the real weights: tests/test_real_weights.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.passes.speech_gate import gate_failures
from kokoro_opt.recipe import EdgesStage
from kokoro_opt.runtime.edges import EDGE_INPUT, FRAME_SAMPLES, KEEP_ALL, edge_keep, final_silence_tokens, removed_frames
from kokoro_opt.runtime.join import PAUSES, Joiner
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.select import resolve_artifact
from kokoro_opt.serve import ServeConfig
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.plan import Piece
from kokoro_opt.voices import style_for
from tests.test_passes import TOKENS, build_with

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

LENGTHS = (TOKENS[:1], TOKENS[:7], TOKENS, TOKENS * 6)
EDGES = {"kind": "edges", "lead_frames": 1, "trail_frames": 1}  # the tiny model gives every token ~2 frames


@pytest.fixture(scope="module")
def plain(tiny_recipe, artifacts_root):
    return build_with(tiny_recipe, artifacts_root, "t-edges-plain", [{"kind": "simplify"}]).artifact


@pytest.fixture(scope="module")
def capped(tiny_recipe, artifacts_root):
    return build_with(tiny_recipe, artifacts_root, "t-edges", [{"kind": "simplify"}, EDGES]).artifact


def test_without_the_feed_the_audio_is_the_source_artifacts(plain, capped) -> None:
    graph = onnx.load(str(capped.model_file)).graph
    assert EDGE_INPUT in {i.name for i in graph.input} and EDGE_INPUT in {i.name for i in graph.initializer}
    before, after = Synthesizer(plain), Synthesizer(capped)
    assert before.edges is None and after.edges == (1, 1)
    for tokens in LENGTHS:
        a, b = before.run_tokens(tokens, "tiny_0"), after.run_tokens(tokens, "tiny_0")
        np.testing.assert_array_equal(a.audio, b.audio)
        np.testing.assert_array_equal(a.durations, b.durations)


@pytest.mark.parametrize("lead, trail", [(1, 1), (3, 4), (6, 8), (KEEP_ALL, 2)])
def test_capping_cuts_exactly_the_frames_the_durations_give(capped, lead: int, trail: int) -> None:
    synth = Synthesizer(capped)
    symbols = {i: s for s, i in capped.kokoro["vocab"].items()}
    for tokens in LENGTHS:
        full = synth.run_tokens(tokens, "tiny_0")
        keep = edge_keep(lead, trail, tokens, symbols)
        feeds = synth.feeds(tokens, style_for(synth.packs["tiny_0"], len(tokens)), 1.0)
        audio = np.asarray(synth.session.run(None, {**feeds, EDGE_INPUT: keep})[0]).reshape(-1)
        cut_lead, cut_trail = removed_frames(full.durations, keep)
        assert len(audio) == len(full.audio) - (cut_lead + cut_trail) * FRAME_SAMPLES
        assert cut_lead == max(int(full.durations[0]) - lead, 0) and len(audio) >= FRAME_SAMPLES


def test_run_tokens_caps_only_when_asked(capped) -> None:
    synth = Synthesizer(capped)
    full, short = synth.run_tokens(TOKENS, "tiny_0"), synth.run_tokens(TOKENS, "tiny_0", cap_edges=True)
    assert len(short.audio) < len(full.audio)
    np.testing.assert_array_equal(full.durations, short.durations)  # the durations always describe the whole utterance


def test_the_ort_format_keeps_the_feed(tiny_recipe, artifacts_root) -> None:
    ort_artifact = build_with(tiny_recipe, artifacts_root, "t-edges-ort", [{"kind": "simplify"}, EDGES, {"kind": "ort"}]).artifact
    synth = Synthesizer(ort_artifact)
    assert synth.edges == (1, 1)
    assert len(synth.run_tokens(TOKENS, "tiny_0", cap_edges=True).audio) < len(synth.run_tokens(TOKENS, "tiny_0").audio)


def test_the_final_pause_tokens_follow_the_punctuation() -> None:
    symbols = {1: ".", 2: "a", 3: ",", 4: "”"}
    assert final_silence_tokens([2, 1], symbols) == 2 and final_silence_tokens([2, 3], symbols) == 2
    assert final_silence_tokens([2, 2], symbols) == 1 and final_silence_tokens([], symbols) == 1
    np.testing.assert_array_equal(edge_keep(6, 8, [2, 4], symbols), [6, 8, 2])


def test_the_trailing_cut_leaves_at_least_one_frame() -> None:
    durations = np.array([3, 1, 20])
    assert removed_frames(durations, np.array([1, 1, 2])) == (2, 20)
    assert sum(removed_frames(durations, np.array([1, 0, 3]))) == 23


def test_the_gate_names_each_budget_it_misses() -> None:
    cfg = EdgesStage(kind="edges")
    good = {"pesq_mean": 4.16, "utterance_pesq_min": 3.82, "phrase_pesq_mean": 3.9, "high_band_db_max": 0.47}
    assert gate_failures(good, cfg) == []
    bad = gate_failures({"pesq_mean": 3.5, "utterance_pesq_min": 2.9, "phrase_pesq_mean": 3.0, "high_band_db_max": 1.5}, cfg)
    assert [r.split(" ")[0] for r in bad] == ["mean", "worst", "phrase", "4-12"]
    assert all(name in " ".join(bad) for name in ("min_pesq", "min_sentence_pesq", "min_phrase_pesq", "max_high_band_db"))
    # speech that PESQ cannot find (silence from a broken model) fails; the tiny model's noise is not judged at all
    unscored = {"pesq_mean": None, "utterance_pesq_min": None, "phrase_pesq_mean": None, "high_band_db_max": 0.0}
    assert gate_failures(unscored, cfg) == ["PESQ found no speech in any utterance (silence or noise)"]


def test_serving_with_capped_edges_needs_the_stage(plain, capped) -> None:
    with pytest.raises(UserError, match="edges stage"):
        ServeConfig.for_selection(resolve_artifact(str(plain.path)), cap_edges=True)
    config = ServeConfig.for_selection(resolve_artifact(str(capped.path)), cap_edges=True, first_chunk_tokens=20)
    engine = Engine(resolve_artifact(str(capped.path)), config)
    engine.attach(Synthesizer(capped))
    uncapped = Engine(resolve_artifact(str(capped.path)), ServeConfig(first_chunk_tokens=20, trim_silence=False))
    uncapped.attach(Synthesizer(capped))
    synth = engine.synth
    pack = synth.packs["tiny_0"]
    a, _ = engine.run_job(Piece(TOKENS), pack, 1.0)
    b, _ = uncapped.run_job(Piece(TOKENS), pack, 1.0)
    assert len(a) < len(b)


def test_a_seam_pause_is_padded_with_silence_when_the_job_ends_early() -> None:
    """A capped job keeps less trailing silence than a sentence's pause: the joiner adds digital silence."""
    rate = 24_000
    speech = np.sin(np.arange(rate // 2) * 0.05).astype(np.float32)
    tail = np.zeros(rate // 10, dtype=np.float32)  # 0.1 s, less than the 0.42 s a sentence end keeps
    out = Joiner(rate, 0.0).push(np.concatenate([speech, tail]), last=False, pause=PAUSES["sentence"])
    silent = len(out) - np.flatnonzero(np.abs(out) > 1e-6)[-1] - 1
    assert abs(silent - round(PAUSES["sentence"] * rate)) <= rate // 100


def test_bench_serve_passes_server_flags_only_to_a_server_it_starts() -> None:
    from pathlib import Path

    from kokoro_opt.serve import bench

    assert bench.serve_args(None, "best", Path("artifacts"), 4, ["--cap-edges"])[-1] == "--cap-edges"
    assert bench.serve_args(None, "best", Path("artifacts"), 4, [])[-1] == "4"
    with pytest.raises(UserError, match="windowed"):
        bench.serve_args("http://127.0.0.1:8880", "best", Path("artifacts"), 4, ["--windowed"])
    tracking = bench.server_flags(False, None, 1, "http://mlflow:5000")  # 'best' as the started server resolves it
    assert tracking == ["--tracking-uri", "http://mlflow:5000"]
    with pytest.raises(UserError, match="tracking-uri"):
        bench.serve_args("http://127.0.0.1:8880", "best", Path("artifacts"), 4, tracking)


def test_a_server_with_capped_edges_speaks(capped) -> None:
    import httpx

    from kokoro_opt.serve import running

    config = ServeConfig.for_selection(resolve_artifact(str(capped.path)), cap_edges=True, first_chunk_tokens=20)
    with running(resolve_artifact(str(capped.path)), config) as base:
        body = {"model": "tts-1", "input": "Hello there. How are you?", "voice": "tiny_0", "response_format": "pcm"}
        for stream in (True, False):
            response = httpx.post(f"{base}/v1/audio/speech", json={**body, "stream": stream}, timeout=60)
            assert response.status_code == 200 and len(response.content) > 24_000  # > 0.5 s of s16 audio


def test_edges_after_fp16_conversion_is_refused(tiny_recipe) -> None:
    """On FP16 graphs the stage's Slices change where ONNX Runtime casts FP16 to FP32 on CPUs without FP16
    kernels: measured on int8-fp16-mixed, the unfed audio moved by 15% of its peak."""
    from kokoro_opt.recipe import parse_recipe

    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name="t-bad", stages=[{"kind": "fp16"}, {"kind": "edges"}])
    with pytest.raises(UserError, match="'edges' cannot follow FP16 conversion"):
        parse_recipe(data)
    data.update(stages=[{"kind": "edges"}, {"kind": "ort"}])
    assert parse_recipe(data).stages[0].kind == "edges"
