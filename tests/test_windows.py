"""Windowed decoding (the `windows` stage, kokoro_opt/runtime/windowed.py): the graph split reproduces the model,
windows tile the speech, statistics follow voices and blends, the server streams window by window.
Quality on the real weights: tests/test_real_weights.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.passes.windows import MomentsProbe
from kokoro_opt.passes.windows_split import STATS_INPUT, split, window_graphs
from kokoro_opt.recipe import parse_recipe
from kokoro_opt.runtime.norm_stats import StatsTable, stats_from_moments
from kokoro_opt.runtime.stats_predictor import PREDICTOR_FILE, StatsPredictor
from kokoro_opt.runtime.steps import speech_steps, window_spans
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.runtime.windowed import (
    STEP_SAMPLES,
    WINDOWS_DIR,
    FrontOutput,
    WindowedDecoder,
    WindowGraphs,
    WindowSettings,
    load_statistics,
)
from kokoro_opt.text import utterance_tokens
from kokoro_opt.voices import blend_voice, style_for
from tests.test_passes import TOKENS, build_with

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

LENGTHS = (TOKENS[:3], TOKENS[:12], TOKENS, TOKENS * 4)
WINDOWS = {
    "kind": "windows",
    "first_steps": 6,
    "steps": 16,
    "overlap_steps": 16,
    "calibration_sentences": 2,
    "check_sentences": 2,
    "check_phrases": 1,
}


@pytest.fixture(scope="module")
def plain(tiny_recipe, artifacts_root):
    return build_with(tiny_recipe, artifacts_root, "t-windows-plain", [{"kind": "simplify"}]).artifact


@pytest.fixture(scope="module")
def windowed(tiny_recipe, artifacts_root):
    return build_with(tiny_recipe, artifacts_root, "t-windows", [{"kind": "simplify"}, WINDOWS]).artifact


def split_decoder(artifact, **variant: bool) -> WindowedDecoder:
    """A decoder over `artifact`'s graph split here (what the windows stage writes), without statistics."""
    graphs, _ = window_graphs(onnx.load(str(artifact.model_file)), **variant)
    return WindowedDecoder(Synthesizer(artifact), graphs)


@pytest.fixture(scope="module")
def decoder(plain):
    return split_decoder(plain)


@pytest.fixture(scope="module")
def probe(plain):
    synth = Synthesizer(plain)
    return MomentsProbe(synth, onnx.load(str(plain.model_file)))


def test_window_spans_tile_the_range_without_slivers() -> None:
    assert window_spans(10, 110, 24, 40) == [(10, 34), (34, 74), (74, 110)]  # 36 > 40 // 4: its own window
    assert window_spans(0, 30, 24, 40) == [(0, 30)]  # 6 left < 10: folded into the first
    assert window_spans(5, 6, 24, 40) == [(5, 6)]
    for start, end in [(0, 1), (3, 500), (40, 41), (0, 1000)]:
        spans = window_spans(start, end, 7, 33)
        assert spans[0][0] == start and spans[-1][1] == end
        assert all(a < b and b == c for (a, b), (c, _) in zip(spans, [*spans[1:], (end, 0)], strict=True))


def test_speech_steps_skip_the_edge_silence_the_durations_give() -> None:
    symbols = {1: "h", 2: "i", 3: "."}
    durations = np.array([12, 3, 4, 9, 10])  # pad, h, i, '.', pad
    assert speech_steps(durations, [1, 2, 3], symbols, 2, 6) == (2 * 10, 2 * (38 - 19 + 6))
    assert speech_steps(durations, [1, 2], {1: "h", 2: "i"}, 40, 60) == (0, 2 * 38)  # never past the utterance


