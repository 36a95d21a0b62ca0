"""The prefix cache (runtime/prefix_cache.py, prefix_state.py) on the tiny V4.1 and V4 in fp32.

Exact mode: greedy tokens with the cache on equal those with it off, for multi-turn
conversations, shared-prefix batches, n > 1, chunked prompts and prefixes that end mid-group;
the sampled tokens' logprobs agree as closely as one request batched with different neighbours
does (`same_tokens`). Restoring a snapshot gives a slot
bit-identical to a cold prefill; encoder replay from position 0 too, and from later positions it
changes only the rings. Under a small budget nothing leaks and held nodes survive eviction; the
host tier round-trips bit-exactly.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megagraph.runtime.cache_manager import CacheManager, size_cache
from megagraph.runtime.prefix_cache import (PrefixCache, PrefixCacheConfig, Resume,
                                            build_prefix_cache)
from megagraph.runtime.prefix_state import (EncoderReplayer, Snapshot, StateLayout, apply_resume,
                                            capture)
from megagraph.runtime.sampling import SamplingParams, new_state
from megagraph.runtime.scheduler import Scheduler, SchedulerConfig
from megagraph.runtime.sequence import Sequence
from tests.runtime.conftest import make_engine
from tests.tiny import SeqChunk, random_tokens

CAP = 256
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
MODELS = ["v4.1-flash-tiny", "v4-flash-tiny"]


@pytest.fixture(scope="module", params=MODELS)
def engine(request, compiled):
    return make_engine(compiled(request.param), request.param, capacity=CAP)


class Runner:
    """A scheduler over `engine` with the cache on or off; `turn(prompts)` runs them together
    and returns per prompt (tokens, logprobs, cached tokens)."""

    def __init__(self, engine, cache: PrefixCacheConfig | None, budget: int = 1 << 30,
                 prefill: int = 32):
        self.engine = engine
        sizing = size_cache(engine.plan.graph, capacity=CAP, max_running=4)
        self.cm = CacheManager(engine, sizing)
        self.pc = build_prefix_cache(engine, cache, device_bytes=budget) if cache else None
        self.sch = Scheduler(engine, self.cm, SchedulerConfig(max_prefill_tokens=prefill),
                             prefix_cache=self.pc)
        self.ids = 0

    @property
    def cache(self) -> PrefixCache:
        return self.pc[0]

    def turn(self, prompts, params=GREEDY, n: int = 1):
        done, fin, out = threading.Event(), set(), {}
        total = len(prompts) * n

        def sink_for(key):
            def sink(ev):
                toks, lps, cached = out.setdefault(key, ([], [], [0]))
                toks.extend(ev.token_ids)
                lps.extend(lp.logprob for lp in ev.logprobs or [])
                cached[0] = max(cached[0], ev.num_cached_tokens)
                if ev.finish_reason:
                    fin.add(key)
                    if len(fin) == total:
                        done.set()
            return sink

        seqs = []  # one submission: the scheduler sees the whole turn at once (deterministic)
        for i, p in enumerate(prompts):
            for j in range(n):
                self.ids += 1
                seqs.append(Sequence(self.ids, list(p), new_state(params, p, j, self.engine.device),
                                     sink_for((i, j)), eos_id=1, logprobs=0))
        self.sch.submit(seqs)
        assert done.wait(120), "the scheduler did not finish"
        return [[(out[i, j][0], out[i, j][1], out[i, j][2][0]) for j in range(n)]
                for i in range(len(prompts))]

    def close(self):
        self.sch.close()
        assert self.cm.tokens_used == 0 and self.cm.usage().slots_used == 0
        if self.pc is not None:
            self.cache.check()
            assert all(n.refs == 0 for n in self.cache.nodes()), "a node is still held"


def same_tokens(a, b, tol=0.1):
    """Greedy tokens identical. Logprobs: a resumed prompt runs in other chunks, next to other
    rows and in another order in its step than a cold one. The tiny models' steps are
    batch-invariant to ~1e-6 except where an indexer's top-k has a near-tie over the bf16
    index keys: a 1e-7 change of a score then swaps an attended block and moves a logprob by
    up to ~7e-2 (measured with the cache off too: the same request alone vs batched, 1.1e-3;
    the same rows in another order, 6.5e-2)."""
    for ra, rb in zip(a, b):
        for (ta, la, _), (tb, lb, _) in zip(ra, rb):
            assert ta == tb
            assert max((abs(x - y) for x, y in zip(la, lb)), default=0.0) < tol


def conversation(seed: int, turns: int, system: list[int]) -> list[list[int]]:
    """User messages of one conversation (random token ids), after a shared system prompt."""
    return [random_tokens(5 + (seed + t) % 7, 100 * seed + t) for t in range(turns)]


def run_conversations(r: Runner, convs, system):
    """Every conversation turn by turn (all conversations' turn t in one batch); the prompt of
    turn t is the previous prompt + its reply + the next user message."""
    history = [list(system) for _ in convs]
    outs = []
    for t in range(len(convs[0])):
        prompts = [h + list(c[t]) for h, c in zip(history, convs)]
        res = r.turn(prompts)
        outs.append(res)
        history = [p + res[i][0][0] for i, p in enumerate(prompts)]
    return outs


EXACT = PrefixCacheConfig(mode="exact")


def test_multi_turn_and_shared_prefix_equal_cache_off(engine):
    system = list(random_tokens(21, 7))  # odd: prefixes end mid-group
    convs = [conversation(s, 3, system) for s in range(3)]
    off, on = Runner(engine, None), Runner(engine, EXACT)
    a, b = run_conversations(off, convs, system), run_conversations(on, convs, system)
    for x, y in zip(a, b):
        same_tokens(x, y)
    st = on.cache.stats
    assert st.exact_hits >= 6 and st.replay_hits == 0  # every later turn resumed
    assert st.hit_tokens > 0.5 * st.lookup_tokens
    later = [res[0][2] for turn in b[1:] for res in turn]
    assert all(c >= len(system) for c in later)  # cached_tokens reported per request
    off.close(), on.close()


def test_n_choices_share_one_prefill(engine):
    prompt = list(random_tokens(37, 11))
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    off, on = Runner(engine, None), Runner(engine, EXACT)
    for params in (GREEDY, sampled):
        a, b = off.turn([prompt], params, n=3), on.turn([prompt], params, n=3)
        same_tokens(a, b)
    st = on.cache.stats
    # the first choice prefills; the others wait for its prompt snapshot and resume from it
    assert st.exact_hits >= 4 and st.hit_tokens >= 4 * (len(prompt) - 1)
    off.close(), on.close()


@pytest.mark.parametrize("prefill", [8, 13])
def test_chunked_prompts_and_branches(engine, prefill):
    """Prompts longer than a chunk, sharing prefixes that end at every kind of boundary; the
    second wave branches off the first inside cached nodes (the cut there becomes a
    snapshot)."""
    base = list(random_tokens(45, 3))
    wave1 = [base, base[:30] + [7, 8, 9], base + [4, 4]]
    wave2 = [base[:30] + [7, 8, 9, 10], base[:17] + [5], base[:30] + [7]]
    off = Runner(engine, None, prefill=prefill)
    on = Runner(engine, EXACT, prefill=prefill)
    for wave in (wave1, wave2, wave2):
        got = on.turn(wave)
        same_tokens(off.turn(wave), got)
    # the last pass resumes from a prompt end (33) and from the cuts the first pass made where
    # it branched off inside cached nodes (17, 30: a request's last token always runs)
    assert [res[0][2] for res in got] == [33, 17, 30]
    off.close(), on.close()


def test_small_budget_leaks_nothing_and_keeps_held_nodes(engine):
    system = list(random_tokens(19, 5))
    convs = [conversation(s, 2, system) for s in range(6)]
    layout = StateLayout.from_graph(engine.plan.graph)
    snap = capture(engine.state, layout, 0, 0, 40)  # the size of a ~40-token prefix
    budget = 3 * snap.nbytes()
    off = Runner(engine, None)
    on = Runner(engine, EXACT, budget=budget)
    a, b = run_conversations(off, convs, system), run_conversations(on, convs, system)
    for x, y in zip(a, b):
        same_tokens(x, y)
    c = on.cache
    assert sum(c.stats.evictions.values()) > 0 and c.bytes["device"] <= budget
    on.close(), off.close()
    flushed = c.flush()
    assert flushed["kept"] == 0 and c.bytes == {"device": 0, "host": 0}


# -- the tree and its tiers, without an engine ---------------------------------------------------
def fake_snapshot(layout: StateLayout, start: int, end: int, seed: int, ends=True) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    rows = {lab: torch.randn(end // r - start // r, 4, generator=g)
            for lab, r in layout.by_position.items()}
    at_end = {lab: torch.randn(3, generator=g) for lab in layout.at_end} if ends else None
    window = {lab: torch.randn(8, 4, generator=g) for lab in layout.window} if ends else None
    return Snapshot(start, end, rows, at_end, window)


LAYOUT = StateLayout({"L2.ckv": 2, "L5.ckv": 1}, ("L2.pend_kv",), ("L0.ring",), 2, True, None)


def tree(mode="replay", device_bytes=1 << 30, host_bytes=0, replay_tokens=8) -> PrefixCache:
    return PrefixCache(LAYOUT, PrefixCacheConfig(mode=mode, host_bytes=host_bytes,
                                                 replay_tokens=replay_tokens),
                       device_bytes=device_bytes, window=8, device=torch.device("cpu"),
                       can_replay=mode == "replay")


def test_rows_partition_across_splits_and_resume_choice():
    c = tree()
    toks = list(range(100, 160))
    s1 = fake_snapshot(LAYOUT, 0, 41, 1)
    assert c.insert(toks, s1).end == 41
    other = toks[:25] + [1] * 20
    s2 = fake_snapshot(LAYOUT, 0, 40, 2)
    c.insert(other, s2)  # splits the first node at 25
    c.check()
    # rows of the 41-token path, put back together from the split nodes, equal the snapshot's
    r, matched = c.lookup(toks, 59)
    assert (r.kind, r.end, matched) == ("exact", 41, 41)
    got = torch.cat([rows["L2.ckv"] for _, _, rows in r.parts])
    assert torch.equal(got, s1.rows["L2.ckv"])
    assert torch.equal(r.window["L0.ring"], s1.window["L0.ring"])
    c.unlock(r.anchor)
    # a branch point inside a node: aligned replay when it saves more than it replays
    r, matched = c.lookup(toks[:24] + [9] * 10, 33)
    assert (r.kind, r.end, r.replay, matched) == ("replay", 24, 8, 24)
    c.unlock(r.anchor)
    ex = tree(mode="exact")
    ex.insert(toks, fake_snapshot(LAYOUT, 0, 41, 1))
    assert ex.lookup(toks[:24] + [9] * 10, 33) == (None, 24)  # exact: no snapshot at 24
    # a request that resumed by replay snapshots approximate state: hits on it say so, and an
    # exact node never takes an approximate end
    approx = fake_snapshot(LAYOUT, 0, 50, 3)
    approx.approx = True
    c.insert(toks[:24] + [9] * 26, approx)
    r, _ = c.lookup(toks[:24] + [9] * 30, 53)
    assert r.approx and r.kind == "exact" and c.stats.derived_hits == 1
    c.unlock(r.anchor)
    late = fake_snapshot(LAYOUT, 0, 25, 4)
    late.approx = True
    c.insert(toks, late)  # ends inside the exact 41-token branch: split, no end attached
    at25 = next(n for n in c.nodes() if n.end == 25)
    assert not at25.approx and at25.at_end is None and at25.window is None
    c.check()


def test_eviction_order_locks_and_host_round_trip():
    s = [fake_snapshot(LAYOUT, 0, 20, i) for i in range(3)]
    size = s[0].nbytes()
    paths = [[i] * 30 for i in range(3)]
    # no host tier: the oldest branch loses its window tail first, then its rows
    window = sum(t.numel() * t.element_size() for t in s[0].window.values())
    c = tree(device_bytes=3 * size - window)
    for i in range(3):
        c.insert(paths[i], s[i])
    assert c.stats.evictions == {"device": 0, "host": 0, "window": 1}
    r, _ = c.lookup(paths[0], 25)  # still matchable: by replay
    assert r.kind == "replay" and r.end == 20
    c.unlock(r.anchor)
    # a host tier: whole nodes move there, and come back bit for bit
    c = tree(device_bytes=2 * size, host_bytes=4 * size)
    keep = {i: {k: v.clone() for k, v in s[i].rows.items()} for i in range(3)}
    for i in range(3):
        c.insert(paths[i], s[i])
    assert c.stats.evictions == {"device": 1, "host": 0, "window": 0}
    assert c.count["host"] == 1 and c.bytes["device"] <= 2 * size
    r, _ = c.lookup(paths[0], 25)
    assert r.tier == "host" and c.stats.host_loads == 1 and r.kind == "exact"
    assert torch.equal(r.parts[0][2]["L2.ckv"], keep[0]["L2.ckv"])
    assert torch.equal(r.window["L0.ring"], s[0].window["L0.ring"])
    # held: no amount of pressure evicts it
    c.device_budget = 0
    c._evict()
    assert paths[0][0] in c.root.children and c.root.children[0].tier == "device"
    c.unlock(r.anchor)
    c._evict()
    c.check()
    assert c.bytes["device"] == 0
    c.host_budget = 0
    c._evict()
    assert c.bytes == {"device": 0, "host": 0} and c.count == {"device": 0, "host": 0}


# -- state: restore and replay against a cold prefill --------------------------------------------
def prefill(engine, slot: int, tokens) -> None:
    engine.cached.pop(slot, None)
    for a in range(0, len(tokens), 16):
        engine.step([SeqChunk(slot, tuple(tokens[a:a + 16]))])


def slot_state(engine, slot):
    return {k: v[slot].clone() for k, v in engine.state.items()}


def test_restore_and_replay_against_a_cold_prefill(engine):
    layout = StateLayout.from_graph(engine.plan.graph)
    toks = list(random_tokens(64 if layout.align <= 2 else 256, 21))
    end = len(toks)
    prefill(engine, 0, toks)
    cold = slot_state(engine, 0)
    snap = capture(engine.state, layout, 0, 0, end)
    parts = [(0, end, snap.rows)]
    replayer = EncoderReplayer(engine)
    cases = [("exact", 0), ("replay", end), ("replay", 8)]
    for kind, fold in cases:
        for t in engine.state.values():  # a stale previous owner
            t[1].copy_(torch.randn_like(t[1].float()).to(t.dtype) if t.is_floating_point()
                       else torch.full_like(t[1], 7))
        r = Resume(end, kind, parts, snap.at_end, snap.window if kind == "exact" else None,
                   fold, anchor=None)
        apply_resume(engine, layout, replayer, 1, r, toks)
        got = slot_state(engine, 1)
        assert engine.cached[1] == end
        for k in cold:
            ring = k in layout.window
            if kind == "replay" and fold < end and ring:
                continue  # rebuilt from a truncated window: approximate
            if kind == "replay" and ring:  # the whole prefix in one step, cold ran 16 at a time
                torch.testing.assert_close(got[k], cold[k], rtol=1e-5, atol=1e-5)
                continue
            n = end // layout.by_position[k] if k in layout.by_position else None
            assert torch.equal(got[k][:n], cold[k][:n]), (kind, fold, k)  # rows after the
            #   restored tokens stay the previous owner's: the request's count hides them
    engine.cached.pop(0, None), engine.cached.pop(1, None)


# -- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_cuda_with_captured_steps(tmp_path):
    """The tiny V4.1 compiled for h200 on CUDA with captured buckets (bf16 plan kernels): a
    restore between captured replays writes the pools they read, bit for bit, and the resumed
    slot's next step equals the cold slot's; through the scheduler the exact, host-tier and
    replay paths run on the device and leak nothing (bf16 steps are not batch-invariant, so
    tokens are compared on CPU in fp32, above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megagraph.models.config import load_model_config
    from megagraph.passes import compile_model, load_hw_profile
    from megagraph.passes.artifacts import write_artifacts

    model = "v4.1-flash-tiny"
    out = tmp_path / "h200"
    write_artifacts(compile_model(load_model_config(model), load_hw_profile("h200")), out)
    eng = make_engine(out, model, device="cuda", act="bf16", capacity=CAP, buckets=(4, 16, 64),
                      allow_fallback=True)
    assert eng.runner is not None
    layout = StateLayout.from_graph(eng.plan.graph)
    toks = list(random_tokens(40, 21))
    prefill(eng, 0, toks)
    snap = capture(eng.state, layout, 0, 0, len(toks))
    r = Resume(len(toks), "exact", [(0, len(toks), snap.rows)], snap.at_end, snap.window, 0,
               anchor=None)
    apply_resume(eng, layout, None, 1, r, toks)
    for k, v in eng.state.items():
        n = len(toks) // layout.by_position[k] if k in layout.by_position else None
        assert torch.equal(v[1][:n], v[0][:n]), k
    new = tuple(random_tokens(3, 22))
    a = eng.step([SeqChunk(0, new)])
    b = eng.step([SeqChunk(1, new)])
    assert torch.equal(a, b)
    eng.cached.pop(0, None), eng.cached.pop(1, None)
    system = list(random_tokens(21, 7))
    convs = [conversation(s, 3, system) for s in range(3)]
    for cfg, budget in ((EXACT, 1 << 30), (PrefixCacheConfig(mode="exact", host_bytes=1 << 26),
                                            1 << 12)):
        on = Runner(eng, cfg, budget=budget)
        run_conversations(on, convs, system)
        assert on.cache.stats.exact_hits >= 6
        if cfg.host_bytes:
            assert on.cache.stats.hits["host"] >= 1 and on.cache.stats.host_loads >= 1
        on.close()
    rep = Runner(eng, PrefixCacheConfig(mode="replay", replay_tokens=4))
    run_conversations(rep, convs, system)
    rep.turn([system + list(random_tokens(6, 99))])  # branches off inside the system prompt
    assert rep.cache.stats.replay_hits >= 1
    rep.close()


def test_cache_aware_admission_order(engine):
    """Four slots, ten queued prompts: the two that extend a cached prefix are admitted before
    the cold ones that arrived first, the rest in arrival order. (Tokens are not compared with a
    cache-off run here: with ten requests queued for four slots, which rows share a step depends
    on when results come back, and the random tiny models have argmax near-ties that a step's
    other rows can tip; the equality tests above keep every request admitted at once.)"""
    cached = list(random_tokens(40, 61))
    cold = [list(random_tokens(30, 70 + i)) for i in range(8)]
    warm = [cached + [5 + i] for i in range(2)]
    on = Runner(engine, EXACT)
    on.turn([cached])
    firsts = []
    orig = on.sch._admit

    def admit(s):  # the admission order, on the scheduler thread
        ok = orig(s)
        if ok:
            firsts.append(s.prompt_ids)
        return ok

    on.sch._admit = admit
    got = on.turn(cold + warm)
    assert all(len(r[0][0]) == GREEDY.max_tokens for r in got)
    assert [r[0][2] for r in got[-2:]] == [len(cached)] * 2  # the warm ones resumed
    assert {tuple(p) for p in firsts[:2]} == {tuple(p) for p in warm}
    assert firsts[2:] == cold  # the rest in arrival order
    on.close()
