"""The fused generator (the `fuse` stage, kokoro_opt/runtime/fused.py, kokoro_opt/runtime/glue): every chain between
INT8 convolutions computes what ONNX Runtime's chain computes, up to its own rounding; synthesis and windowed
finishes run through it; without a C compiler the artifact speaks through model.onnx. Quality on the real
weights: tests/test_real_windows.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kokoro_opt.runtime.fused import FUSED_DIR, FusedGenerator
from kokoro_opt.runtime.fused_plan import BranchSum, NormChain
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.runtime.windowed import WINDOWS_DIR, WindowedDecoder, WindowGraphs
from kokoro_opt.voices import style_for
from tests.test_passes import TOKENS, build_with
from tests.test_windows import WINDOWS

pytestmark = pytest.mark.slow  # several builds: not in make test-fast

INT8 = [
    {"kind": "simplify"},
    {"kind": "snake", "polynomial_degree": 2},
    {"kind": "quantize", "mode": "static", "calibration_sentences": 2, "exclude_nodes": ["/decoder/generator/conv_post/Conv"]},
    WINDOWS,
]
FUSE = {"kind": "fuse", "check_sentences": 2, "check_phrases": 1}


@pytest.fixture(scope="module")
def fused_artifact(tiny_recipe, artifacts_root):
    return build_with(tiny_recipe, artifacts_root, "t-fused", [*INT8, FUSE]).artifact


def generator_feeds(artifact, tokens: list[int], voice: str = "tiny_0") -> dict[str, np.ndarray]:
    decoder = WindowedDecoder.of_artifact(Synthesizer(artifact, load=False))
    front = decoder.front(tokens, style_for(decoder.synth.packs[voice], len(tokens)))
    return front.generator_feeds()


def exact_chain(spec: NormChain, source: np.ndarray, value) -> np.ndarray:
    """A chain in float64 with exact statistics: the truth both ONNX Runtime and the kernels round."""
    y = (source - source.mean(1, keepdims=True)) / np.sqrt(source.var(1, keepdims=True) + spec.eps)
    y = y * value(spec.norm_scale)[:, None] + value(spec.norm_bias)[:, None]
    if spec.post_gain and spec.post_shift:
        y = y * value(spec.post_gain)[:, None] + value(spec.post_shift)[:, None]
    _, a, b = spec.poly
    r = y - np.round(y)
    u = y + (a * r * r + b) * r * r
    name = spec.name
    return np.clip(np.round(u / value(f"{name}.qscale")[:, None]) + value(f"{name}.qzero")[:, None], 0, 255)


def chain_errors(artifact, token_lists: list[list[int]], voice: str = "tiny_0") -> dict[str, dict[str, tuple[float, int]]]:
    """Each chain fed ONNX Runtime's own inputs (checked alone, not with its elders' rounding), its output and
    ONNX Runtime's against `exact_chain`: {chain: {"fused" | "onnxruntime": (share of levels off, most off)}},
    over channels whose input is not constant (there a norm divides float rounding by sqrt(eps)). A stage's branch
    sum has no rounding of its own: it must be ONNX Runtime's, bit for bit."""
    fused = FusedGenerator(artifact.path / FUSED_DIR)
    chains = fused.plan.chains()
    model = onnx.load(str(artifact.path / WINDOWS_DIR / "whole_generator.onnx"))
    graph_inputs = {i.name for i in model.graph.input}
    made = [n for c in chains for n in c.made()]
    watched = dict.fromkeys(n for n in [*(r for c in chains for r in c.reads), *made] if n not in fused.constants)
    for name in (n for n in watched if n not in graph_inputs):
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    found: dict[str, dict[str, tuple[float, int]]] = {}
    for tokens in token_lists:
        feeds = generator_feeds(artifact, tokens, voice)
        reference = {**feeds, **dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))}

        def value(name: str, reference: dict = reference) -> np.ndarray:
            return np.asarray(reference[name] if name in reference else fused.constants[name], np.float64).reshape(-1)

        for chain in chains:
            env = dict(reference)
            if isinstance(chain, BranchSum):
                fused.kernels.run([fused._call(chain, env)])
                np.testing.assert_array_equal(env[chain.out], reference[chain.out])
                found[chain.name] = {"fused": (0.0, 0)}
                continue
            fused.kernels.run([fused._call(chain, env)])
            if chain.x_new:  # the residual add the chain computes is ONNX Runtime's, bit for bit
                np.testing.assert_array_equal(env[chain.x_new], reference[chain.x_new])
            source = reference[chain.x_new or chain.x][0].astype(np.float64)
            if chain.kind == "level":
                source = (source - value(f"{chain.name}.zero")[:, None]) * value(f"{chain.name}.scale")[:, None]
            truth = exact_chain(chain, source, value)
            varied = source.std(axis=1) > 1e-6 * (1 + np.abs(source).max(axis=1))
            for who, made in (("fused", env[chain.out]), ("onnxruntime", reference[chain.out])):
                off = np.abs(made[0].astype(np.float64) - truth)[varied]
                share, most = found.setdefault(chain.name, {}).get(who, (0.0, 0))
                if off.size:
                    found[chain.name][who] = (max(share, float(np.mean(off > 0))), max(most, int(off.max())))
    return found