def test_exact_statistics_reproduce_the_whole_model(decoder, probe) -> None:
    """Front + generator fed this utterance's own statistics = the unsplit model (the split loses nothing)."""
    synth = decoder.synth
    for tokens in LENGTHS:
        style = style_for(synth.packs["tiny_0"], len(tokens))
        whole = synth.run_tokens(tokens, "tiny_0")
        front = decoder.front(tokens, style)
        np.testing.assert_array_equal(front.durations, whole.durations)
        _, mean, var = probe.moments(tokens, style)
        audio = decoder.window(front, 0, front.steps, stats_from_moments(mean, var))
        assert len(audio) == len(whole.audio) == front.steps * STEP_SAMPLES
        np.testing.assert_allclose(audio, whole.audio, atol=2e-3 * float(np.abs(whole.audio).max()))


def test_windows_with_enough_overlap_equal_one_window(decoder, probe) -> None:
    """Cutting into windows changes nothing once the overlap covers the generator's receptive field."""
    synth = decoder.synth
    tokens = TOKENS * 4
    style = style_for(synth.packs["tiny_0"], len(tokens))
    front = decoder.front(tokens, style)
    stats = stats_from_moments(*probe.moments(tokens, style)[1:])
    whole = decoder.window(front, 0, front.steps, stats)
    spans = window_spans(0, front.steps, 6, 16)
    assert len(spans) > 4
    default = decoder.settings
    try:
        decoder.settings = WindowSettings(overlap_steps=16)
        pieces = np.concatenate([decoder.window(front, a, b, stats) for a, b in spans])
        np.testing.assert_allclose(pieces, whole, atol=1e-4 * float(np.abs(whole).max()))
        decoder.settings = WindowSettings(overlap_steps=0)  # no context: the seams differ
        bare = np.concatenate([decoder.window(front, a, b, stats) for a, b in spans])
        assert np.abs(bare - whole).max() > 1e-2 * float(np.abs(whole).max())
    finally:
        decoder.settings = default  # the module's other tests share this decoder


def test_the_per_job_part_computed_once_gives_every_window_the_same_audio(decoder, probe, plain) -> None:
    """Hoisting the style and statistics work out of the windows (kokoro_opt/passes/hoisting.py) changes where it
    runs, not what it computes: the same windows as the generator run whole each time."""
    per_window = split_decoder(plain, hoisting=False)
    per_window.settings = decoder.settings
    assert decoder.constant_names and per_window.constants_session is None
    synth = decoder.synth
    tokens = TOKENS * 4
    style = style_for(synth.packs["tiny_0"], len(tokens))
    front = decoder.front(tokens, style)
    stats = stats_from_moments(*probe.moments(tokens, style)[1:])
    constants = decoder.job_constants(front, stats)
    for a, b in window_spans(0, front.steps, 6, 16):
        hoisted = decoder.window(front, a, b, stats, constants=constants)
        whole = per_window.window(front, a, b, stats)
        np.testing.assert_allclose(hoisted, whole, atol=1e-5 * float(np.abs(whole).max()) + 1e-9)


def test_the_split_keeps_the_edges_input_feedable(tiny_recipe, artifacts_root) -> None:
    capped = build_with(
        tiny_recipe, artifacts_root, "t-edges", [{"kind": "simplify"}, {"kind": "edges", "lead_frames": 1, "trail_frames": 1}]
    ).artifact
    front, generator, channels, whole_generator = split(onnx.load(str(capped.model_file)))
    assert "edge_keep" in {i.name for i in front.graph.input}
    assert {i.name for i in generator.graph.input} == {"features", "f0", "phase", "decoder_style", STATS_INPUT}
    assert {i.name for i in whole_generator.graph.input} == {"features", "f0", "phase", "decoder_style"}
    assert [n for n in whole_generator.graph.node if n.op_type == "InstanceNormalization"]  # its own statistics
    # the harmonic source (sines per audio sample, its STFT) runs per window, not in the front
    assert not [n for n in front.graph.node if n.op_type in ("Sin", "Atan")]
    assert not [n for n in generator.graph.node if n.op_type == "InstanceNormalization"]
    assert len(channels) > 0 and all(c > 0 for c in channels)


