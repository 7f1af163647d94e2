"""Building Kokoro's PyTorch model (`kokoro.model.KModel`) from a resolved weights folder.

`kokoro.model` is imported lazily: importing `kokoro` pulls misaki and spaCy (~6 s), which the
ONNX-only paths (synthesis, serving) never need.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kokoro_opt.errors import check_torch_file
from kokoro_opt.voices import SAMPLE_RATE, style_for  # noqa: F401  (re-exported for torch-side callers)

KOKORO_82M_CONFIG: dict[str, Any] = {
    "n_token": 178,
    "hidden_dim": 512,
    "style_dim": 128,
    "n_layer": 3,
    "n_mels": 80,
    "max_dur": 50,
    "dim_in": 64,
    "max_conv_dim": 512,
    "dropout": 0.2,
    "text_encoder_kernel_size": 5,
    "multispeaker": True,
    "plbert": {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 2048,
        "max_position_embeddings": 512,
        "num_hidden_layers": 12,
        "dropout": 0.1,
    },
    "istftnet": {
        "upsample_kernel_sizes": [20, 12],
        "upsample_rates": [10, 6],
        "gen_istft_hop_size": 5,
        "gen_istft_n_fft": 20,
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "resblock_kernel_sizes": [3, 7, 11],
        "upsample_initial_channel": 512,
    },
}


# Not a KModel key: KModel hard-codes the decoder's widths (1024 channels, 512 into the generator and
# from the text encoder). `load_kmodel` narrows those blocks when a config carries this key; the real
# config never does.
DECODER_WIDTH_KEY = "decoder_channels"
TINY_HIDDEN_CHANNELS = 128
TINY_DECODER_CHANNELS = 128
TINY_GENERATOR_CHANNELS = 64


def tiny_config(vocab: dict[str, int]) -> dict[str, Any]:
    """A small Kokoro for fast tests: the same graph structure, fewer and narrower layers.

    The ALBERT, the prosody LSTMs, the decoder blocks and the generator shrink. At full width the
    generator alone took 83% of the tiny model's time, so every test waited on it.
    """
    config = copy.deepcopy(KOKORO_82M_CONFIG)
    config["n_layer"] = 1
    config["hidden_dim"] = TINY_HIDDEN_CHANNELS
    config["plbert"].update(hidden_size=64, num_attention_heads=2, intermediate_size=128, num_hidden_layers=2)
    config["istftnet"].update(
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]], upsample_initial_channel=TINY_GENERATOR_CHANNELS
    )
    config[DECODER_WIDTH_KEY] = TINY_DECODER_CHANNELS
    config["vocab"] = dict(vocab)
    return config


def load_kmodel(config: dict[str, Any], model_path: Path | None, disable_complex: bool = True) -> torch.nn.Module:
    """KModel in eval mode; with `model_path=None` it stays randomly initialised (tiny test models)."""
    from kokoro.model import KModel

    from kokoro_opt.runtime.session import default_threads

    if threads := default_threads():  # torch's pool is per process, like ORT's: KOKORO_OPT_THREADS caps both
        torch.set_num_threads(threads)
    if model_path is not None:
        check_torch_file(model_path)
    narrow = DECODER_WIDTH_KEY in config
    # KModel loads its weights while it is built, so narrowed blocks are built first and loaded after.
    source = str(model_path) if model_path is not None and not narrow else _empty_state_path()
    kokoro_config = {k: v for k, v in config.items() if k != DECODER_WIDTH_KEY}
    with warnings.catch_warnings():
        # KModel's own deprecation (weight_norm) and LSTM-dropout warnings are not actionable here.
        warnings.simplefilter("ignore", category=UserWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        model = KModel(repo_id="hexgrad/Kokoro-82M", config=kokoro_config, model=source, disable_complex=disable_complex)
        if narrow:
            _narrow_decoder(model.decoder, int(config[DECODER_WIDTH_KEY]), config)
            if model_path is not None:
                for name, state in torch.load(model_path, map_location="cpu", weights_only=True).items():
                    getattr(model, name).load_state_dict(state, strict=True)
    return model.eval()


def _narrow_decoder(decoder: torch.nn.Module, width: int, config: dict[str, Any]) -> None:
    """Rebuild the decoder's blocks at `width` channels from `hidden_dim` ones, the last one feeding the generator."""
    from kokoro.istftnet import AdainResBlk1d
    from torch.nn.utils import weight_norm

    style, hidden, generator = config["style_dim"], config["hidden_dim"], config["istftnet"]["upsample_initial_channel"]
    residual = decoder.asr_res[0].out_channels
    skip = 2 + residual  # F0, N and the ASR residual re-enter every block
    decoder.asr_res = torch.nn.Sequential(weight_norm(torch.nn.Conv1d(hidden, residual, kernel_size=1)))
    decoder.encode = AdainResBlk1d(hidden + 2, width, style)
    last = len(decoder.decode) - 1
    decoder.decode = torch.nn.ModuleList(
        AdainResBlk1d(width + skip, generator if i == last else width, style, upsample=True if i == last else "none")
        for i in range(last + 1)
    )


def _empty_state_path() -> str:
    """A .pth holding `{}`: KModel then loads nothing and keeps its random initialisation."""
    import tempfile

    path = Path(tempfile.gettempdir()) / "kokoro-opt-empty-state.pth"
    if not path.is_file() or path.stat().st_size == 0:  # shared by every process: written whole, then renamed
        scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({}, scratch)
        os.replace(scratch, path)
    return str(path)


def strip_weight_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Fold weight norm into plain weights so the export is a constant, not 89 ReduceL2 chains."""
    for module in model.modules():
        if hasattr(module, "weight_g") and hasattr(module, "weight_v"):
            torch.nn.utils.remove_weight_norm(module)
    return model


@contextlib.contextmanager
def deterministic_noise() -> Iterator[None]:
    """Zero SineGen's random initial phase and its additive noise.

    With these zeroed the model is a pure function of (tokens, style, speed), so every artifact
    can be compared sample by sample with fp32. The export traced under this context has no
    random ops at all (like the kokoro-onnx int8 graph).
    """
    rand, randn_like = torch.rand, torch.randn_like

    def zeros_rand(*size: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("generator", None)
        return torch.zeros(*size, **kwargs)

    torch.rand = zeros_rand  # type: ignore[assignment]
    torch.randn_like = torch.zeros_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.rand, torch.randn_like = rand, randn_like  # type: ignore[assignment]


@torch.no_grad()
def torch_synthesize(
    model: torch.nn.Module, token_ids: list[int], style: np.ndarray, speed: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Run KModel on token ids (without pads); returns (audio, durations) as numpy."""
    from kokoro_opt.runtime.feeds import feed_arrays

    input_ids = torch.from_numpy(feed_arrays(token_ids, style, speed)[0])
    audio, durations = model.forward_with_tokens(input_ids, torch.from_numpy(style), speed)
    return audio.squeeze().numpy().astype(np.float32), durations.reshape(-1).numpy().astype(np.int64)