def test_each_chain_computes_its_exact_value(fused_artifact) -> None:
    """Each chain's levels are the float64 truth's but for a rounding tie now and then; ONNX Runtime's float sums
    are no closer (on the real weights it is the one off, by up to 15 levels on 5% of a channel:
    docs/measurements/2026-12-05-fused-generator.md)."""
    found = chain_errors(fused_artifact, [TOKENS[:4], TOKENS * 3])
    kinds = {c.kind for c in FusedGenerator(fused_artifact.path / FUSED_DIR).plan.chains()}
    assert kinds == {"level", "float", "residual"}, kinds  # the three kinds of chain Kokoro's generator has
    fused = [errors["fused"] for errors in found.values() if "fused" in errors]
    assert len(fused) >= 20 and all(share <= 1e-3 and most <= 1 for share, most in fused), found


def test_the_fused_generator_makes_the_whole_generators_audio(fused_artifact) -> None:
    fused = FusedGenerator(fused_artifact.path / FUSED_DIR)
    whole = ort.InferenceSession(
        str(fused_artifact.path / WINDOWS_DIR / "whole_generator.onnx"), providers=["CPUExecutionProvider"]
    )
    for tokens in (TOKENS[:3], TOKENS, TOKENS * 4):
        feeds = generator_feeds(fused_artifact, tokens)
        expected = whole.run(None, feeds)[0]
        made = fused.run(feeds)
        assert made.shape == expected.shape and np.all(np.isfinite(made))
        assert np.corrcoef(made.reshape(-1), expected.reshape(-1))[0, 1] > 0.99
    assert all(not set(step.release) & set(fused.plan.outputs) for step in fused.plan.steps)


def test_the_gates_make_the_whole_generators_audio_once_per_graph_and_front(fused_artifact) -> None:
    """A build's windows gate and then its fuse gate score against the same whole decoding: made once per graph
    and front, and what is remembered is what the unfused graph makes."""
    from kokoro_opt.passes.windows import WholeReference

    synth = Synthesizer(fused_artifact, load=False)
    unfused = WindowedDecoder(synth, WindowGraphs.of_folder(fused_artifact.path / WINDOWS_DIR))
    pack = synth.packs["tiny_0"]
    short, longer = (unfused.front(t, style_for(pack, len(t))) for t in (TOKENS[:3], TOKENS * 2))
    made = WholeReference(unfused)(short)
    np.testing.assert_array_equal(made, unfused.whole_audio(short))
    assert WholeReference(unfused)(short) is made  # another stage's gate, the same graph
    assert len(WholeReference(unfused)(longer)) > len(made)
    fused = WindowedDecoder.of_artifact(Synthesizer(fused_artifact, load=False))
    assert fused.fused is not None and WholeReference(fused)(short) is not made  # its own audio, never the graph's