def test_a_window_phase_drops_whole_turns_only() -> None:
    """Each window's phase starts within one turn, per harmonic, and gives the same sines as the running sum."""
    rng = np.random.default_rng(0)
    running = np.cumsum(rng.uniform(0, 40, size=(1, 9, 3000)), axis=2).astype(np.float32)  # ~6e4 rad at the end
    front = FrontOutput(
        np.zeros((1, 4, 3000), np.float32),
        np.zeros((1, 1, 3000), np.float32),
        running,
        np.zeros((1, 128), np.float32),
        np.zeros(3, np.int64),
    )
    for lo, hi in [(0, 24), (1000, 1080), (2900, 3000)]:
        window = front.phase_from(lo, hi)
        assert window.dtype == np.float32 and window.shape == (1, 9, hi - lo)
        assert np.all((window[:, :, 0] >= 0) & (window[:, :, 0] < 2 * np.pi))
        np.testing.assert_allclose(np.sin(window), np.sin(running[:, :, lo:hi].astype(np.float64)), atol=1e-2)
        turns = (running[:, :, lo:hi].astype(np.float64) - window) / (2 * np.pi)
        np.testing.assert_allclose(turns, np.round(turns), atol=1e-3)


def test_statistics_of_a_blend_are_the_mixed_moments() -> None:
    rng = np.random.default_rng(0)
    packs = {"a": rng.normal(size=(4, 1, 8)), "b": rng.normal(size=(4, 1, 8)), "c": rng.normal(size=(4, 1, 8))}
    mean = rng.normal(size=(3, 2, 5)).astype(np.float32)
    var = rng.uniform(0.5, 2.0, size=(3, 2, 5)).astype(np.float32)
    table = StatsTable(["a", "b", "c"], np.array([10.0, 100.0], dtype=np.float32), mean, var)
    weights = table.weights(blend_voice("a(3)+c(1)", packs), packs)
    np.testing.assert_allclose(weights, [0.75, 0.0, 0.25], atol=1e-6)  # packs blend in float32
    short, long = table.stats(weights, 12.0), table.stats(weights, 300.0)  # nearest bucket by length
    mixed_mean = 0.75 * mean[0, 0] + 0.25 * mean[2, 0]
    mixed_var = 0.75 * (var[0, 0] + mean[0, 0] ** 2) + 0.25 * (var[2, 0] + mean[2, 0] ** 2) - mixed_mean**2
    np.testing.assert_allclose(short, stats_from_moments(mixed_mean, mixed_var), rtol=1e-5)
    assert not np.allclose(short, long)
    np.testing.assert_allclose(table.stats(table.weights(packs["b"], packs), 100.0)[0], mean[1, 1], rtol=1e-6)
    # the packs' Gram matrix is kept between jobs, and made again for other packs of the same names
    others = {name: rng.normal(size=(4, 1, 8)) for name in packs}
    np.testing.assert_allclose(table.weights(blend_voice("b(1)+c(1)", others), others), [0.0, 0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose(table.weights(packs["a"], packs), [1.0, 0.0, 0.0], atol=1e-6)
    # two equal packs: no error, the mix split evenly between them (the least-norm answer)
    twins = {"a": packs["a"], "b": packs["a"].copy(), "c": packs["c"]}
    np.testing.assert_allclose(table.weights(packs["a"], twins), [0.5, 0.5, 0.0], atol=1e-6)


def test_the_stage_stores_statistics_and_speaks_window_by_window(windowed, plain) -> None:
    record = windowed.build.stages[-1]
    assert record["stage"] == "windows" and record["gate"]["utterances"]
    assert record["gate"]["judged"] is False  # random weights: scored, never judged (speech_gate.speaks)
    assert windowed.kokoro["windows"]["first_steps"] == 6
    np.testing.assert_array_equal(  # the graph is the source's: evaluations and compare see the same audio
        Synthesizer(windowed).run_tokens(TOKENS, "tiny_0").audio, Synthesizer(plain).run_tokens(TOKENS, "tiny_0").audio
    )
    assert {p.name for p in (windowed.path / WINDOWS_DIR).iterdir()} == {
        "front.onnx",
        "job.onnx",
        "generator.onnx",
        "whole_generator.onnx",
        PREDICTOR_FILE,
    }
    decoder = WindowedDecoder.of_artifact(Synthesizer(windowed))
    assert isinstance(decoder.statistics, StatsPredictor)
    job = decoder.start(TOKENS * 3, windowed.voice_packs()["tiny_0"])
    assert job.steps_left > 40
    audio = [decoder.next_window(job)]  # the stored first window size
    assert len(audio[0]) == 6 * STEP_SAMPLES
    audio.append(decoder.next_window(job, steps=10))  # a size the server chose
    assert len(audio[1]) == 10 * STEP_SAMPLES
    while not job.done:
        audio.append(decoder.next_window(job))
    assert job.windows == len(audio) > 3 and job.cursor == job.speech[1]
    assert sum(map(len, audio)) == (job.speech[1] - job.speech[0]) * STEP_SAMPLES
    assert all(np.all(np.isfinite(a)) and len(a) for a in audio)


def test_a_short_job_finishes_with_the_whole_decoding_of_its_front(windowed) -> None:
    """After its first window, a job of at most finish_steps steps gets the rest from one whole-generator run:
    sample for sample what whole decoding (the unsplit model) makes of the utterance. A longer job is windows
    to the end; speak() is what a lone listener hears."""
    synth = Synthesizer(windowed)
    decoder = WindowedDecoder.of_artifact(synth)
    pack = windowed.voice_packs()["tiny_0"]
    tokens = TOKENS
    job = decoder.start(tokens, pack)
    assert job.finish, (job.front.steps, decoder.settings.finish_steps)
    first = decoder.next_window(job)
    rest = decoder.finish(job)
    assert job.done and job.windows == 2
    whole = decoder.whole_audio(job.front)
    a, b = job.speech
    np.testing.assert_array_equal(rest, whole[a * STEP_SAMPLES + len(first) : b * STEP_SAMPLES])
    # the front and the whole generator are fused as the whole model is: its audio, bit for bit
    np.testing.assert_array_equal(whole, synth.run_tokens(tokens, "tiny_0").audio)
    spoken, spoken_job = decoder.speak(tokens, pack)
    np.testing.assert_array_equal(spoken[len(first) :], rest)
    assert spoken_job.windows == 2
    bridged = decoder.start(tokens, pack)  # a first window, one with wider context (serve's bridge), the finish
    parts = [decoder.next_window(bridged), decoder.next_window(bridged, 6, overlap=8), decoder.finish(bridged)]
    assert np.concatenate(parts).shape == whole[a * STEP_SAMPLES : b * STEP_SAMPLES].shape
    np.testing.assert_array_equal(parts[2], whole[a * STEP_SAMPLES + len(parts[0]) + len(parts[1]) : b * STEP_SAMPLES])
    # Nobody hears it before it ends: only finished, without the per-job part a window needs.
    unheard = decoder.start(tokens, pack, windows=False)
    assert unheard.stats is None and unheard.constants is None
    with pytest.raises(UserError, match="started without windows"):
        decoder.next_window(unheard)
    np.testing.assert_array_equal(decoder.finish(unheard), whole[a * STEP_SAMPLES : b * STEP_SAMPLES])
    default = decoder.settings
    try:
        decoder.settings = WindowSettings(**{**default.__dict__, "finish_steps": job.front.steps - 1})
        longer = decoder.start(tokens, pack)
        assert not longer.finish
        assert decoder.start(tokens, pack, windows=False).stats is not None  # it will need windows
        assert decoder.speak(tokens, pack)[1].windows > 2  # windows to the end
    finally:
        decoder.settings = default


def test_the_statistics_are_locked_beside_the_recipe_and_applied_without_measuring(
    tiny_recipe, artifacts_root, windowed, tmp_path
) -> None:
    """Measuring the statistics is most of the windows stage's time: a build writes them beside the recipe's lock
    (recipes/<name>.lock.d/) with their sha256 in it, and a build with that lock loads them instead, on any
    machine: the same statistics, the same graphs, its own gate run again."""
    from kokoro_opt.build import build
    from kokoro_opt.hashing import file_sha256
    from kokoro_opt.locks import files_folder, read_lock

    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name="t-windows", stages=[{"kind": "simplify"}, WINDOWS])
    recipe, lock = parse_recipe(data), tmp_path / "t-windows.lock.json"
    measured = build(recipe, artifacts_root, lock=lock)  # the `windowed` fixture's build: cached
    assert measured.artifact.id == windowed.id and measured.lock_written == lock
    entry = read_lock(lock)["1:windows"]
    kept = files_folder(lock, "1:windows") / "windows" / PREDICTOR_FILE
    assert entry.files == {f"windows/{PREDICTOR_FILE}": file_sha256(kept)}
    applied = build(recipe, artifacts_root, lock=lock)
    record = applied.artifact.build.stage("windows")
    assert record["statistics_from"] == "lock" and applied.artifact.id != windowed.id  # the lock is in its key
    for name in (PREDICTOR_FILE, "generator.onnx"):
        assert file_sha256(applied.artifact.path / "windows" / name) == file_sha256(windowed.path / "windows" / name)
    kept.write_bytes(b"changed")  # a damaged lock is refused, naming the file and the fix
    with pytest.raises(UserError, match=r"missing or changed.*--reanalyze"):
        build(recipe, artifacts_root, lock=lock)


def test_windowed_serving_needs_the_stage(plain) -> None:
    with pytest.raises(UserError, match="windows stage"):
        WindowedDecoder.of_artifact(Synthesizer(plain))


def test_windowed_sessions_spin_within_a_run_unless_two_workers_share_the_cores(windowed) -> None:
    """One worker: a session's threads spin while its run lasts and stop when it returns, so the next session
    finds the cores free. Two workers: never, or one run's spinning pool takes the cores from the other's."""

    def entry(options, key: str) -> str | None:
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # not set: ONNX Runtime's default
            return None

    for runs, expected in ((1, ("1", None)), (2, (None, "0"))):
        decoder = WindowedDecoder.of_artifact(Synthesizer(windowed, load=False), runs_at_once=runs)
        for session in (decoder.front_session, decoder.generator_session):
            options = session.get_session_options()
            found = (entry(options, "session.force_spinning_stop"), entry(options, "session.intra_op.allow_spinning"))
            assert found == expected, runs


def test_a_profiled_evaluation_of_a_windowed_artifact_leaves_no_trace_behind(windowed, tmp_path, monkeypatch) -> None:
    """The evaluation profiles the synthesizer and reads back (then deletes) the traces it ends; the windowed decoder
    it also loads is never profiled, or each of its sessions writes a trace into the temporary folder when freed."""
    import gc
    import tempfile

    from kokoro_opt.runtime.session import SessionSettings

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    synth = Synthesizer(windowed, SessionSettings(intra_op_num_threads=1, enable_profiling=True))
    decoder = WindowedDecoder.of_artifact(synth)
    decoder.speak(utterance_tokens("Hi there.", synth.vocab), synth.packs[synth.voices[0]])
    synth.synthesize("Hi.", voice=synth.voices[0])
    for trace in synth.end_profiling():
        trace.unlink()
    del decoder, synth
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_stage_that_rewrites_the_graph_cannot_follow_windows(tiny_recipe) -> None:
    """The order rule follows from the passes' declarations: simplify keeps no capability, so it would drop
    the windowed graphs; ort converts them too, so it may follow."""
    from kokoro_opt.build import chain_of

    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data["stages"] = [WINDOWS, {"kind": "simplify"}]
    with pytest.raises(UserError, match="stage 'simplify' after stage 'windows' drops what 'windows' made \\(windowed\\)"):
        chain_of(parse_recipe(data))
    data["stages"] = [{"kind": "edges"}, WINDOWS, {"kind": "ort"}]
    assert [p.kind for p in chain_of(parse_recipe(data))] == ["edges", "windows", "ort"]
    data["stages"] = [{"kind": "fuse"}]  # refused before any weights are read, not after the export
    with pytest.raises(UserError, match=r"stage 'fuse' needs what a 'windows' stage makes \(windowed\)") as refused:
        chain_of(parse_recipe(data))
    assert refused.value.hint == "put 'fuse' after a 'windows' stage"


def test_the_predictor_recovers_a_linear_law_and_survives_a_round_trip(tmp_path) -> None:
    """Means and log-variances that follow the summary linearly are predicted to within the stored float16's
    rounding; the file gives the same predictions."""
    rng = np.random.default_rng(0)
    summaries = rng.normal(size=(400, 30))
    summaries[:, 7] = 1.0  # a column that never moves (an F0 band no voice reaches) is kept, not divided by 0
    law = rng.normal(size=(30, 16)) / 6
    means, log_var = summaries @ law[:, :8], summaries @ law[:, 8:]
    predictor = StatsPredictor.fit(summaries, means, np.exp(log_var), alpha=1e-6, rank=16)
    probe = rng.normal(size=30)
    probe[7] = 1.0
    mean, var = predictor.moments(probe)
    np.testing.assert_allclose(mean, probe @ law[:, :8], atol=5e-3)
    np.testing.assert_allclose(np.log(var), probe @ law[:, 8:], atol=5e-3)
    predictor.save(tmp_path / PREDICTOR_FILE)
    again = StatsPredictor.load(tmp_path / PREDICTOR_FILE).moments(probe)
    np.testing.assert_array_equal(again[0], mean)
    low = StatsPredictor.fit(summaries, means, np.exp(log_var), alpha=1e-6, rank=2)  # rank caps what it can follow
    assert np.abs(low.moments(probe)[0] - mean).max() > 1e-2


def _resaved(arrays: dict[str, np.ndarray], **changes: np.ndarray | None) -> dict[str, np.ndarray]:
    return {k: v for k, v in {**arrays, **changes}.items() if v is not None}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: None, r"norm_predictor\.npz is not readable \(BadZipFile"),
        (lambda a: _resaved(a, expand=None), r"has no array 'expand'"),
        (lambda a: _resaved(a, y_mean=a["y_mean"][:-2]), r"'y_mean' is \(\d+,\), where 'project' \(\d+, \d+\) needs"),
        (lambda a: _resaved(a, project=a["project"] * np.float16("nan")), r"'project' is not all finite floats"),
        (lambda a: _resaved(a, x_mean=a["x_mean"].astype(np.int32)), r"'x_mean' is not all finite floats"),
        (lambda a: _resaved(a, project=a["project"][0]), r"'project' \(\d+,\) and 'expand' .* are not matrices"),
    ],
)  # fmt: skip
def test_a_damaged_predictor_is_one_error_when_the_artifact_loads(windowed, tmp_path, change, match) -> None:
    """The predictor comes with the artifact (fetched ones too): a file that is not one is refused with the fix when
    it loads, never a shape error in a request."""
    stored = windowed.path / WINDOWS_DIR / PREDICTOR_FILE
    with np.load(stored) as data:
        arrays = {k: data[k] for k in data.files}
    changed = change(arrays)
    if changed is None:
        (tmp_path / PREDICTOR_FILE).write_bytes(stored.read_bytes()[:80])
    else:
        np.savez(tmp_path / PREDICTOR_FILE, **changed)
    with pytest.raises(UserError, match=match) as refused:
        load_statistics(tmp_path)
    assert refused.value.hint == "rebuild the artifact's windows stage, or fetch the artifact again"


