"""One rank's weights: every dense tensor, plus the tensors of the expert slots it holds.

A compiled EP graph reads each MoE layer's experts as `layers.<i>.ffn.experts.local.<w>` [L, ...]
(passes/expert_parallel.py); slot j of rank r holds logical expert placement[layer][r][j] of the
checkpoint bank `layers.<i>.ffn.experts.*.<w>`. The sources here: a dict of full (stacked)
tensors (tests, random weights of small models) or a checkpoint directory, from which only this
rank's experts are read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from megagraph.graph.ir import Graph
from megagraph.models.checkpoint.spec import WeightSpec
from megagraph.passes.expert_parallel import LOCAL, source_weight_name

from .eplb import Placement

_LAYER = re.compile(r"^layers\.(\d+)\.")


def is_local(name: str) -> bool:
    return f".{LOCAL}." in name


def weight_layer(name: str) -> int:
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"slot weight @{name} names no layer")
    return int(m.group(1))


def source_specs(g: Graph, experts: int) -> list[WeightSpec]:
    """The checkpoint tensors a rank graph's weights come from (slot banks -> full '*' banks)."""
    out = []
    for w in g.weights:
        t = g.types[w]
        shape = tuple(int(d) for d in t.shape)
        if is_local(w):
            out.append(WeightSpec(source_weight_name(w), (experts, *shape[1:]), t.dtype))
        else:
            out.append(WeightSpec(w, shape, t.dtype))
    return out


def rank_weights(g: Graph, full: Mapping[str, torch.Tensor], placement: Mapping[int, Placement],
                 rank: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """This rank's tensors from full ones: dense weights as they are, slot banks gathered."""
    out = {}
    for w in g.weights:
        if is_local(w):
            src = full[source_weight_name(w)]
            idx = torch.tensor(placement[weight_layer(w)][rank], dtype=torch.int64, device=src.device)
            out[w] = src.index_select(0, idx).to(device)
        else:
            out[w] = full[w].to(device)
    return out


def load_rank_weights(g: Graph, ckpt_dir: str | Path, placement: Mapping[int, Placement], rank: int,
                      *, experts: int, device: torch.device | str = "cpu",
                      progress: bool = False) -> dict[str, torch.Tensor]:
    """This rank's tensors read from a checkpoint: dense ones and only the experts of its slots."""
    from megagraph.models.checkpoint.reader import open_checkpoint

    ck = open_checkpoint(ckpt_dir)
    dense, members = [], {}
    for w in g.weights:
        t = g.types[w]
        shape = tuple(int(d) for d in t.shape)
        if not is_local(w):
            dense.append(WeightSpec(w, shape, t.dtype))
            continue
        src = source_weight_name(w)
        for e in placement[weight_layer(w)][rank]:
            if not 0 <= e < experts:
                raise ValueError(f"placement names expert {e} (E = {experts})")
            name = src.replace("*", str(e))
            members[name] = WeightSpec(name, shape[1:], t.dtype)
    got = ck.load([*dense, *members.values()], device=device, progress=progress, warn_unexpected=False)
    out = {s.name: got[s.name] for s in dense}
    for w in g.weights:
        if is_local(w):
            src = source_weight_name(w)
            out[w] = torch.stack([got[src.replace("*", str(e))] for e in placement[weight_layer(w)][rank]])
    return {w: out[w] for w in g.weights}


__all__ = ["is_local", "load_rank_weights", "rank_weights", "source_specs", "weight_layer"]