def test_a_steps_chains_run_together_make_what_each_makes_alone(fused_artifact, monkeypatch) -> None:
    """Each thread runs all of a step's chains over its own channels, one hand-off for the step: every chain is per
    channel, so that makes what running them one at a time makes, bit for bit."""
    from kokoro_opt.runtime import glue
    from kokoro_opt.runtime.fused_plan import KernelStep

    monkeypatch.setattr(glue, "SPLIT_MIN", 0)  # the tiny model's chains split over two threads like the real ones
    fused = FusedGenerator(fused_artifact.path / FUSED_DIR)
    fused.kernels = glue.Kernels(fused.kernels.library, 2)
    assert max(len(step.chains) for step in fused.plan.steps if isinstance(step, KernelStep)) > 1
    feeds = generator_feeds(fused_artifact, TOKENS * 3)
    together = fused.run(feeds)
    run = fused.kernels.run
    monkeypatch.setattr(fused.kernels, "run", lambda calls: [run([call]) for call in calls])
    np.testing.assert_array_equal(fused.run(feeds), together)


def test_synthesis_and_windowed_finishes_run_through_it(fused_artifact, tmp_path) -> None:
    assert fused_artifact.capabilities.fused and fused_artifact.capabilities.windowed
    record = fused_artifact.build.stages[-1]
    assert record["stage"] == "fuse" and record["chains"]["level"] > 0 and record["segments"] > 2
    synth = Synthesizer(fused_artifact)
    assert synth.fused is not None and synth._session is None  # model.onnx is never loaded
    result = synth.run_tokens(TOKENS, "tiny_0")
    (tmp_path / "model.onnx").symlink_to(fused_artifact.model_file)
    plain = Synthesizer(fused_artifact, model_file=tmp_path / "model.onnx")
    assert plain.fused is None  # a graph file of one's own (a candidate) runs in its session
    reference = plain.run_tokens(TOKENS, "tiny_0")
    np.testing.assert_array_equal(result.durations, reference.durations)
    assert result.audio.shape == reference.audio.shape
    assert np.corrcoef(result.audio, reference.audio)[0, 1] > 0.99
    decoder = WindowedDecoder.of_artifact(synth)
    assert decoder.fused is synth.fused.generator and decoder.whole_session is None  # shared, no second generator
    front = decoder.front(TOKENS, style_for(synth.packs["tiny_0"], len(TOKENS)))
    assert decoder.whole_audio(front).size == front.steps * 300
    # a short job heard windowed finishes through the fused generator: the rest is the whole decoding's audio
    job = decoder.start(TOKENS, synth.packs["tiny_0"])
    assert job.finish
    first = decoder.next_window(job)
    rest = decoder.finish(job)
    assert job.done and job.whole is not None
    np.testing.assert_array_equal(rest, job.whole[job.speech[1] * 300 - rest.size : job.speech[1] * 300])
    assert first.size + rest.size == (job.speech[1] - job.speech[0]) * 300


def test_without_a_c_compiler_it_speaks_through_model_onnx(fused_artifact, tmp_path) -> None:
    script = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
        "from kokoro_opt.runtime.glue import kernels_problem\n"
        "from kokoro_opt.runtime.synth import Synthesizer\n"
        f"synth = Synthesizer({str(fused_artifact.path)!r})\n"
        "print(kernels_problem()); assert synth.fused is None\n"
        "print(synth.run_tokens([50, 83, 54, 156], 'tiny_0').audio.size)\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "KOKORO_OPT_CACHE": str(tmp_path / "kernels")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    problem, samples = done.stdout.strip().splitlines()[-2:]
    assert "needs a C compiler" in problem and "set CC" in problem
    assert int(samples) > 0
    assert "runs model.onnx: the fused generator needs a C compiler" in done.stderr


def test_without_a_c_compiler_a_build_with_the_stage_stops_before_its_first_stage(
    tiny_recipe, tmp_path, monkeypatch, fused_artifact, artifacts_root
) -> None:
    """Not after the export, quantize and windows stages: before the first, naming the fixes (an artifact whose every
    stage is cached still builds: it needs no compiler)."""
    import io

    from rich.console import Console

    from kokoro_opt.build import build
    from kokoro_opt.errors import UserError
    from kokoro_opt.recipe import parse_recipe

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KOKORO_OPT_CACHE", str(tmp_path / "cache"))  # no kernels built on this machine yet
    data = tiny_recipe.model_dump(mode="json", by_alias=True) | {"name": "t-fuse-no-cc", "stages": [*INT8, FUSE]}
    with pytest.raises(UserError, match="needs a C compiler") as refused:
        build(parse_recipe(data), tmp_path / "artifacts", console=Console(file=io.StringIO()))
    assert "set CC" in refused.value.hint and "without the `fuse` stage" in refused.value.hint
    assert not list((tmp_path / "artifacts").rglob("model.onnx"))  # not even the export ran
    assert build_with(tiny_recipe, artifacts_root, "t-fused", [*INT8, FUSE]).artifact.id == fused_artifact.id


