"""KOKORO_OPT_THREADS: how many threads a process's ONNX Runtime sessions and torch take when nothing names
them, so processes sharing a machine each keep to their share. Each case runs in a fresh process, as a user's
command does: torch's thread pool and the process's thread count are per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kokoro_opt.artifacts import Artifact

# ORT's intra-op pool: the calling thread and n - 1 more, so a session's new threads tell its thread count
THREADS_TAKEN = """
import json, os, sys
import torch
from kokoro_opt.model import load_kmodel, tiny_config
from kokoro_opt.runtime.session import SessionSettings, make_session

def pool(named):
    before = len(os.listdir("/proc/self/task"))
    session = make_session(sys.argv[1], SessionSettings(intra_op_num_threads=named))
    return len(os.listdir("/proc/self/task")) - before

pool(1)  # the process's first session also starts ONNX Runtime's own threads
unnamed, named = pool(0), pool(3)
load_kmodel(tiny_config(json.loads(sys.argv[2])), None)
print(json.dumps({"unnamed": unnamed, "named": named, "torch": torch.get_num_threads()}))
"""


def _taken(model: Path, vocab: dict[str, int], env_threads: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KOKORO_OPT_THREADS": env_threads}
    return subprocess.run(
        [sys.executable, "-c", THREADS_TAKEN, str(model), json.dumps(vocab)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_sessions_and_torch_take_the_threads_the_variable_names(tiny_artifact: Artifact, vocab: dict[str, int]) -> None:
    taken = {}
    for threads in ("1", "3"):  # at most one of them is the machine's default
        done = _taken(tiny_artifact.model_file, vocab, threads)
        assert done.returncode == 0, done.stderr
        taken[threads] = json.loads(done.stdout.splitlines()[-1])
    assert taken["3"]["unnamed"] - taken["1"]["unnamed"] == 2
    assert taken["1"]["named"] == taken["3"]["named"] == taken["3"]["unnamed"]  # a setting that names its threads keeps them
    assert (taken["1"]["torch"], taken["3"]["torch"]) == (1, 3)


def test_a_variable_that_is_not_a_number_is_named_in_the_error(tiny_artifact: Artifact, vocab: dict[str, int]) -> None:
    done = _taken(tiny_artifact.model_file, vocab, "two")
    assert done.returncode != 0 and "KOKORO_OPT_THREADS='two' is not a number of threads" in done.stderr


def test_tunes_record_of_the_defaults_names_the_threads_they_ran_with(monkeypatch: pytest.MonkeyPatch) -> None:
    from kokoro_opt.tuning.measure import Comparison

    monkeypatch.setenv("KOKORO_OPT_THREADS", "3")
    record = Comparison("abc", rounds=1, defaults_ttfa=[0.2], tuned_ttfa=[0.1]).to_json()
    assert record["defaults"]["session"]["intra_op_num_threads"] == 3


def test_a_whole_graph_session_spins_within_its_runs_only(tiny_artifact: Artifact) -> None:
    """A pool left spinning after a run takes the cores from whatever runs next: another artifact in an
    interleaved evaluation measured 13% slower right after the fp32 export's run (docs/evaluation.md)."""
    from kokoro_opt.runtime.synth import Synthesizer

    options = Synthesizer(tiny_artifact).session.get_session_options()
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"


def test_a_provider_missing_here_is_said(tiny_artifact: Artifact, caplog: pytest.LogCaptureFixture) -> None:
    """A tuned setting made where another provider ran (each provider with its options) loads here on the CPU, and
    says which provider it runs without."""
    import logging

    from kokoro_opt.runtime.session import SessionSettings, make_session

    settings = SessionSettings(
        providers=("NoSuchExecutionProvider", "CPUExecutionProvider"),
        provider_options=({"device_id": "7"}, {"arena_extend_strategy": "kSameAsRequested"}),
    )
    with caplog.at_level(logging.WARNING, logger="kokoro_opt"):
        session = make_session(tiny_artifact.path / "model.onnx", settings)
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert "NoSuchExecutionProvider is not available" in caplog.text
