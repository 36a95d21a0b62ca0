"""The sweep of prefill.py / decode.py: modes x batch sizes, one engine per mode, each row failing
soft, inside the time budget; then the per-op split of the megagraph row."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .budget import Budget, attempt
from .costs import extrapolate, scope_ms
from .engines import (close_engine, fill_state, is_oom, make_engine, median,
                      release_memory, round_capacity, run_steps, step_path)
from .models import Model
from .optime import split_step, time_ops

MODES = {
    "megagraph": ("plan", "the plan's kernels; CUDA graphs for steps a bucket holds, eager above"),
    "capturable": ("capturable", "capturable torch kernels, same graphs / eager split"),
    "reference": ("reference", "reference torch kernels, eager (a plain PyTorch port)"),
    "compile": ("capturable", "capturable torch kernels under torch.compile, CUDA graphs"),
}
# first guess of a mode's step time against the megagraph row (before it has run a batch size)
GUESS = {"capturable": 3.0, "reference": 10.0, "compile": 1.5}


@dataclass
class Sweep:
    """What one benchmark sweeps: batch sizes (B: tokens of a step), the step's requests, how
    many steps, which B a CUDA-graph bucket holds, and where results go.

    Order: the megagraph row at every B, then the baselines (each mode one engine), then the
    split (a fresh eager engine with the plan's kernels, one profiled step per B). The split runs
    last and in a process without CUDA graphs (the profiler and captured graphs do not always get
    along), and its time is kept back from the baselines once the megagraph row has run."""

    kind: str  # "prefill" / "decode"
    model: Model
    device: torch.device
    budget: Budget
    batches: list[int]
    chunks_for: object  # B -> list[SeqChunk] (slots 0..R-1)
    context: int  # cached tokens per request before every timed step
    capacity: int  # tokens a slot must hold
    slots: int
    warmup: int
    iters: int
    graph_limit: int  # B <= graph_limit run through CUDA-graph buckets of size B
    res: dict
    log: object
    save: object
    split: bool = True
    scale_exp: float = 1.0  # step time ~ B ** scale_exp, to predict a row from a smaller one
    compile_backend: str = "inductor"
    compile_batches: tuple[int, ...] = ()
    compile_min_s: float = 60.0
    reserve_s: float = 0.0  # kept back for the split phase

    def rows(self, mode: str) -> list[dict]:
        return [r for r in self.res["rows"] if r["mode"] == mode]

    def left(self) -> float:
        return self.budget.left() - self.reserve_s

    def predict_ms(self, mode: str, B: int) -> float | None:
        """Step time a row will take, from this mode's largest measured B, else the megagraph row
        times a guess; None when nothing is known."""
        done = [r for r in self.rows(mode) if r.get("ms")]
        if done:
            r = max(done, key=lambda r: r["B"])
            return r["ms"] * max(1.0, B / r["B"]) ** self.scale_exp
        if mode != "megagraph":
            mg = [r for r in self.rows("megagraph") if r.get("ms") and r["B"] <= B]
            if mg:
                r = max(mg, key=lambda r: r["B"])
                return GUESS.get(mode, 3.0) * r["ms"] * (B / r["B"]) ** self.scale_exp
        return None

    def split_cost_s(self) -> float:
        """Seconds the split phase will take: an engine start and, per B, a profiled eager step
        (eager + profiler overhead: ~4x the timed step, at least 2 s)."""
        return 10.0 + sum(max(2.0, 4e-3 * r["ms"]) for r in self.rows("megagraph") if r.get("ms"))

    def run(self, modes: list[str]) -> None:
        for mode in modes:
            self.run_mode(mode)
            if mode == "megagraph" and self.split:
                self.reserve_s = self.split_cost_s()
                self.log(f"keeping {self.reserve_s:.0f} s for the split at the end")
            self.save()
        self.reserve_s = 0.0
        if self.split:
            self.run_split()
            self.save()

    def engine(self, mode: str, kernels: str, buckets: tuple[int, ...], compile: str = "none"):
        """Start an engine (state filled) under the budget: (engine or None, info or failure)."""
        box: dict = {}

        def start():
            t0 = time.perf_counter()
            box["eng"] = make_engine(self.model, self.device, kernels=kernels, slots=self.slots,
                                     capacity=self.capacity, buckets=buckets, graphs=True,
                                     compile=compile)
            fill_state(box["eng"])
            rep = box["eng"].report
            box["info"] = {"startup_s": round(time.perf_counter() - t0, 2),
                           "capture_s": round(rep.phases.get("warm-up+capture", 0.0), 2),
                           "graph_memory_mib": round(rep.graph_memory_bytes / 2**20, 1),
                           "buckets": list(buckets), "fallbacks": dict(rep.kernel_fallbacks)}

        self.log(f"{mode}: starting an engine ({kernels} kernels; buckets {list(buckets)}, "
                 f"{self.slots} slots x {round_capacity(self.capacity)} tokens"
                 + (f", torch.compile {compile}" if compile != "none" else "") + ")")
        fail: dict = {}
        limit = self.left() if self.reserve_s else None
        if not attempt(self.budget, fail, start, self.log, f"{mode} start-up", limit):
            close_engine(box.pop("eng", None), self.device)
            release_memory(self.device)
            return None, fail
        self.res.setdefault("engines", {})[mode] = box["info"]
        self.log(f"{mode}: engine up in {box['info']['startup_s']} s (capture "
                 f"{box['info']['capture_s']} s, graphs {box['info']['graph_memory_mib']} MiB)")
        return box.pop("eng"), box["info"]

    def run_mode(self, mode: str) -> None:
        kernels, _ = MODES[mode]
        batches = [b for b in self.batches if mode != "compile" or b in self.compile_batches]
        rows = {}
        for b in self.batches:
            row = {"mode": mode, "B": b, "kernels": kernels}
            if b not in batches:
                row["skipped"] = "torch.compile runs --compile-batches only (minutes per bucket)"
            self.res["rows"].append(row)
            rows[b] = row
        if not batches:
            return
        buckets = () if mode == "reference" else tuple(b for b in batches if b <= self.graph_limit)
        left = self.left()
        why = None
        if mode == "compile" and left < self.compile_min_s:
            why = (f"time budget: torch.compile needs minutes, {left:.0f} s left "
                   f"(< --compile-min-s {self.compile_min_s:.0f})")
        guess = self.predict_ms(mode, min(batches))
        if guess is not None and guess * (self.warmup + self.iters) / 1e3 > left:
            why = f"time budget: predicted {guess / 1e3:.1f} s/step, {left:.0f} s left"
        if left <= 0:
            why = (f"time budget: {max(0.0, self.budget.left()):.0f} s left, "
                   f"{self.reserve_s:.0f} s of it kept for the split")
        if why:
            for b in batches:
                rows[b]["skipped"] = why
            self.log(f"{mode}: skipped ({why})")
            return
        eng, info = self.engine(mode, kernels, buckets,
                                self.compile_backend if mode == "compile" else "none")
        if eng is None:
            for b in batches:
                rows[b].update({k: f"engine start-up: {v}" for k, v in info.items()})
            return
        oom_at, released = None, not buckets
        try:
            for b in sorted(batches):  # ascending: once the graphs are released, every B is eager
                if self.budget.expired:
                    rows[b]["skipped"] = f"time budget ({self.budget.seconds:.0f} s) spent"
                    continue
                if not released and b > max(buckets):
                    # eager from here on (Engine.step runs a step no bucket holds eagerly): hand
                    # the captured graphs' memory pool to the eager steps
                    eng.close()
                    released = True
                    release_memory(self.device)
                    rows[b]["note"] = "CUDA graphs of the smaller B released before this eager row"
                self.run_row(mode, eng, b, rows[b], oom_at)
                if is_oom(rows[b].get("error", "")) and oom_at is None:
                    oom_at = b
                self.save()
        finally:
            close_engine(eng, self.device)
            del eng
            release_memory(self.device)

    def run_row(self, mode: str, eng, B: int, row: dict, oom_at: int | None) -> None:
        if oom_at is not None:
            row["skipped"] = f"B = {oom_at} ran out of memory"
            return
        pred = self.predict_ms(mode, B)
        left = self.left()
        if pred is not None and (self.warmup + self.iters) * pred / 1e3 > left:
            row["skipped"] = (f"time budget: predicted {self.warmup + self.iters} x "
                              f"{pred / 1e3:.2f} s, {left:.0f} s left")
            self.log(f"  {mode} B={B}: skipped ({row['skipped']})")
            return
        chunks = self.chunks_for(B)
        row.update(tokens=sum(len(c.tokens) for c in chunks), requests=len(chunks),
                   path=step_path(eng, sum(len(c.tokens) for c in chunks)))

        def timed():
            t = run_steps(eng, chunks, self.context, self.warmup, self.iters, self.device)
            row.update(ms=round(median(t), 4), times_ms=[round(x, 4) for x in t])

        if attempt(self.budget, row, timed, self.log, f"{mode} B={B}",
                   self.left() if self.reserve_s else None):
            self.log(f"  {mode:10s} B={B:6d}  {row['ms']:10.2f} ms/step  ({row['path']})")

    def run_split(self) -> None:
        """One profiled eager step per B the megagraph row measured, smallest B first."""
        splits = self.res.setdefault("split", {})
        todo = [r for r in sorted(self.rows("megagraph"), key=lambda r: r["B"]) if r.get("ms")]
        if not todo:
            return
        if self.budget.left() < 5.0:
            for r in todo:
                splits[str(r["B"])] = {"error": "time budget spent"}
            return
        eng, info = self.engine("split", "plan", ())
        if eng is None:
            for r in todo:
                splits[str(r["B"])] = {"error": f"engine start-up: {info}"}
            return
        try:
            for r in todo:
                splits[str(r["B"])] = self.split_one(eng, r)
                self.save()
        finally:
            close_engine(eng, self.device)
            del eng
            release_memory(self.device)

    def split_one(self, eng, mg: dict) -> dict:
        """The profiled eager step of B = mg["B"] (after a warm-up step where that is cheap: Triton
        kernels new to the eager shapes compile first)."""
        B = mg["B"]
        if self.budget.left() < max(2.0, 4e-3 * mg["ms"]):
            return {"error": f"time budget: {self.budget.left():.0f} s left"}
        chunks = self.chunks_for(B)
        box: dict = {}

        def split():
            if mg["ms"] < 500:
                run_steps(eng, chunks, self.context, 0, 1, self.device)
            box["prof"] = time_ops(eng, chunks, self.context, self.device)

        fail: dict = {}
        if not attempt(self.budget, fail, split, self.log, f"split B={B}"):
            return {"error": fail.get("error") or fail.get("skipped")}
        prof = box["prof"]
        s = {"method": prof.get("method"), "coverage": prof.get("coverage"),
             "why_not_profiler": prof.get("why_not_profiler"),
             "eager_step_ms": round(prof.get("step_ms", 0.0), 3), "ops": prof["ops"]}
        self.log(f"  split B={B}: {len(s['ops'])} nodes, {sum(o['ms'] for o in s['ops']):.2f} ms "
                 f"of node time in a {s['eager_step_ms']:.2f} ms eager step ({s['method']})")
        return s


def applied_split(res: dict, B: int) -> dict | None:
    """The per-node split of the nearest B that has one, applied to B's megagraph step time:
    {"split": split_step(...), "scopes": {scope: ms incl. 'step' += host/gaps}, "from": B'}."""
    row = next((r for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == B and r.get("ms")),
               None)
    have = {int(b): s for b, s in res.get("split", {}).items() if s.get("ops")}
    if row is None or not have:
        return None
    src = min(have, key=lambda b: (abs(math.log(b / B)), b))
    ops = have[src]["ops"]
    mg_src = next((r for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == src
                   and r.get("ms")), None)
    if mg_src is None:
        return None
    sp = split_step(ops, mg_src["ms"])
    f = row["ms"] / mg_src["ms"]  # same fractions at another B
    scopes = {k: v * f for k, v in scope_ms(ops, sp["scale"]).items()}
    scopes["step"] = scopes.get("step", 0.0) + sp["host_gap_ms"] * f
    for key in ("step_ms", "node_ms", "host_gap_ms"):
        sp[key] *= f
    sp["classes_ms"] = {k: v * f for k, v in sp["classes_ms"].items()}
    sp["scopes_ms"] = {s: {k: v * f for k, v in d.items()} for s, d in sp["scopes_ms"].items()}
    sp["by_op_ms"] = {k: v * f for k, v in sp["by_op_ms"].items()}
    return {"split": sp, "scopes": scopes, "from": src}


def derive_split(res: dict, B: int) -> dict:
    """{"split": applied_split, "x40": {"ms", "tok_s"}} for B where the megagraph row and a split
    exist (the 40-layer step: the split's scopes through layer_mapping)."""
    ap = applied_split(res, B)
    if ap is None:
        return {}
    t40 = extrapolate(ap["scopes"], res["mapping"])
    tokens = next(r["tokens"] for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == B)
    return {"split": ap, "x40": {"ms": t40, "tok_s": tokens / (t40 / 1e3) if t40 else None}}


def mode_rates(res: dict, B: int) -> dict:
    """mode -> its row at B (with ms and tok_s) for every mode that measured B."""
    return {r["mode"]: {**r, "tok_s": r["tokens"] / (r["ms"] / 1e3)} for r in res["rows"]
            if r["B"] == B and r.get("ms")}
