"""Synthesis API: voices, blending, text splitting over the 510-token context."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.model import style_for
from kokoro_opt.runtime import synthesize
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.voices import blend_voice, parse_blend, unknown_voice


def test_parse_blend_normalises_weights() -> None:
    assert parse_blend("a(2)+b(1)") == [("a", pytest.approx(2 / 3)), ("b", pytest.approx(1 / 3))]
    assert parse_blend("solo") == [("solo", 1.0)]
    with pytest.raises(UserError, match=r"voice 'a\(0\)\+b' gives a a weight of 0"):  # it would change nothing
        parse_blend("a(0)+b")
    with pytest.raises(UserError, match="cannot read voice"):
        parse_blend("a(2)+")


def test_blend_is_the_weighted_mean_and_unknown_voices_list_the_known() -> None:
    packs = {"a": np.ones((510, 1, 256), np.float32), "b": np.zeros((510, 1, 256), np.float32)}
    assert np.allclose(blend_voice("a(3)+b(1)", packs), 0.75)
    assert np.allclose(blend_voice("A(3)+B(1)", packs), 0.75)  # in any case, as the server reads names
    with pytest.raises(UserError, match=r"unknown voice 'c'.*a, b"):
        blend_voice("a+c", packs)
    with pytest.raises(UserError, match=r"unknown voice 'Cx'"):  # the unknown one, as written, not the known 'A'
        blend_voice("A(2)+Cx(1)", packs)
    assert unknown_voice("A(2)+b(1)", ["a", "b"]) is None and unknown_voice("a+NOPE", ["a", "b"]) == "NOPE"
    assert unknown_voice("Alloy", ["af_heart"]) is None  # OpenAI's names, in any case, as blend_voice takes them


def test_style_is_indexed_by_phoneme_count() -> None:
    pack = np.arange(510, dtype=np.float32)[:, None, None] * np.ones((1, 1, 256), np.float32)
    assert style_for(pack, 1)[0, 0] == 0 and style_for(pack, 40)[0, 0] == 39
    assert style_for(pack, 10_000)[0, 0] == 509


def test_long_text_is_split_not_truncated(tiny_artifact) -> None:
    synth = Synthesizer(tiny_artifact)
    sentence = "The quick brown fox jumps over the lazy dog near the riverbank. "
    long_text = sentence * 14  # ~900 tokens: more than one 510-token context
    result = synth.synthesize(long_text, voice="tiny_0")
    one = synth.synthesize(sentence, voice="tiny_0")
    assert len(result.durations) > 510
    assert result.seconds > 10 * one.seconds


def test_a_file_is_spoken_in_whole_sentences_and_streamed_as_it_is_made(tiny_artifact) -> None:
    """No small first chunk for a file: a sentence within the model's context is one utterance (a cut would put
    Kokoro's end-of-utterance silence and intonation mid-sentence); `stream` yields what `synthesize` joins."""
    synth = Synthesizer(tiny_artifact)
    sentence = "When the sunlight strikes raindrops in the air, they act as a prism and form a rainbow of colours."
    counted: list[tuple[int, int]] = []
    whole = synth.synthesize(sentence + " It is lovely.", on_chunk=lambda done, total: counted.append((done, total)))
    assert counted == [(1, 1)]  # two sentences, ~100 tokens: one chunk
    parts = list(synth.stream(sentence + " It is lovely."))
    assert len(parts) == 1 and np.array_equal(parts[0].audio, whole.audio)
    long_text = sentence + " " + " ".join(["The rain fell softly on the quiet town, and everyone slept."] * 12)
    parts = list(synth.stream(long_text))
    assert len(parts) > 1 and np.array_equal(np.concatenate([p.audio for p in parts]), synth.synthesize(long_text).audio)
    with pytest.raises(UserError, match="nothing to say"):  # checked when asked, not at the first part
        synth.stream("  ")
    with pytest.raises(UserError, match="voice must be a name or a blend"):
        synth.stream("Hello.", voice=None)  # type: ignore[arg-type]


