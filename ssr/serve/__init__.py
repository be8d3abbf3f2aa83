"""``ssr serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, SSE streaming) over one ``SSREngine``.

``create_app(engine, api_key=None)`` is the ASGI application; ``run(...)`` loads the model and serves it. Needs the
``serve`` extra (``pip install "ssr[serve]"``); the adapters are not needed.
"""

from __future__ import annotations

from typing import Any

from .app import create_app

__all__ = ["create_app", "run"]


def run(model: str | None = None, backend: str = "auto", host: str = "127.0.0.1", port: int = 8000,
        api_key: str | None = None, config=None, served_model_name: str | None = None, timeout: float | None = None,
        max_queue: int | None = None, max_running: int | None = None, log_level: str = "info",
        **backend_kwargs) -> None:
    """Load ``model`` on ``backend`` and serve it on ``host:port`` until interrupted."""
    import logging

    import uvicorn

    from ..backends import choose_backend
    from ..engine import SSREngine
    from ..models import canonical_name

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("ssr.serve")
    limits: dict[str, Any] = {k: v for k, v in {"max_queue": max_queue, "max_running": max_running}.items()
                              if v is not None}
    backend = choose_backend(backend, canonical_name(model))
    engine = SSREngine.from_pretrained(model, backend=backend, config=config, **limits, **backend_kwargs)
    app = create_app(engine, api_key=api_key, served_model_name=served_model_name, timeout=timeout,
                     close_engine=True)
    name = served_model_name or engine.model_name
    log.info("serving %s (%s backend, context %d tokens) on http://%s:%d/v1%s", name, backend,
             engine.context_window, host, port, " (API key required)" if api_key else "")
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        engine.close()  # where the application did not (it never started); a second close does nothing
