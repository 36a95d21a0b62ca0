"""The state of rejected tokens: explicit save / restore of exactly the rows a verify step touches.

A verify step feeds each request k + 1 rows [anchor, d_1 .. d_k] at positions c .. c + k (c =
tokens in state) and writes state for all of them; only the first m = accepted + 1 rows are
kept. Every state tensor is position-addressed, so the rows a verify step can touch are known
before it runs, and they are few:

* sliding-window rings `*.ring` [S, W, D] (model layers and the DSpark draft rings): row p % W per
  position. A rejected row p overwrote position p - W, which later tokens still read; with
  k < W no accepted position shares its ring row, so restoring rows p % W (p >= c + m) is exact.
* compressed caches (`*.ckv`, `*.ikey`, [S, N/r, D] and [S, N, D]): the row of group p // r is
  written when position p completes it; a group completed by a rejected row is restored.
* compressor pending rows `*.pend_kv`, `*.pend_gate` [S, r, D]: the step writes the trailing
  incomplete group of the rows it was fed, so after a rejection inside a group that a rejected
  row completed, the accepted members' rows were never written. The slot's r rows are saved and
  restored, and the accepted trailing members written from the verify graph's per-row outputs
  (`verify.L<i>.pend_*_rows`, passes/dspark_draft.py).
* the Engram history `engram_hist` [S, K-1]: rebuilt as the last K-1 ids of (saved history,
  the accepted rows' ids `verify.engram_ids`).

The alternative, rings sized for the lookahead (window + block rows, compressor pending rows
past ratio + block) with commit by accepted length, is what SGLang / vLLM do; it changes every
ring's layout and kernel for a saving of a few rows copied per step, so it is not done here.
docs/speculative.md has the full comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megagraph.graph.ir import Graph
from megagraph.passes.dspark_draft import ENGRAM_IDS, pend_row_labels


class RollbackError(ValueError):
    """A state tensor has no rollback rule, or a verify step does not fit one."""


@dataclass(frozen=True)
class Rule:
    """How one state tensor is addressed: kind "ring" (row p % rows), "groups" (row of group
    p // ratio, written at its last position), "pending" (r rows of the open group) or
    "history" (the last ids)."""

    kind: str
    rows: int = 0  # ring rows / ratio


def rules(g: Graph) -> dict[str, Rule]:
    """The rollback rule of every state tensor of a verify graph; an unknown layout fails."""
    out = {}
    for name in g.state_labels:
        dims = g.types[name].shape
        second = dims[1] if len(dims) > 1 else None
        if name.endswith(".ring") and isinstance(second, int):
            out[name] = Rule("ring", second)
        elif isinstance(second, str) and second.startswith("N"):
            out[name] = Rule("groups", int(second.split("/")[1]) if "/" in second else 1)
        elif name.endswith((".pend_kv", ".pend_gate")) and isinstance(second, int):
            out[name] = Rule("pending", second)
        elif name == "engram_hist":
            out[name] = Rule("history")
        else:
            raise RollbackError(f"state {name} {g.types[name]}: no rollback rule for this layout "
                                "(runtime/speculative/rollback.py)")
    return out


def _written(rule: Rule, positions: range) -> list[tuple[int, int]]:
    """(position, row) pairs a step over `positions` writes under a ring / groups rule."""
    if rule.kind == "ring":
        return [(p, p % rule.rows) for p in positions]
    r = rule.rows
    return [(p, (p + 1) // r - 1) for p in positions if (p + 1) % r == 0]


@dataclass
class Saved:
    """One request's touched rows before its verify step."""

    slot: int
    cached: int  # c: tokens in state before the verify step
    fed: int  # k + 1 rows fed
    rows: dict[str, tuple[list[tuple[int, int]], torch.Tensor]]  # name -> ((pos, row)s, values)
    whole: dict[str, torch.Tensor]  # pending / history: the slot's rows


class Rollback:
    """Save before a verify step, restore after acceptance, for the state pools of one engine."""

    def __init__(self, verify: Graph, state: dict[str, torch.Tensor], window: int):
        self.rules, self.state, self.window = rules(verify), state, window
        labels = {lab for lab, _ in verify.outputs}
        for name, rule in self.rules.items():
            if rule.kind == "pending":
                layer = name.split(".")[0][1:]
                need = pend_row_labels(int(layer))
                if not set(need) <= labels:
                    raise RollbackError(f"verify graph {verify.name} lacks {need} for {name}")
            if rule.kind == "history" and ENGRAM_IDS not in labels:
                raise RollbackError(f"verify graph {verify.name} lacks {ENGRAM_IDS}")

    def save(self, slot: int, cached: int, fed: int) -> Saved:
        if not 1 <= fed <= self.window:
            raise RollbackError(f"slot {slot}: {fed} verify rows; at most the window "
                                f"{self.window} can be rolled back")
        pos = range(cached, cached + fed)
        rows, whole = {}, {}
        for name, rule in self.rules.items():
            t = self.state[name]
            if rule.kind in ("ring", "groups"):
                w = _written(rule, pos)
                idx = torch.tensor([r for _, r in w], dtype=torch.long, device=t.device)
                rows[name] = (w, t[slot].index_select(0, idx).clone())
            else:
                whole[name] = t[slot].clone()
        return Saved(slot, cached, fed, rows, whole)

    def restore(self, saved: Saved, keep: int, outs: dict[str, torch.Tensor],
                first_row: int) -> None:
        """Keep the first `keep` of the fed rows: put back every row the others touched.
        `outs`: the verify step's outputs; `first_row`: this request's first row in them."""
        if not 1 <= keep <= saved.fed:
            raise RollbackError(f"slot {saved.slot}: keep {keep} of {saved.fed} verify rows")
        s, c = saved.slot, saved.cached
        end = c + keep  # first rejected position
        for name, (w, vals) in saved.rows.items():
            back = [i for i, (p, _) in enumerate(w) if p >= end]
            if back:
                t = self.state[name]
                i = torch.tensor(back, dtype=torch.long, device=t.device)
                rows = torch.tensor([w[j][1] for j in back], dtype=torch.long, device=t.device)
                t[s].index_copy_(0, rows, vals.index_select(0, i))
        for name, old in saved.whole.items():
            rule, t = self.rules[name], self.state[name]
            if rule.kind == "history":
                ids = outs[ENGRAM_IDS][first_row:first_row + keep].to(t.dtype)
                t[s].copy_(torch.cat([old, ids])[-t.shape[1]:] if t.shape[1] else old)
                continue
            r = rule.rows
            t[s].copy_(old)
            label = pend_row_labels(int(name.split(".")[0][1:]))[name.endswith(".pend_gate")]
            for p in range(max(c, end // r * r), end):  # the accepted open group's members
                t[s, p % r] = outs[label][first_row + p - c].to(t.dtype)