def test_kernels_built_for_one_cpu_are_not_loaded_on_another(tmp_path, monkeypatch) -> None:
    """`-march=native` builds for this CPU's features: a kernel cache shared with another CPU (a network home, a
    restored CI cache) builds a library of its own instead of loading one that may hold instructions it lacks."""
    from kokoro_opt.runtime import glue

    monkeypatch.setenv("KOKORO_OPT_CACHE", str(tmp_path))
    glue.library_path.cache_clear()
    try:
        here = glue.library_path()
        glue.library_path.cache_clear()
        monkeypatch.setattr(glue, "cpu_features", lambda: "another CPU x86_64 avx2 fma")
        elsewhere = glue.library_path()
    finally:
        glue.library_path.cache_clear()
    assert here.is_file() and elsewhere.is_file() and here != elsewhere


def test_a_truncated_kernel_library_is_built_again_not_loaded(tmp_path, monkeypatch) -> None:
    """A library cut short (a full disk, a killed copy) loads, and crashes the process at its first call (SIGBUS)."""
    import ctypes

    from kokoro_opt.runtime import glue

    monkeypatch.setenv("KOKORO_OPT_CACHE", str(tmp_path))
    glue.library_path.cache_clear()
    try:
        library = glue.library_path()
        whole = library.read_bytes()
        library.unlink()
        library.write_bytes(whole[: len(whole) // 2])
        glue.library_path.cache_clear()
        again = glue.library_path()
    finally:
        glue.library_path.cache_clear()
    assert again == library and len(library.read_bytes()) > len(whole) // 2  # built again, whole
    assert ctypes.CDLL(str(again)).branch_sum is not None  # it loads and names its functions


def test_the_stage_needs_the_windows_stage(tiny_recipe, artifacts_root) -> None:
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError, match=r"stage 'fuse' needs what a 'windows' stage makes \(windowed\)"):
        build_with(tiny_recipe, artifacts_root, "t-fuse-alone", [*INT8[:3], FUSE])  # before any stage runs
    assert not (artifacts_root / "t-fuse-alone").exists()


def _damaged_copy(fused_artifact, tmp_path, change) -> Any:
    """A copy of the artifact's fused/ folder whose plan.json `change(plan)` edited."""
    import shutil

    folder = tmp_path / FUSED_DIR
    shutil.copytree(fused_artifact.path / FUSED_DIR, folder)
    plan = json.loads((folder / "plan.json").read_text())
    change(plan)
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder


def _first(plan: dict, kind: str) -> dict:
    if kind == "segment":
        return next(step for step in plan["steps"] if "segment" in step)
    return next(c for step in plan["steps"] for c in step.get("chains", ()) if c["kind"] == kind)


def _scaled_by_its_own_step(plan: dict) -> None:
    """A chain's norm scale made by an earlier chain of its step: the step's arguments are prepared before it runs."""
    first, second = next(step["chains"][:2] for step in plan["steps"] if len(step.get("chains", ())) > 1)
    second.update(norm_scale=first["out"], reads=[*second["reads"], first["out"]])


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda p: _first(p, "segment").update(segment="../../model.onnx"), r"field 'steps\.\d+\.segment\.segment'"),
     (lambda p: _first(p, "segment").update(segment="segment_99.onnx"), "names 'segment_99.onnx', not a segment of"),
     (lambda p: _first(p, "level").update(eps=float("nan")), r"field 'steps\.\d+\.chains\.chains\.\d+\.level\.eps'"),
     (lambda p: _first(p, "level").update(kind="cubic"), r"chains\.\d+': Input tag 'cubic'"),
     (lambda p: _first(p, "level").update(command="rm"), r"\.command': Extra inputs are not permitted"),
     (lambda p: _first(p, "residual").pop("x_new"), "q and x_new go with kind 'residual'"),
     (lambda p: _first(p, "level").update(x="nowhere"), "reads 'nowhere', which nothing before it makes"),
     (lambda p: _first(p, "level").update(name="chain_999"), "chain_999 has no constant 'chain_999.qscale'"),
     (_scaled_by_its_own_step, "reads '[^']+', which a chain of its own step makes"),
     (lambda p: p.update(outputs=["nothing"]), "the output 'nothing' is not made"),
     (lambda p: p.update(format=2), "field 'format'")],
)  # fmt: skip
def test_a_damaged_plan_is_one_error_when_the_artifact_loads(fused_artifact, tmp_path, change, match) -> None:
    """The plan comes with the artifact (fetched ones too): it may name its own segments only, and every field is
    checked when the generator loads, so nothing reaches a KeyError or a kernel in a request."""
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError, match=match):
        FusedGenerator(_damaged_copy(fused_artifact, tmp_path, change))


