"""Which InstanceNorms can normalize with per-voice table statistics instead of their utterance's own.

    python benchmarks/norm_stats_reach.py [--artifact artifacts/int8-mixed] [--sentences 8 --phrases 12]

Windowed decoding (`serve --windowed`) runs the generator in windows, so its norms cannot see the
whole utterance: they take statistics from the `windows` stage's table (per voice, pooled over
calibration utterances of about the same length). Moving more of the front into the windows would
need the same of the norms there. For each group of norms, this feeds that group table statistics in
the whole graph (every other norm keeps its own), and scores the speech against the unchanged graph
the way the windows gate does (PESQ-WB of the speech region, 4-12 kHz energy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

GROUPS = {  # name -> node-name prefixes of its InstanceNormalization nodes
    "generator (what windows feed)": ("/decoder/generator/",),
    "decoder frame-rate blocks (encode, decode.0-3)": ("/decoder/encode/", "/decoder/decode."),
    "F0 and energy blocks": ("/F0.", "/N."),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--sentences", type=int, default=8)
    parser.add_argument("--phrases", type=int, default=12)
    parser.add_argument("--calibration-sentences", type=int, default=6, help="as the windows stage used in 2026-11")
    args = parser.parse_args()

    import numpy as np
    import onnx
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.evaluate import metrics as M
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.windows import calibration_pieces, utterance_moments
    from kokoro_opt.passes.windows_split import feed_norm_stats, moments_model, norm_channels
    from kokoro_opt.runtime.norm_stats import StatsTable
    from kokoro_opt.runtime.session import make_session
    from kokoro_opt.runtime.steps import speech_steps
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import STATS_INPUT, STEP_SAMPLES
    from kokoro_opt.tables import print_table
    from kokoro_opt.text import utterance_tokens
    from kokoro_opt.voices import style_for

    synth = Synthesizer(args.artifact)
    pieces = calibration_pieces(synth.vocab, args.calibration_sentences)
    utterances = []
    for utterance in load_corpus().utterances(args.sentences, synth.voices, args.phrases):
        tokens = utterance_tokens(utterance.sentence.text, synth.vocab)
        pack = synth.packs[utterance.voice]
        utterances.append((utterance.sentence.kind, tokens, pack, synth.run_tokens(tokens, pack)))

    table = Table(title=f"table statistics per group of norms, {synth.artifact.name} ({describe(fingerprint())})")
    for column in ("norms fed table statistics", "norms", "PESQ sentences: mean", "worst", "phrases: mean", "worst",
                   "4-12 kHz dB (max)"):  # fmt: skip
        table.add_column(column, justify="left" if column.startswith("norms fed") else "right")
    for group, prefixes in GROUPS.items():
        model = onnx.load(str(synth.model_file))
        norms = tuple(n.name for n in model.graph.node if n.op_type == "InstanceNormalization" and n.name.startswith(prefixes))
        session = make_session(moments_model(model, norms)[0].SerializeToString(), synth.settings)
        stats_table = StatsTable.pool({
            voice: [utterance_moments(session, synth.feeds(ids, style_for(pack, len(ids)), 1.0)) for ids in pieces]
            for voice, pack in sorted(synth.packs.items())
        })  # fmt: skip
        del session  # before the fed graph's session is made
        feed_norm_stats(model.graph, norm_channels(model, norms))
        fed = make_session(model.SerializeToString(), synth.settings)
        del model
        scores = []
        for kind, tokens, pack, whole in utterances:
            feeds = synth.feeds(tokens, style_for(pack, len(tokens)), 1.0)
            weights = stats_table.weights(pack, synth.packs)
            feeds[STATS_INPUT] = stats_table.stats(weights, float(np.sum(whole.durations)))
            audio = np.asarray(fed.run(None, feeds)[0], dtype=np.float32).reshape(-1) / synth.audio_gain
            a, b = speech_steps(whole.durations, tokens, synth.symbols, 2, 6)
            reference, fed_audio = whole.audio[a * STEP_SAMPLES : b * STEP_SAMPLES], audio[a * STEP_SAMPLES : b * STEP_SAMPLES]
            scores.append((kind, M.pesq_wb(reference, fed_audio, synth.sample_rate),
                           M.high_band_ratio_db(reference, fed_audio, synth.sample_rate)))  # fmt: skip
        sentences = [s for kind, s, _ in scores if kind != "phrase"]
        phrases = [s for kind, s, _ in scores if kind == "phrase"]
        high_band = max(abs(h) for _, _, h in scores)
        table.add_row(group, str(len(norms)), f"{np.mean(sentences):.2f}", f"{np.min(sentences):.2f}",
                      f"{np.mean(phrases):.2f}", f"{np.min(phrases):.2f}", f"{high_band:.2f}")  # fmt: skip
    print_table(Console(), table)


if __name__ == "__main__":
    main()
