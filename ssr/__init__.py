"""SSR: self-speculation for reasoning models. The same answers, sooner."""

from .config import SSRConfig
from .engine import SSREngine, get_engine
from .result import GenerationResult, StreamEvent

__all__ = ["SSRConfig", "SSREngine", "GenerationResult", "StreamEvent", "get_engine"]
__version__ = "0.1.0"