def test_truncated_constants_are_one_error_when_the_artifact_loads(fused_artifact, tmp_path) -> None:
    from kokoro_opt.errors import UserError

    folder = _damaged_copy(fused_artifact, tmp_path, lambda plan: None)
    (folder / "constants.npz").write_bytes((folder / "constants.npz").read_bytes()[:60])  # a bad zip
    with pytest.raises(UserError, match=r"constants\.npz is not readable"):
        FusedGenerator(folder)


def test_a_plan_whose_constants_do_not_cover_the_channels_is_refused(fused_artifact, tmp_path) -> None:
    """The kernels read one constant per channel row: a plan (a file) giving one for all is an error, never a read
    past the end of an array."""

    def to_one(plan: dict) -> None:
        spec = _first(plan, "level")
        spec.update(norm_scale="one", norm_bias="one", reads=[spec["x"], "one"])

    folder = _damaged_copy(fused_artifact, tmp_path, to_one)
    spec = _first(json.loads((folder / "plan.json").read_text()), "level")
    with np.load(folder / "constants.npz") as stored:
        constants = {k: stored[k] for k in stored.files}
    constants["one"] = np.ones(1, np.float32)  # every per-channel constant of the chain a single value
    constants.update({f"{spec['name']}.{key}": np.ones(1, np.float32) for key in ("qscale", "qzero", "scale", "zero")})
    np.savez(folder / "constants.npz", **constants)
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError, match="1 channel constants for"):
        FusedGenerator(folder).run(generator_feeds(fused_artifact, list(range(20, 60))))


def _residual_over_its_levels(plan: dict) -> None:
    spec = _first(plan, "residual")
    spec.update(x=spec["q"], in_place=True)  # its float stream: its own uint8 levels, overwritten in place


def _levels_from_a_stream(plan: dict) -> None:
    spec = _first(plan, "residual")
    spec.update(q=spec["x"])  # its levels read from its float stream: four bytes a level


@pytest.mark.parametrize(
    ("change", "match"),
    [(_residual_over_its_levels, "a chain was given a C-contiguous uint8 array where it reads C-contiguous float32"),
     (_levels_from_a_stream, "a chain was given a C-contiguous float32 array where it reads C-contiguous uint8")],
)  # fmt: skip
def test_a_plan_routing_a_tensor_of_another_type_to_a_kernel_is_refused(fused_artifact, tmp_path, change, match) -> None:
    """A kernel reads as many elements as its arrays' shape says, in the type it expects: a plan (a file, a fetched
    one too) that hands it a uint8 tensor where it reads float32 made it read and write 1.5 MB past the array.
    Every array is checked before the call; the plan's file is named."""
    from kokoro_opt.errors import UserError

    folder = _damaged_copy(fused_artifact, tmp_path, change)
    with pytest.raises(UserError, match=match) as refused:
        FusedGenerator(folder).run(generator_feeds(fused_artifact, list(range(20, 60))))
    assert "plan.json: chain_" in str(refused.value)


def test_a_generator_without_int8_chains_is_refused_with_the_fix(tiny_recipe, artifacts_root) -> None:
    """Snake without the quantize stage leaves float chains only: nothing for the kernels, and one clear error
    before any weights are read (contract.Pass.after)."""
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError, match=r"stage 'fuse' rewrites what a 'quantize' stage makes") as refused:
        build_with(tiny_recipe, artifacts_root, "t-fuse-float", [INT8[0], INT8[1], WINDOWS, FUSE])
    assert "put 'fuse' after a 'quantize' stage" in refused.value.hint
