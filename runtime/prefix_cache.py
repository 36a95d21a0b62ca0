"""A radix prefix cache over token ids for the hybrid V4 state, with a host-memory tier.

Every request's state is its slot's (runtime/state.py); what outlives a request is kept here, in
a radix tree over token ids shared by all requests (and by the `n` choices of one). A node is a
span of tokens [start, end) under its parent and keeps (runtime/prefix_state.py):

* the complete by-position rows of its span (compressed KV, index keys of every owner): the
  content-stable state, exact forever;
* when its end is a point where a slot was captured: the end state (compressor pending rows,
  Engram history) and the window tail (every layer's ring). A split leaves the upper half of a
  node with neither.

Resuming a new request at position e restores the rows [0, e) from the nodes on its path, then:
  exact   the node ending at e has its window tail: restore it; the slot equals a cold prefill
          of those e tokens.
  replay  (the default mode, `PrefixCacheConfig.mode`) the window tail is gone, or e is a
          group-aligned point inside a node (V4.1, whose compressors keep only the current
          group): the encoder-replay graph rebuilds the rings from the last `replay_tokens`
          cached tokens. Approximate; used only when it saves more than it replays.
Mode "exact" never replays: it resumes at the deepest node end with a window tail, else prefills.

Eviction: under `device_bytes`, least recently used first, a node's window tail before its rows
(a branch stays matchable, by replay, after its tail is gone), never a node a running request
holds (`refs`: locks counted along the path to the root), never a node with children on the
device. With `host_bytes`, evicted nodes move whole (window tails too) to host memory (pinned on
CUDA) and stay in the tree; a hit on them copies them back on a side stream at admission, so
the transfer overlaps the step in flight, and the restore waits for it.

Single-threaded: the scheduler thread owns the tree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from .prefix_state import Snapshot, StateLayout

MODES = ("replay", "exact")


@dataclass(frozen=True)
class PrefixCacheConfig:
    """`runtime serve` flags: --no-prefix-cache, --prefix-cache-mode, --prefix-cache-bytes,
    --host-cache-bytes, --prefix-replay-tokens."""

    enabled: bool = True
    mode: Literal["replay", "exact"] = "replay"
    device_bytes: int | None = None  # None: what the state budget leaves after the slot pools
    host_bytes: int = 0  # host tier (0: off)
    replay_tokens: int | None = None  # tokens an encoder replay re-runs (None: the window)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"prefix cache mode must be one of {', '.join(MODES)}, got "
                             f"{self.mode!r}")
        for name in ("device_bytes", "host_bytes", "replay_tokens"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"prefix cache {name} must be >= 0, got {v}")


@dataclass
class PrefixCacheStats:
    """Running totals for /metrics (scheduler thread)."""

    lookups: int = 0  # admissions that asked the cache
    lookup_tokens: int = 0  # their prompt tokens (up to the last, which always runs)
    hits: dict = field(default_factory=lambda: {"device": 0, "host": 0})
    hit_tokens: int = 0  # tokens resumed instead of prefilled
    exact_hits: int = 0  # resumes whose restored state is that of a cold prefill
    replay_hits: int = 0
    derived_hits: int = 0  # window-tail resumes from nodes a replayed request snapshotted
    replayed_tokens: int = 0  # tokens re-run by encoder replay
    inserts: int = 0  # snapshots added
    evictions: dict = field(default_factory=lambda: {"device": 0, "host": 0, "window": 0})
    host_loads: int = 0  # nodes copied back from the host tier
    flushes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.lookup_tokens, 1)


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # the tokens of the span
    start: int
    parent: "Node | None"
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    at_end: dict[str, torch.Tensor] | None = None
    window: dict[str, torch.Tensor] | None = None
    children: dict[int, "Node"] = field(default_factory=dict)
    tier: str = "device"
    refs: int = 0
    used: int = 0
    ready: object = None  # CUDA event of a copy back from the host tier
    approx: bool = False  # snapshotted from a request that resumed by replay (or from such a node)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def part_bytes(self, part: str) -> int:
        d = getattr(self, part) or {}
        return sum(t.numel() * t.element_size() for t in d.values())

    @property
    def nbytes(self) -> int:
        return sum(self.part_bytes(p) for p in ("rows", "at_end", "window"))


@dataclass
class Resume:
    """How an admitted request starts from the cache (applied where steps run)."""

    end: int  # tokens of state restored
    kind: Literal["exact", "replay"]
    parts: list[tuple[int, int, dict[str, torch.Tensor]]]  # rows of [0, end), by node
    at_end: dict[str, torch.Tensor] | None  # end state of the node ending at `end`, if any
    window: dict[str, torch.Tensor] | None  # its window tail (exact)
    replay: int  # tokens to re-run through encoder replay (kind "replay")
    anchor: Node  # locked until the request lets go of it
    events: list = field(default_factory=list)  # host-tier copies to wait for
    tier: str = "device"  # "host" when part of it came back from the host tier
    approx: bool = False  # not the state of a cold prefill: a replay, or a replay-derived node


class PrefixCache:
    def __init__(self, layout: StateLayout, config: PrefixCacheConfig, *, device_bytes: int,
                 window: int, device: torch.device, can_replay: bool):
        self.layout, self.config = layout, config
        self.device_budget, self.host_budget = int(device_bytes), int(config.host_bytes)
        self.replay_tokens = config.replay_tokens or window
        self.device = device
        self.can_replay = can_replay and config.mode == "replay"
        self.root = Node((), 0, None)
        self.stats = PrefixCacheStats()
        self.bytes = {"device": 0, "host": 0}
        self.count = {"device": 0, "host": 0}  # nodes by tier
        self._tick = itertools.count(1)
        self._copy_stream = None
        self.note = ""  # start-up report line (build_prefix_cache)

    # -- lookup ----------------------------------------------------------------------------------
    def _walk(self, tokens: list[int], limit: int) -> tuple[list[Node], int, Node | None]:
        """(fully matched nodes, matched tokens, the node matched part-way or None)."""
        node, pos, path = self.root, 0, []
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                return path, pos, None
            n = _common(child.key, tokens, pos, limit)
            if n < len(child.key):
                return path, pos + n, child
            path.append(child)
            node, pos = child, child.end
        return path, pos, None

    def match_len(self, tokens: list[int]) -> int:
        """Tokens of `tokens` the tree holds (no lock, no statistics: for ranking admissions)."""
        return self._walk(tokens, len(tokens))[1]

    def lookup(self, tokens: list[int], limit: int) -> tuple[Resume | None, int]:
        """The best resume for a request whose first `limit` tokens may come from the cache
        (its last token always runs: it produces the logits), and the tokens matched."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += limit
        path, matched, partial = self._walk(tokens, limit)
        exact_at = max((n.end for n in path if n.window is not None and n.at_end is not None),
                       default=0)
        replay_at = 0
        if self.can_replay:
            replay_at = max((n.end for n in path if n.at_end is not None), default=0)
            if self.layout.aligned_resume:
                replay_at = max(replay_at, matched // self.layout.align * self.layout.align)
        if replay_at > exact_at + self.replay_tokens:
            end, kind = replay_at, "replay"
        elif exact_at > 0:
            end, kind = exact_at, "exact"
        else:
            return None, matched
        nodes = path + ([partial] if partial is not None else [])
        used = [n for n in nodes if n.start < end]
        anchor = used[-1]
        resume = Resume(end, kind, [], None, None,
                        min(self.replay_tokens, end) if kind == "replay" else 0, anchor)
        self.lock(anchor)
        tick = next(self._tick)
        for n in used:
            n.used = tick
            if n.tier == "host":
                resume.tier = "host"
                self._load(n)
                if n.ready is not None:
                    resume.events.append(n.ready)
        resume.parts = [(n.start, n.end, n.rows) for n in used]  # after loads: device tensors
        resume.at_end = anchor.at_end if anchor.end == end else None
        resume.window = anchor.window if kind == "exact" else None
        self.stats.hits[resume.tier] += 1
        self.stats.hit_tokens += end
        resume.approx = kind == "replay" or any(n.approx for n in used)
        if kind == "exact":
            if resume.approx:
                self.stats.derived_hits += 1
            else:
                self.stats.exact_hits += 1
        else:
            self.stats.replay_hits += 1
            self.stats.replayed_tokens += resume.replay
        self._evict()
        return resume, matched

    # -- insert ----------------------------------------------------------------------------------
    def insert(self, tokens: list[int], snap: Snapshot) -> Node | None:
        """Add the state of `tokens[:snap.end]` (rows from `snap.start` on); returns the node that
        ends at `snap.end`, or None when the tree no longer holds the rows before `snap.start`
        (they were evicted) or there is nothing to add."""
        end = snap.end
        if end <= 0:
            return None
        node, pos = self.root, 0
        tick = next(self._tick)
        while pos < end:
            child = node.children.get(tokens[pos])
            if child is None:
                if pos < snap.start:
                    return None
                new = Node(tuple(tokens[pos:end]), pos, node, self._slice(snap, pos, end),
                           approx=snap.approx)
                node.children[tokens[pos]] = new
                self._account(new, +1)
                node = new
                break
            n = _common(child.key, tokens, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, child.end
            node.used = tick
        node.used = tick
        self._attach_end(node, snap)
        self.stats.inserts += 1
        self._evict()
        return node if node.end == end else None

    def _attach_end(self, node: Node, snap: Snapshot) -> None:
        if snap.at_end is None or (snap.approx and not node.approx):
            return  # an exact node keeps only an exact end
        if node.tier == "host":  # fresher on the device: the host copy goes
            self._load(node)
        if node.at_end is None:
            node.at_end = dict(snap.at_end)
            self.bytes["device"] += node.part_bytes("at_end")
        if node.window is None and snap.window is not None:
            node.window = dict(snap.window)
            self.bytes["device"] += node.part_bytes("window")

    def _slice(self, snap: Snapshot, a: int, b: int) -> dict[str, torch.Tensor]:
        out = {}
        for lab, t in snap.rows.items():
            r = self.layout.by_position[lab]
            lo = a // r - snap.start // r
            out[lab] = t[lo: lo + (b // r - a // r)].clone()
        return out

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first `n` tokens; returns the new upper node (no end state)."""
        m = node.start + n
        upper = Node(node.key[:n], node.start, node.parent, tier=node.tier, refs=node.refs,
                     used=node.used, ready=node.ready, approx=node.approx)
        lower_rows = {}
        for lab, t in node.rows.items():
            r = self.layout.by_position[lab]
            k = m // r - node.start // r
            upper.rows[lab], lower_rows[lab] = t[:k].clone(), t[k:].clone()
        node.parent.children[node.key[0]] = upper
        node.key, node.start, node.parent, node.rows = node.key[n:], m, upper, lower_rows
        self.count[upper.tier] += 1
        upper.children[node.key[0]] = node
        return upper

    # -- locks, eviction, tiers ------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            node.refs -= 1
            assert node.refs >= 0, "prefix cache: unbalanced unlock"
            node = node.parent

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _account(self, node: Node, sign: int) -> None:
        self.bytes[node.tier] += sign * node.nbytes
        self.count[node.tier] += sign

    def _evict(self) -> None:
        """Bring the device tier under its budget (then the host tier under its own)."""
        while self.bytes["device"] > self.device_budget:
            # with a host tier, whole nodes (window tails too) move there first
            item = (self.host_budget and self._victim("device", windows=False)) or \
                self._victim("device")
            if item is None:
                break
            node, part = item
            if part == "window":
                self.bytes["device"] -= node.part_bytes("window")
                node.window = None
                self.stats.evictions["window"] += 1
            elif self.host_budget and node.nbytes <= self.host_budget:
                self._to_host(node)
            elif not node.children:
                self._drop(node)
            else:  # children on the host and no room there: drop its tail, keep its rows
                break
        while self.bytes["host"] > self.host_budget:
            item = self._victim("host")
            if item is None:
                break
            self._drop(item[0])

    def _victim(self, tier: str, windows: bool = True) -> tuple[Node, str] | None:
        """The least recently used (node, "window" | "node") that may go; at equal age a
        window tail before its node's rows."""
        best, best_key = None, None
        for n in self.nodes():
            if n.tier != tier or n.refs:
                continue
            if windows and tier == "device" and n.window is not None:
                key = (n.used, 0)
                if best_key is None or key < best_key:
                    best, best_key = (n, "window"), key
            evictable = (not n.children) if tier == "host" else \
                all(c.tier == "host" for c in n.children.values())
            if evictable:
                key = (n.used, 1)
                if best_key is None or key < best_key:
                    best, best_key = (n, "node"), key
        return best

    def _drop(self, node: Node) -> None:
        assert not node.refs and not node.children
        self._account(node, -1)
        self.stats.evictions[node.tier] += 1
        del node.parent.children[node.key[0]]
        node.parent = None

    def _move(self, node: Node, fn) -> None:
        for part in ("rows", "at_end", "window"):
            d = getattr(node, part)
            if d is not None:
                setattr(node, part, {k: fn(t) for k, t in d.items()})

    def _to_host(self, node: Node) -> None:
        self._account(node, -1)
        pin = self.device.type == "cuda"
        self._move(node, lambda t: t.to("cpu").pin_memory() if pin else t.clone())
        node.tier, node.ready = "host", None
        self._account(node, +1)
        self.stats.evictions["device"] += 1
        while self.bytes["host"] > self.host_budget:  # make room: oldest host leaves first
            item = self._victim("host")
            if item is None or item[0] is node:
                break
            self._drop(item[0])

    def _load(self, node: Node) -> None:
        """Back to the device tier; on CUDA the copy runs on a side stream (`node.ready`)."""
        self._account(node, -1)
        if self.device.type == "cuda":
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._copy_stream):
                self._move(node, lambda t: t.to(self.device, non_blocking=True))
                node.ready = torch.cuda.Event()
                node.ready.record(self._copy_stream)
        else:
            self._move(node, lambda t: t.clone())
        node.tier = "device"
        self._account(node, +1)
        self.stats.host_loads += 1

    # -- operators -------------------------------------------------------------------------------
    def flush(self) -> dict[str, int]:
        """Drop every node no running request holds (deepest first); what was held stays."""
        freed = {"nodes": 0, "bytes": 0}
        for n in sorted(self.nodes(), key=lambda n: -n.end):
            if not n.refs and not n.children:
                freed["nodes"] += 1
                freed["bytes"] += n.nbytes
                self._account(n, -1)
                del n.parent.children[n.key[0]]
                n.parent = None
        self.stats.flushes += 1
        return {**freed, "kept": sum(self.count.values())}


    def check(self) -> None:
        """Invariants (tests): byte counts match the tree, locks are consistent, spans chain."""
        totals, counts = {"device": 0, "host": 0}, {"device": 0, "host": 0}
        for n in self.nodes():
            totals[n.tier] += n.nbytes
            counts[n.tier] += 1
            assert n.parent is not None and n.parent.children.get(n.key[0]) is n
            assert n.start == (n.parent.end if n.parent is not self.root else 0)
            assert n.refs >= sum(c.refs for c in n.children.values())
        assert totals == self.bytes and counts == self.count, (totals, self.bytes, counts)


def _common(key: tuple[int, ...], tokens: list[int], pos: int, stop: int) -> int:
    """Length of the common prefix of `key` and tokens[pos:stop]."""
    n = 0
    for a, b in zip(key, tokens[pos:stop]):
        if a != b:
            break
        n += 1
    return n


def build_prefix_cache(engine, config: PrefixCacheConfig, *, device_bytes: int):
    """(PrefixCache, SlotCache) over `engine`'s pools, for the Scheduler; replay mode falls back
    to exact (said in the returned cache's `note`) when the plan has no encoder-replay graph."""
    from .prefix_state import EncoderReplayer, SlotCache

    layout = StateLayout.from_graph(engine.plan.graph)
    can_replay = config.mode == "replay" and "encoder-replay" in engine.plan.extra_graphs
    replayer = EncoderReplayer(engine) if can_replay else None
    cache = PrefixCache(layout, config, device_bytes=device_bytes,
                        window=engine.cfg.sliding_window, device=engine.device,
                        can_replay=can_replay)
    how = ("encoder replay of the last {} tokens".format(cache.replay_tokens) if can_replay
           else "exact resumes only" + ("" if config.mode == "exact" else
                                        " (the plan has no encoder-replay graph)"))
    cache.note = (f"prefix cache: {device_bytes / 2**20:.1f} MiB on {engine.device}"
                  + (f" + {config.host_bytes / 2**20:.1f} MiB host" if config.host_bytes else "")
                  + f"; {how}; resume points every {layout.align} tokens"
                  + ("" if layout.aligned_resume else " only at snapshots (overlapping "
                     "compressors)"))
    return cache, SlotCache(engine, layout, replayer)
