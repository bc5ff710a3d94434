"""speculum's OpenAI-compatible server: ``speculum serve`` (FastAPI + uvicorn).

- :mod:`.protocol`: request shapes and OpenAI-shaped errors.
- :mod:`.guard`: Host, API key, JSON-only and body-size checks, and the access log.
- :mod:`.limits`: bounds on nesting, constraint size and compile time.
- :mod:`.worker`: the generation thread behind a bounded queue (one engine, in the HTTP process).
- :mod:`.engines`: engine processes, each with its own weights and batch, behind one bounded queue.
- :mod:`.metrics`: Prometheus metrics.
- :mod:`.app`: the routes.
"""

from .app import ServerState, create_app

__all__ = ["ServerState", "create_app"]
