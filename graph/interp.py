"""The reference interpreter: executes a graph node by node with an implementation table.

The table is the caller's: the IR stands below the kernels and imports none of them. With the
reference table (`megagraph.kernels.reference_table.reference_impls()`) running the built graph,
this *is* the model's meaning: passes are tested by interpreting before/after graphs on the same
inputs, and the runtime is tested against it. Values are freed after their last use so a prefill
over a long prompt does not keep every intermediate alive.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .errors import IRError
from .ir import Graph
from .registry import get_op
from .types import TORCH_DTYPES, dim_symbol, eval_dim

Impl = Callable[..., "torch.Tensor | tuple[torch.Tensor, ...]"]


def bind_dims(g: Graph, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Bind symbolic dims from the inputs' shapes, checking every input against its type."""
    env: dict[str, int] = {}
    for name in (*g.inputs, *g.weights):
        if name not in tensors:
            kind = "input" if name in g.inputs else "weight"
            raise IRError(f"graph {g.name}: missing {kind} {name!r}")
        t, x = g.types[name], tensors[name]
        if x.dim() != t.rank:
            raise IRError(f"graph {g.name}: {name} has shape {tuple(x.shape)}, expected {t}")
        for d, n in zip(t.shape, x.shape):
            sym = dim_symbol(d)
            if sym is None or sym not in g.dims or sym in env:
                continue
            if d == sym:
                env[sym] = n
            elif "/" in d:  # N/4 of size n binds N = 4n (checked against every use below)
                env[sym] = n * int(d.split("/")[1])
            elif n % int(d.split("*")[1]) == 0:
                env[sym] = n // int(d.split("*")[1])
    for name in (*g.inputs, *g.weights):
        t, x = g.types[name], tensors[name]
        want = t.concrete(env)
        if tuple(x.shape) != want:
            raise IRError(f"graph {g.name}: {name} has shape {tuple(x.shape)}, expected {t} = {want}")
        if x.dtype != TORCH_DTYPES[t.dtype]:
            raise IRError(f"graph {g.name}: {name} has dtype {x.dtype}, expected {t.dtype}")
    return env


def interpret(g: Graph, inputs: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
              impls: Mapping[str, Impl], *, check_types: bool = True,
              keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Run `g` with `impls` (op name -> function); returns {output label: tensor} plus any value
    named in `keep`."""
    env_vals: dict[str, torch.Tensor] = {**weights, **inputs}
    dims = bind_dims(g, env_vals)
    last_use: dict[str, int] = {}
    for idx, n in enumerate(g.nodes):
        for i in n.inputs:
            if i is not None:
                last_use[i] = idx
    pinned = {v for _, v in g.outputs} | set(keep) | set(g.weights) | set(g.inputs)
    kept: dict[str, torch.Tensor] = {}
    attrs = [get_op(n.op).resolve_attrs(n.attr_dict, f"node %{n.outputs[0]}") for n in g.nodes]
    for idx, n in enumerate(g.nodes):
        fn = impls.get(n.op)
        if fn is None:
            raise IRError(f"no implementation of op {n.op!r} (node %{n.outputs[0]})")
        args = [None if i is None else env_vals[i] for i in n.inputs]
        try:
            out = fn(*args, **attrs[idx])
        except Exception as e:
            raise RuntimeError(f"{n.op} -> %{n.outputs[0]} failed: {e}") from e
        out = out if isinstance(out, tuple) else (out,)
        for name, val in zip(n.outputs, out):
            if check_types:
                _check_value(g, name, val, dims)
            env_vals[name] = val
            if name in keep:
                kept[name] = val
        for i in n.inputs:
            if i is not None and last_use.get(i) == idx and i not in pinned:
                env_vals.pop(i, None)
    result = {lab: env_vals[v] for lab, v in g.outputs}
    result.update(kept)
    return result


def _check_value(g: Graph, name: str, val: torch.Tensor, dims: dict[str, int]) -> None:
    t = g.types[name]
    want = tuple(eval_dim(d, dims) for d in t.shape)
    if tuple(val.shape) != want or val.dtype != TORCH_DTYPES[t.dtype]:
        raise IRError(f"kernel for %{name} returned {val.dtype} {tuple(val.shape)}, graph says {t} "
                      f"= {want}")