def test_statistics_for_other_norms_are_refused_when_the_decoder_loads(windowed, tmp_path) -> None:
    statistics = load_statistics(windowed.path / WINDOWS_DIR)
    graphs = WindowGraphs.of_folder(windowed.path / WINDOWS_DIR)
    assert WindowedDecoder(Synthesizer(windowed), graphs, statistics).statistics is statistics
    table = StatsTable(["tiny_0"], np.array([50.0], np.float32), *np.ones((2, 1, 1, statistics.channels + 1), np.float32))
    table.save(tmp_path / "norm_stats.npz")
    other = load_statistics(tmp_path)  # an older artifact's table: read when there is no predictor
    assert isinstance(other, StatsTable) and other.channels == statistics.channels + 1
    with pytest.raises(UserError, match=rf"cover {other.channels} norm channels; its graphs read {statistics.channels}"):
        WindowedDecoder(Synthesizer(windowed), graphs, other)
    np.savez(
        tmp_path / "norm_stats.npz",
        voices=np.array(["tiny_0"]),
        frames=np.array([50.0]),
        mean=np.ones((1, 2, 3)),
        var=np.ones((1, 2, 3)),
    )
    with pytest.raises(UserError, match=r"norm_stats\.npz is not a statistics table: 'mean' \(1, 2, 3\)"):
        load_statistics(tmp_path)
    for wrong in ({"voices": np.array("tiny_0")}, {"var": -np.ones((1, 1, 3))}):  # a 0-d list; a negative variance
        arrays = {"voices": np.array(["tiny_0"]), "frames": np.array([50.0]), "mean": np.ones((1, 1, 3))}
        np.savez(tmp_path / "norm_stats.npz", **(arrays | {"var": np.ones((1, 1, 3))} | wrong))
        with pytest.raises(UserError, match=r"norm_stats\.npz is not a statistics table"):
            load_statistics(tmp_path)


