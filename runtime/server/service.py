"""The serving core behind the HTTP routes: engine + cache + scheduler + tokenizer + chat layer,
and the bridge from the scheduler thread to asyncio (`RequestStream`).

Every sequence gets exactly one final event (finish, abort, engine error or a dead engine loop),
so `RequestStream.events()` always ends; `abort()` is safe to call any number of times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..cache_manager import CacheManager, size_cache
from ..chat import (ChatFormatConfig, ChatPromptBuilder, GrammarFactory, make_grammar_state)
from ..sampling import SamplingParams, new_state
from ..scheduler import InvalidRequest, Scheduler, SchedulerConfig
from ..sequence import SeqEvent, Sequence
from .config import ServeConfig
from .errors import APIError
from .metrics import Metrics
from .token_bound import TokenBound
from .tokenizer import load_serving_tokenizer


@dataclass
class ChoiceSpec:
    """What one choice of a request decodes with."""

    params: SamplingParams
    index: int  # choice index (seed offset)
    grammar: object = None
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None  # echo + logprobs: the prompt tokens' logprobs, top k


class EventBus:
    """Scheduler thread -> event loop: events are posted as they come and delivered with one
    wake-up per `flush()` (the scheduler flushes once per processed step).

    A wake-up per token per request would make the event loop and the scheduler thread trade
    the GIL on every event (milliseconds each under load).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, SeqEvent]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue, ev: SeqEvent) -> None:
        with self._lock:
            self._pending.append((queue, ev))

    def flush(self) -> None:
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for q, ev in items:
            q.put_nowait(ev)


class RequestStream:
    """Events of one request's sequences, on the event loop."""

    def __init__(self, service: "ServingEngine", seq_ids: list[int]):
        self.service = service
        self.seq_ids = seq_ids
        self.queue: asyncio.Queue[SeqEvent] = asyncio.Queue()
        self.bus = service.bus(asyncio.get_running_loop())
        self.open = set(seq_ids)
        self.created = time.monotonic()

    def sink(self, ev: SeqEvent) -> None:  # scheduler thread
        self.bus.post(self.queue, ev)

    async def events(self) -> AsyncIterator[tuple[int, SeqEvent]]:
        """(choice index, event) until every choice has finished."""
        index = {sid: i for i, sid in enumerate(self.seq_ids)}
        while self.open:
            ev = await self.queue.get()
            if ev.finish_reason is not None:
                self.open.discard(ev.seq_id)
            yield index[ev.seq_id], ev

    def abort(self) -> None:
        if self.open:
            self.service.scheduler.abort(list(self.open))

    @property
    def finished(self) -> bool:
        return not self.open


