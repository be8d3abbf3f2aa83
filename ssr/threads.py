"""Run one-off compute on a thread of its own, so that the threads that decode keep OpenMP spinning.

Why: llama.cpp's CPU build (ggml with OpenMP) and torch share one libgomp in the process. libgomp gives every thread
that starts a parallel region a team of its own, kept until that thread exits; once the teams hold more threads than
the machine has CPUs, libgomp stops spinning at barriers (100 spins, then a futex sleep: ``gomp_throttled_spin_count``)
in every team. ggml waits at a barrier after each operation of a graph, so one such extra team makes every
``llama_decode`` afterwards slower: on the 2-core test machine the embedded model's plain decoding went from about 21
to 35 ms a token after a single llama.cpp decode or torch operation on the main thread (docs/log.md, "One OpenMP
team per process").

The engine's decodes all run on its scheduler thread. Work that runs once (calibration, a benchmark peer) runs through
``on_own_thread``: its team is freed when that thread ends, so the process keeps one team.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[..., T], *args, name: str = "ssr-oneoff", **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread, waited for; its result returned, its exception raised here."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
