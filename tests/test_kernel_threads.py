"""The compiled chains run over channel ranges on a small thread pool (kokoro_opt/runtime/glue): a run never returns,
nor raises, while a pool thread still writes into its arrays. Ctrl-C during `say` used to free them under a running
kernel (a segfault in 3 of 5 tries on a long text)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kokoro_opt.runtime.glue import _SIGNATURES, SPLIT_MIN, KernelCall, Kernels


def test_an_interrupt_in_the_calling_thread_waits_for_the_pools_part() -> None:
    finished: list[tuple[int, int]] = []

    def kernel(lo: int, hi: int) -> None:
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt  # Ctrl-C, raised as the caller's share of the channels returns
        time.sleep(0.3)  # the pool's share is still being written
        finished.append((lo, hi))

    library = SimpleNamespace(**{name: lambda *args, **_: kernel(*args) for name in _SIGNATURES})
    kernels = Kernels(library, parts=2)  # type: ignore[arg-type]
    call = KernelCall("float_chain", channels=8, size=SPLIT_MIN, before=[], after=[])
    with pytest.raises(KeyboardInterrupt):
        kernels.run([call])
    assert finished == [(4, 8)]
