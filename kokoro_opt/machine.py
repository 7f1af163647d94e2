"""The machine a number was measured on: CPU, the ISA flags that pick ORT's kernels, cores, OS, versions.

Every record carries it (artifact manifests, evaluations, tuning trials, tuned.json): an RTF or a
speedup means little without it. `id` is a short hash of what decides kernel paths and results (CPU
model, ISA flags, architecture, OS, onnxruntime and torch versions), so records from alike machines
share it. Host names are never recorded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Iterable
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

# ISA features that change which kernels ORT (MLAS) and torch pick, as Linux names them.
X86_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip
ARM_FLAGS = ("neon", "asimd", "asimddp", "i8mm", "sve", "fphp", "asimdhp")
ISA_FLAGS = X86_FLAGS + ARM_FLAGS
PACKAGES = ("torch", "onnx", "onnxruntime", "numpy", "kokoro", "onnxslim", "coremltools", "kokoro-opt")
ID_FIELDS = ("cpu", "isa", "arch", "os")  # plus the onnxruntime and torch versions
ID_PACKAGES = ("onnxruntime", "torch")

# macOS `sysctl hw.optional` names -> the Linux names above
_DARWIN_FLAGS = {
    "avx2_0": "avx2", "fma": "fma", "avx512f": "avx512f", "avx512vnni": "avx512_vnni", "neon": "asimd",
    "arm.FEAT_DotProd": "asimddp", "arm.FEAT_I8MM": "i8mm", "arm.FEAT_FP16": "asimdhp", "neon_fp16": "asimdhp",
}  # fmt: skip


def _cpuinfo() -> tuple[str, set[str]]:
    """(CPU model, feature flags) from /proc/cpuinfo (Linux); ('', set()) elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "", set()
    fields: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())  # the first processor speaks for all
    model = fields.get("model name") or fields.get("Model") or fields.get("Hardware") or ""
    return model, set((fields.get("flags") or fields.get("Features") or "").split())


def _sysctl(*args: str) -> str:
    try:
        done = subprocess.run(["sysctl", *args], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _darwin() -> tuple[str, set[str]]:
    flags = set()
    for line in _sysctl("hw.optional").splitlines():
        key, _, value = line.partition(":")
        name = _DARWIN_FLAGS.get(key.strip().removeprefix("hw.optional."))
        if name and value.strip() == "1":
            flags.add(name)
    return _sysctl("-n", "machdep.cpu.brand_string"), flags


def installed_versions(packages: Iterable[str], absent: str | None = None) -> dict[str, str]:
    """The installed version of each package; a missing one is left out, or given as `absent`."""
    found = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            if absent is not None:
                found[package] = absent
    return found


def machine_id(fp: dict[str, Any]) -> str:
    """12 hex digits from the fields that decide kernel paths and results (not cores, not the Python)."""
    versions = fp.get("versions", {})
    key = {**{k: fp.get(k) for k in ID_FIELDS}, **{k: versions.get(k) for k in ID_PACKAGES}}
    key["isa"] = sorted(key["isa"] or [])
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


def usable_cpus() -> int:
    """The logical CPUs (hardware threads) this process may run on: its CPU affinity (`taskset`, a container's cpuset),
    within its cgroup's CPU quota (`docker --cpus`, a Kubernetes limit) where one is set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cpus, _quota() or cpus)


def usable_cores() -> int:
    """The physical cores among `usable_cpus`, within the same quota. Physical, as ONNX Runtime's own default counts
    them: a core's second hardware thread adds little to its GEMMs and convolutions, and a pool that counts it has
    twice the threads contending for each core."""
    if hasattr(os, "sched_getaffinity"):
        cores = physical_cores(os.sched_getaffinity(0), CPU_TOPOLOGY)
    else:  # macOS, Windows: no affinity to read
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return min(cores, _quota() or cores)


def _quota() -> int | None:
    """The CPUs the cgroup's quota allows, rounded up; None without one ("max 100000")."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def physical_cores(cpus: Iterable[int], topology: Path) -> int:
    """How many cores the logical `cpus` sit on, by the hardware threads Linux lists as one core's
    (`cpuN/topology/core_cpus_list`, `thread_siblings_list` before Linux 5.3); where the topology cannot be read,
    every logical CPU counts as a core."""
    cpus = set(cpus)
    cores: set[str] = set()
    for cpu in cpus:
        folder = topology / f"cpu{cpu}" / "topology"
        listed = [folder / name for name in ("core_cpus_list", "thread_siblings_list") if (folder / name).is_file()]
        try:
            cores.add(listed[0].read_text().strip())
        except (IndexError, OSError):
            return max(1, len(cpus))
    return max(1, len(cores))


@lru_cache(maxsize=1)
def _fingerprint() -> dict[str, Any]:
    system = platform.system()
    model, flags = _darwin() if system == "Darwin" else _cpuinfo()
    fp: dict[str, Any] = {
        "cpu": model or platform.processor() or platform.machine(),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "usable_cpus": usable_cpus(),
        "os": system,
        "os_release": platform.release(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "versions": installed_versions(PACKAGES),
    }
    fp["id"] = machine_id(fp)
    return fp


@lru_cache(maxsize=1)
def cpu_features() -> str:
    """The CPU's model, architecture and every feature flag it reports: what a compiler's `-march=native` builds for."""
    model, flags = _darwin() if platform.system() == "Darwin" else _cpuinfo()
    return " ".join([model, platform.machine(), *sorted(flags)])


def fingerprint() -> dict[str, Any]:
    """This machine: cpu, isa, cores (logical), usable_cores and usable_cpus (the physical cores and the hardware threads
    this process may run on), os, os_release,
    arch, python, versions (of the libraries that shape the numbers) and id. Read once per process."""
    return copy.deepcopy(_fingerprint())


def same_machine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Alike for kernel choice and results: same CPU model, ISA flags, architecture, OS, onnxruntime, torch."""
    return bool(a.get("id")) and a.get("id") == b.get("id")


def describe(fp: dict[str, Any]) -> str:
    """One line for the top of a results table."""
    cores, usable, cpus = fp.get("cores"), fp.get("usable_cores"), fp.get("usable_cpus")
    limited = bool(cores and (cpus or usable or cores) < cores)  # an affinity or a quota leaves the process fewer
    shown = f"{usable} of {cores} cores" if limited else f"{usable or cores or '?'} cores"
    if cpus and usable and cpus > usable:  # a core's second hardware thread (SMT), not a core
        shown += f" ({cpus} hardware threads)"
    versions = fp.get("versions", {})
    libraries = ", ".join(f"{k} {versions[k]}" for k in ID_PACKAGES if k in versions)
    parts = [
        fp.get("cpu") or "unknown CPU",
        fp.get("arch") or "?",
        shown,
        " ".join(fp.get("isa") or []) or "no listed ISA extensions",
        f"{fp.get('os', '?')} {fp.get('os_release', '')}".strip(),
    ]
    return "machine: " + " · ".join([*parts, *([libraries] if libraries else [])]) + f" (id {fp.get('id', '?')})"


def proc_status_kib(field_name: str) -> int | None:
    """A memory line of this process's /proc/self/status in KiB (`VmHWM`: the kernel's peak resident memory,
    `VmRSS`: the current); None where there is no such file (macOS, Windows)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return None
