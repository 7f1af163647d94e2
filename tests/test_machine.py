"""The machine fingerprint every record carries: its fields, a stable id of what decides kernels, one line."""

from __future__ import annotations

import json
import os
import platform
import socket

from kokoro_opt.machine import ISA_FLAGS, describe, fingerprint, machine_id, same_machine


def test_fingerprint_has_the_fields_and_never_the_host_name() -> None:
    fp = fingerprint()
    assert {"cpu", "isa", "cores", "usable_cores", "os", "os_release", "arch", "python", "versions", "id"} <= set(fp)
    assert fp["cpu"] and fp["arch"] == platform.machine() and fp["os"] == platform.system()
    assert fp["cores"] == os.cpu_count() and 1 <= fp["usable_cores"] <= fp["cores"]
    assert set(fp["isa"]) <= set(ISA_FLAGS)
    assert {"onnxruntime", "torch", "numpy", "kokoro-opt"} <= set(fp["versions"])
    assert len(fp["id"]) == 12 and fp["id"] == machine_id(fp)
    assert socket.gethostname() not in json.dumps(fp)


def test_id_is_stable_and_follows_the_kernel_relevant_fields_only() -> None:
    first, second = fingerprint(), fingerprint()
    assert first == second and same_machine(first, second)
    first["isa"].append("not-a-flag")  # a copy: the next caller is not affected
    assert "not-a-flag" not in fingerprint()["isa"]

    base = {
        "cpu": "AMD EPYC", "isa": ["avx2", "avx512f"], "cores": 2, "usable_cores": 2, "os": "Linux", "os_release": "6.1",
        "arch": "x86_64", "python": "3.11.7", "versions": {"onnxruntime": "1.20.0", "torch": "2.5.0", "numpy": "2.0"},
    }  # fmt: skip
    same = [
        {**base, "cores": 64, "usable_cores": 8},
        {**base, "os_release": "6.8", "python": "3.12.1"},
        {**base, "isa": ["avx512f", "avx2"]},  # order does not matter
        {**base, "versions": {**base["versions"], "numpy": "2.1"}},
    ]
    other = [
        {**base, "cpu": "Intel Xeon"},
        {**base, "isa": ["avx2", "avx512f", "avx512_vnni"]},
        {**base, "arch": "aarch64"},
        {**base, "os": "Darwin"},
        {**base, "versions": {**base["versions"], "onnxruntime": "1.21.0"}},
        {**base, "versions": {**base["versions"], "torch": "2.6.0"}},
    ]
    key = machine_id(base)
    assert all(machine_id(fp) == key for fp in same)
    assert len({key, *(machine_id(fp) for fp in other)}) == len(other) + 1
    assert same_machine({"id": key}, {**base, "id": key}) and not same_machine({"id": key}, {"id": machine_id(other[0])})
    assert not same_machine({}, {})


def test_describe_is_one_line_with_cores_arch_isa_and_id() -> None:
    fp = {
        "cpu": "AMD EPYC", "isa": ["avx2", "avx512_vnni"], "cores": 8, "usable_cores": 2, "os": "Linux",
        "os_release": "6.1", "arch": "x86_64", "versions": {"onnxruntime": "1.20.0", "torch": "2.5.0"}, "id": "abc123",
    }  # fmt: skip
    line = describe(fp)
    assert line.startswith("machine: AMD EPYC") and "\n" not in line
    for part in ("x86_64", "2 of 8 cores", "avx2 avx512_vnni", "Linux 6.1", "onnxruntime 1.20.0", "torch 2.5.0", "(id abc123)"):
        assert part in line, part
    laptop = {**fp, "cores": 8, "usable_cores": 4, "usable_cpus": 8}  # 4 cores, 8 hardware threads: not "4 of 8"
    assert "4 cores (8 hardware threads)" in describe(laptop) and " of 8" not in describe(laptop)
    pinned = {**fp, "cores": 64, "usable_cores": 2, "usable_cpus": 4}  # a container's 4 CPUs of 64, 2 cores
    assert "2 of 64 cores (4 hardware threads)" in describe(pinned)
    here = describe(fingerprint())
    assert f"{fingerprint()['usable_cores']} " in here and platform.machine() in here and fingerprint()["id"] in here


def _topology(root, siblings: dict[int, str], file: str = "core_cpus_list"):
    for cpu, listed in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / file).write_text(listed + "\n")
    return root


def test_physical_cores_count_a_cores_hardware_threads_once(tmp_path) -> None:
    from kokoro_opt.machine import physical_cores

    smt = _topology(tmp_path / "smt", {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"})
    assert physical_cores(range(8), smt) == 4  # a laptop's 4 cores, 8 threads: ONNX Runtime's default is 4
    assert physical_cores({0, 4}, smt) == 1  # pinned to one core's two threads
    assert physical_cores({0, 1, 4}, smt) == 2
    older = _topology(tmp_path / "older", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, file="thread_siblings_list")
    assert physical_cores(range(4), older) == 2  # before Linux 5.3 the file has the older name
    plain = _topology(tmp_path / "plain", {0: "0", 1: "1"})
    assert physical_cores({0, 1}, plain) == 2
    assert physical_cores({0, 1, 2}, tmp_path / "absent") == 3  # no topology: every logical CPU counts


def test_usable_cores_are_at_most_the_cpus_this_process_may_run_on() -> None:
    from kokoro_opt.machine import usable_cores

    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= usable_cores() <= logical
