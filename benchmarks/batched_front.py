"""What batching the fronts of listeners who start together could save (docs/serving.md, issue #15).

    python benchmarks/batched_front.py [--tokens 39] [--batch 4] [--threads 2]

Exports the token-rate part of Kokoro's front with a batch axis: ALBERT, its projection, the duration
predictor's text encoder, LSTM and projection, and the acoustic text encoder. Real weights, fp32, all
utterances the same length (padding would cost the same). Then times one batch of `--batch`
utterances against that many runs of one, alternated, in ONNX Runtime. The frame-rate part of the
front (F0/N predictor, the decoder's blocks before the generator) has a different length per
utterance and is not batched here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch


class TokenFront(torch.nn.Module):
    """KModel.forward_with_tokens up to the durations, plus the text encoder: what runs per token."""

    def __init__(self, kmodel: torch.nn.Module) -> None:
        super().__init__()
        self.kmodel = kmodel

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, style: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.kmodel
        lengths, padded = mask.sum(-1), mask == 0
        d_en = m.bert_encoder(m.bert(ids, attention_mask=mask)).transpose(-1, -2)
        d = m.predictor.text_encoder(d_en, style, lengths, padded)
        x, _ = m.predictor.lstm(d)
        durations = torch.sigmoid(m.predictor.duration_proj(x)).sum(-1)
        return durations, d, m.text_encoder(ids, lengths, padded)


def main() -> None:
    import onnxruntime as ort
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.model import load_kmodel
    from kokoro_opt.recipe import load_recipe
    from kokoro_opt.tables import print_table
    from kokoro_opt.weights.sources import resolve_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=39, help="tokens per utterance (the paragraph's first piece: 39)")
    parser.add_argument("--batch", type=int, default=4, help="utterances that start together")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    weights = resolve_weights(load_recipe(Path(__file__).parent.parent / "recipes" / "fp32.yaml").weights, log=lambda _: None)
    front = TokenFront(load_kmodel(weights.config, weights.model_path)).eval()
    rng = np.random.default_rng(0)

    def feed(batch: int) -> dict[str, np.ndarray]:
        return {
            "ids": rng.integers(1, 170, (batch, args.tokens)).astype(np.int64),
            "mask": np.ones((batch, args.tokens), np.int64),
            "style": rng.standard_normal((batch, 128)).astype(np.float32),
        }

    with tempfile.TemporaryDirectory(prefix="kokoro-opt-batched-") as scratch:
        model_file = Path(scratch) / "front.onnx"
        example = tuple(torch.from_numpy(v) for v in feed(1).values())
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's notes on LSTMs and tracing: none apply to a timing
            torch.onnx.export(
                front, example, str(model_file), opset_version=17, dynamo=False,
                input_names=["ids", "mask", "style"], output_names=["durations", "d", "t_en"],
                dynamic_axes={"ids": {0: "batch", 1: "tokens"}, "mask": {0: "batch", 1: "tokens"}, "style": {0: "batch"}},
            )  # fmt: skip
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])

    one, many = feed(1), feed(args.batch)
    for _ in range(3):  # the first runs of each shape allocate
        session.run(None, one), session.run(None, many)
    alone, together = [], []
    for _ in range(args.runs):
        began = time.perf_counter()
        session.run(None, one)
        alone.append(time.perf_counter() - began)
        began = time.perf_counter()
        session.run(None, many)
        together.append(time.perf_counter() - began)
    single, batched = statistics.median(alone) * 1e3, statistics.median(together) * 1e3

    table = Table(title=f"token-rate front, {args.tokens} tokens, {args.threads} ORT threads ({describe(fingerprint())})")
    for column in ("utterances", "one at a time, ms", "one batch, ms", "batch gain"):
        table.add_column(column, justify="right")
    table.add_row("1", f"{single:.1f}", f"{single:.1f}", "1.00x")
    table.add_row(str(args.batch), f"{args.batch * single:.1f}", f"{batched:.1f}", f"{args.batch * single / batched:.2f}x")
    print_table(Console(), table)


if __name__ == "__main__":
    main()
