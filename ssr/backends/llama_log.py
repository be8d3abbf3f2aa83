"""llama.cpp's own log lines: silent in normal use, shown with ``SSR_VERBOSE=1`` (``ssr --verbose``) or a backend
made with ``verbose=True``; errors always reach stderr.

Why SSR routes them itself: llama-cpp-python's callback maps ggml's log levels by an older enum (``ggml.h`` now
numbers DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5), so it printed warnings as errors (every load of the embedded
model printed "control-looking token ... probably a bug in the model" three times) and hid real errors as debug
lines. ``install`` replaces that callback for the whole process (llama.cpp's logger is process-wide, so the last
backend's ``verbose`` holds for all).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

# ggml_log_level (ggml.h) -> Python's levels
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5  # a line continuing the previous message, at its level

_state = {"verbose": False, "last": logging.INFO}
_callback = None  # the ctypes callback llama.cpp holds: kept alive here for the life of the process


def verbose_from_environment() -> bool:
    return os.environ.get("SSR_VERBOSE", "").strip().lower() in {"1", "true", "yes", "on"}


def level_of(ggml_level: int) -> int:
    """The Python logging level of a ggml log level (a continuation line takes its message's)."""
    if ggml_level == _CONT:
        return int(_state["last"])
    return _LEVELS.get(ggml_level, logging.INFO)


def shown(level: int) -> bool:
    """Whether a line of this Python level reaches stderr: errors always, the rest only when verbose."""
    return level >= logging.ERROR or bool(_state["verbose"])


def _write(ggml_level: int, text: bytes, _user_data) -> None:
    level = level_of(ggml_level)
    _state["last"] = level
    if shown(level):
        sys.stderr.write(text.decode("utf-8", "replace"))
        sys.stderr.flush()


def install(ll, verbose: bool = False) -> None:
    """Route llama.cpp's log lines (module ``llama_cpp``: ``ll``) through ``_write``; ``verbose`` or
    ``SSR_VERBOSE=1`` shows every line, else only errors."""
    global _callback
    _state["verbose"] = bool(verbose) or verbose_from_environment()
    if _callback is None:
        _callback = ll.llama_log_callback(_write)
        ll.llama_log_set(_callback, ctypes.c_void_p(0))