class ServingEngine:
    """Everything a route needs; built once at start-up (`ServingEngine.start(config)`)."""

    def __init__(self, engine, config: ServeConfig, sizing, ctx=None):
        self.engine, self.config, self.sizing, self.ctx = engine, config, sizing, ctx
        cfg = engine.cfg
        self.model_name = config.served_model_name or cfg.name
        self.capacity = engine.config.capacity
        self.tokenizer, self.tokenizer_note = load_serving_tokenizer(engine)
        self.bound = TokenBound(self.tokenizer) if self.tokenizer is not None else None
        self.chat, self.chat_note = None, "no tokenizer"
        if self.tokenizer is not None:
            try:
                self.chat = ChatPromptBuilder(self.tokenizer, ChatFormatConfig(
                    served_model_name=self.model_name, family=cfg.family,
                    extra_model_names=(cfg.name,), default_thinking=config.default_thinking,
                    context_limit=self.capacity))
            except ValueError as e:  # the tokenizer cannot render this family's chats
                if getattr(engine, "ckpt_dir", None) is not None:
                    raise  # a checkpoint's own tokenizer must: refuse to start
                # random weights at release widths (a layer slice) have no free embedding row
                # for a stand-in <｜System｜>: completions (token ids, text) still serve
                self.chat_note = str(e)
                self.tokenizer_note += "; chat disabled (random weights): " + str(e)
        self.grammar = (GrammarFactory.maybe_create(self.tokenizer, vocab_size=cfg.vocab_size)
                        if self.tokenizer is not None and config.grammar else None)
        self._buses: dict = {}
        self.cache = CacheManager(engine, sizing, config.max_total_tokens)
        self.metrics = Metrics(self)
        cap = config.prefill_cap(engine.plan, replay=getattr(engine, "replay_possible", False))
        if getattr(engine, "sites", None):  # expert parallel: the dispatch buffers' token limit
            cap = min(cap, max(engine.layout.max_tokens - sizing.slots, 1))
        self.prefix = self._prefix_cache(engine, config, sizing, ctx)
        self.scheduler = Scheduler(
            engine, self.cache,
            SchedulerConfig(max_prefill_tokens=cap, max_queue=config.max_queue,
                            overlap=config.overlap,
                            max_mixed_prefill_tokens=config.max_mixed_prefill_tokens),
            self.grammar, seed=config.seed, on_step=self.metrics.on_step,
            on_flush=self._flush, lockstep=ctx is not None and ctx.world > 1,
            prefix_cache=self.prefix)
        self._ids = itertools.count()
        self.eos_id = cfg.eos_token_id
        extra = range(self.tokenizer.vocab_size, cfg.vocab_size) if self.tokenizer else ()
        self._skip = (self.tokenizer.stream_skip_ids | frozenset(extra)) if self.tokenizer else None
        if self.tokenizer is not None:  # build the byte tables now, not in the first request
            self.detokenizer().push([0])

    @classmethod
    def start(cls, config: ServeConfig, ctx=None) -> "ServingEngine":
        """Load the artifacts and start the engine loop; `ctx` (runtime.distributed) makes this
        process one rank of a data-parallel + expert-parallel job."""
        from ..engine import Engine
        from ..plan import RunPlan

        plan = RunPlan.from_artifacts(config.artifacts, allow_edited=config.allow_edited_artifacts)
        wbytes = int(plan.memory.get("weights", {}).get("device_bytes", 0))
        device = str(ctx.device) if ctx is not None else config.device
        sizing = size_cache(plan.graph, capacity=config.capacity, max_running=config.max_running,
                            weight_bytes=wbytes, mem_fraction=config.mem_fraction,
                            state_bytes=config.state_bytes, device=device)
        ecfg = dataclasses.replace(config.engine_config(sizing.slots), device=device)
        if ctx is None:
            engine = Engine(plan, config.weights, ecfg)
        else:
            from ..distributed import RankEngine

            engine = RankEngine(plan, config.weights, ecfg, ctx=ctx)
        return cls(engine, config, sizing, ctx)

    @staticmethod
    def _prefix_cache(engine, config: ServeConfig, sizing, ctx):
        """(PrefixCache, SlotCache) or None: off with --no-prefix-cache, for the ranks of a
        data-parallel job (a rank's replay step would stall the others) and with a budget of 0."""
        pc = config.prefix_cache_config()
        if not pc.enabled or ctx is not None:
            engine.report.prefix_cache = ("off (--no-prefix-cache)" if not pc.enabled else
                                          "off (data-parallel ranks)")
            return None
        pools = (sizing.slots + 1) * sizing.bytes_per_slot
        budget = pools if pc.device_bytes is None else pc.device_bytes
        if budget <= 0:
            engine.report.prefix_cache = "off (--prefix-cache-bytes 0)"
            return None
        from ..prefix_cache import build_prefix_cache

        out = build_prefix_cache(engine, pc, device_bytes=budget)
        engine.report.prefix_cache = out[0].note
        return out

    # ------------------------------------------------------------------------------ requests
    def _flush(self) -> None:  # scheduler thread, after each batch of events
        for b in list(self._buses.values()):
            b.flush()

    def bus(self, loop) -> EventBus:
        b = self._buses.get(loop)
        if b is None:
            b = self._buses[loop] = EventBus(loop)
        return b

    def detokenizer(self):
        return self.tokenizer.detokenizer(skip_ids=self._skip) if self.tokenizer else None

    def make_grammar(self, constraint):
        return make_grammar_state(self.grammar, constraint)

    def submit(self, prompt_ids: list[int], choices: list[ChoiceSpec],
               request_id: str = "") -> RequestStream:
        """Queue one sequence per choice; raises APIError 400 for a request the engine cannot
        run (scheduler.InvalidRequest) and scheduler.Overloaded (-> 503)."""
        ids = [next(self._ids) for _ in choices]
        stream = RequestStream(self, ids)
        seqs = [Sequence(sid, list(prompt_ids),
                         new_state(c.params, prompt_ids, c.index, self.engine.device),
                         stream.sink, grammar=c.grammar, detok=self.detokenizer(),
                         logprobs=c.logprobs, logit_bias=c.logit_bias, eos_id=self.eos_id,
                         request_id=request_id, prompt_logprobs=c.prompt_logprobs)
                for sid, c in zip(ids, choices)]
        try:
            self.scheduler.submit(seqs)
        except InvalidRequest as e:
            raise APIError(400, str(e), "prompt", "invalid_prompt") from None
        self.metrics.requests_started(len(prompt_ids) * len(choices))
        return stream

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and bytes (for logprobs)."""
        tok = self.tokenizer
        if tok is None or token_id >= tok.vocab_size:
            return "", []
        b = tok.token_bytes(token_id)
        return b.decode("utf-8", errors="replace"), list(b)

    @property
    def healthy(self) -> bool:
        return self.scheduler.dead is None

    def close(self, timeout: float = 30.0) -> None:
        """Stop: abort what is left (the HTTP server has drained its connections already)."""
        self.scheduler.abort_all()
        self.scheduler.close(timeout)
        self.engine.close()
