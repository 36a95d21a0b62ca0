"""The OpenAI-compatible HTTP server (`megagraph runtime serve`).

One job per module:
  config.py       ServeConfig (every start-up flag; CLI defaults come from it)
  service.py      ServingEngine: engine + cache manager + scheduler + tokenizer + chat layer;
                  RequestStream (scheduler thread -> asyncio events, abort)
  app.py          FastAPI app: routes, OpenAI-shaped errors, lifespan
  middleware.py   request ids, API key, requests counted by outcome, the last-resort 500
  body.py         reading and decoding bodies (size cap, UTF-8, nesting depth, surrogates)
  fields.py       the top-level request fields: types, ranges, unknown fields (and their schema)
  token_bound.py  refusing a prompt that cannot fit from its length, before tokenizing it
  memory.py       returning a large request's freed memory to the system
  openapi.py      /openapi.json with every status code, content type and request body
  chat.py         /v1/chat/completions (chat rendering, tool calls, reasoning, grammars)
  completions.py  /v1/completions
  protocol.py     sampling fields that depend on each other or the model, logprob shapes
  streaming.py    SSE, per-request timing, disconnect -> abort, engine failures -> client + log
  metrics.py      Prometheus /metrics
  tokenizer.py    the serving tokenizer (checkpoint's, or the bundled V4 one for tiny models)
  cli.py          `runtime serve` flags, uvicorn with graceful drain
"""

from .app import create_app
from .config import ServeConfig
from .service import ServingEngine

__all__ = ["create_app", "ServeConfig", "ServingEngine"]