def test_predicted_statistics_follow_each_calibration_utterance_better_than_their_average(windowed, probe) -> None:
    """On the tiny model, the stage's predictor is closer to its calibration utterances' exact moments than their
    average is: the summaries it was fitted on belong to the moments they were fitted to."""
    from kokoro_opt.passes.windows import calibration_pieces
    from kokoro_opt.runtime.stats_predictor import front_summary

    decoder = WindowedDecoder.of_artifact(Synthesizer(windowed))
    pack = windowed.voice_packs()["tiny_0"]
    predicted, exact = [], []
    for tokens in calibration_pieces(decoder.synth.vocab, WINDOWS["calibration_sentences"]):
        style = style_for(pack, len(tokens))
        front = decoder.front(tokens, style)
        predicted.append(decoder.statistics.moments(front_summary(front))[0])
        exact.append(probe.moments(tokens, style)[1])
    predicted, exact = np.stack(predicted), np.stack(exact)
    error, spread = np.abs(predicted - exact).mean(), np.abs(exact.mean(0) - exact).mean()
    assert error < 0.5 * spread


def test_the_front_and_the_whole_generator_carry_the_shapes_the_model_declares(windowed) -> None:
    """ONNX Runtime fuses by declared shapes (on the real int8-mixed, ALBERT's Add and LayerNormalization into
    SkipLayerNormalization): cut without them, the front rounded F0 otherwise than the model, and the phase
    SineGen sums from it moved by up to 1e-2 rad. With them, front and whole generator compute the model's audio
    bit for bit (docs/measurements/2026-12-05-front-shapes.md)."""
    model = onnx.load(str(windowed.model_file), load_external_data=False)
    model.graph.value_info.extend(onnx.shape_inference.infer_shapes(model).graph.value_info)  # as quantize declares
    declared = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}
    front, _, _, whole_generator = split(model)
    for part in (front, whole_generator):
        computed = {out for node in part.graph.node for out in node.output}
        carried = {v.name for v in part.graph.value_info}
        assert carried and carried <= computed, "shapes of the part's own tensors"
        assert all(declared[v.name] == v for v in part.graph.value_info)
        assert all(out.type.tensor_type.elem_type for out in part.graph.output), "typed outputs"
