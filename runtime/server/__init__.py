"""The OpenAI-compatible HTTP server (`megagraph runtime serve`).

One job per module:
  config.py       ServeConfig (every start-up flag; CLI defaults come from it)
  service.py      ServingEngine: engine + cache manager + scheduler + tokenizer + chat layer;
                  RequestStream (scheduler thread -> asyncio events, abort)
  app.py          FastAPI app: routes, API key, OpenAI-shaped errors, lifespan
  chat.py         /v1/chat/completions (chat rendering, tool calls, reasoning, grammars)
  completions.py  /v1/completions
  protocol.py     shared request fields (400 naming the field), logprob shapes
  streaming.py    SSE, per-request timing, disconnect -> abort
  metrics.py      Prometheus /metrics
  tokenizer.py    the serving tokenizer (checkpoint's, or the bundled V4 one for tiny models)
  cli.py          `runtime serve` flags, uvicorn with graceful drain
"""

from .app import create_app
from .config import ServeConfig
from .service import ServingEngine

__all__ = ["create_app", "ServeConfig", "ServingEngine"]