def test_the_library_refuses_a_folder_changed_since_it_was_built(tiny_artifact, tmp_path) -> None:
    """As `say` and `serve` do: a kokoro.json edited to four times the gain spoke at a quarter of the volume."""
    import json
    import shutil

    changed = tmp_path / "tiny" / tiny_artifact.id
    shutil.copytree(tiny_artifact.path, changed)
    meta = json.loads((changed / "kokoro.json").read_text())
    (changed / "kokoro.json").write_text(json.dumps({**meta, "audio_gain": 4 * meta.get("audio_gain", 1.0)}))
    with pytest.raises(UserError, match=r"kokoro\.json does not match its manifest"):
        synthesize(changed, "Hello.")
    manifest = json.loads((changed / "manifest.json").read_text())
    shutil.copy(tiny_artifact.path / "kokoro.json", changed / "kokoro.json")
    (changed / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))  # nothing left to check against
    with pytest.raises(UserError, match="its manifest lists no file hashes"):
        synthesize(changed, "Hello.")


def test_synthesize_checks_its_input(tiny_artifact) -> None:
    with pytest.raises(UserError, match="speed"):
        synthesize(tiny_artifact, "Hello.", voice="tiny_0", speed=10)
    assert synthesize(tiny_artifact, "Hi.", voice="tiny_0", speed=np.float32(1.5)).seconds > 0  # any real number
    assert synthesize(tiny_artifact, "Hi.", voice="tiny_0", speed=Decimal("1.5")).seconds > 0
    with pytest.raises(UserError, match="speed must be a number, not str"):  # not "out of range"
        synthesize(tiny_artifact, "Hello.", voice="tiny_0", speed="1")
    for huge in (10**400, Decimal("sNaN")):  # compared as given: float() would overflow or refuse
        with pytest.raises(UserError, match="out of range"):
            synthesize(tiny_artifact, "Hello.", voice="tiny_0", speed=huge)
    for name, bad in (("text", {"text": b"Hi."}), ("phonemes", {"phonemes": 5}), ("text", {"text": "caf\udce9"})):
        with pytest.raises(UserError, match=f"^{name} (must be a string|has an invalid character at position 3)"):
            synthesize(tiny_artifact, voice="tiny_0", **bad)
    for nothing in ("   ", "-", "...", "?!", "(…)"):  # pauses alone would be a breath: not what was asked for
        with pytest.raises(UserError, match="nothing to say"):
            synthesize(tiny_artifact, nothing, voice="tiny_0")
    with pytest.raises(UserError, match="nothing to say"):
        synthesize(tiny_artifact, phonemes="…", voice="tiny_0")
    assert synthesize(tiny_artifact, "%", voice="tiny_0").seconds > 0  # a symbol with a name is spoken
    with pytest.raises(UserError, match="exactly one"):
        synthesize(tiny_artifact, "Hi", phonemes="hˈI", voice="tiny_0")
    result = synthesize(tiny_artifact, phonemes="həlˈO wˈɜɹld.", voice="tiny_0(1)+tiny_1(1)")
    assert result.sample_rate == 24000 and np.all(np.isfinite(result.audio))


def test_profiles_are_written_to_the_temporary_folder_not_the_working_one(tiny_artifact, tmp_path, monkeypatch) -> None:
    """A run killed before it reads its profile back leaves the file behind (tens of MB on the real model)."""
    import tempfile
    from pathlib import Path

    from kokoro_opt.runtime.session import SessionSettings

    monkeypatch.chdir(tmp_path)
    synth = Synthesizer(tiny_artifact, SessionSettings(intra_op_num_threads=1, enable_profiling=True))
    synth.synthesize("Hi.", voice=synth.voices[0])
    traces = synth.end_profiling()
    try:
        assert traces and all(t.parent == Path(tempfile.gettempdir()) and t.is_file() for t in traces)
        assert len(set(traces)) == len(traces) and list(tmp_path.iterdir()) == []
    finally:
        for trace in traces:
            trace.unlink(missing_ok=True)
