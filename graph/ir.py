"""Graph, Node and the values between them.

Values are named SSA values: every name is defined once (a graph input, a weight, or a node
output) and its type lives in `Graph.types`. Nodes are frozen; passes build new graphs rather than
mutate, so a half-applied pass can never leave a graph corrupt and graphs compare by their text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from .errors import IRError
from .types import TensorType

AttrValue = Any  # int | float | str | bool | None | list[AttrValue]


def freeze_attrs(attrs: dict[str, AttrValue]) -> tuple[tuple[str, AttrValue], ...]:
    """Attributes sorted by key with lists turned into tuples (hashable, deterministic)."""

    def freeze(v):
        if isinstance(v, (list, tuple)):
            return tuple(freeze(x) for x in v)
        if isinstance(v, bool) or v is None or isinstance(v, (int, float, str)):
            return v
        raise IRError(f"attribute value {v!r} of type {type(v).__name__} is not int/float/str/bool/list")

    return tuple(sorted((k, freeze(v)) for k, v in attrs.items()))


@dataclass(frozen=True, slots=True)
class Node:
    """One op application: `outputs = op(inputs) {attrs}`. An input may be None (absent optional)."""

    op: str  # registered op name, e.g. "rms_norm", "sparse_attn"
    inputs: tuple[str | None, ...]  # value names
    outputs: tuple[str, ...]  # value names defined here
    attrs: tuple[tuple[str, AttrValue], ...] = ()  # sorted (key, value) pairs

    def attr(self, key: str, default: AttrValue = IRError) -> AttrValue:
        for k, v in self.attrs:
            if k == key:
                return v
        if default is IRError:
            raise IRError(f"{self.op} node {self.outputs[0]}: no attribute {key!r}")
        return default

    @property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)

    def with_attrs(self, **changes: AttrValue) -> "Node":
        d = self.attr_dict
        d.update(changes)
        return replace(self, attrs=freeze_attrs({k: v for k, v in d.items() if v is not None}))


@dataclass(frozen=True)
class Graph:
    """One engine step (or a fragment of one): inputs, weights, nodes in order, named outputs.

    `outputs` maps an output label to a value name. A label equal to an input's name marks a
    state update: the value becomes that input in the next step.
    """

    name: str
    dims: tuple[str, ...]  # symbolic dims bound by inputs, e.g. ('T', 'R', 'S', 'N')
    inputs: tuple[str, ...]  # runtime inputs: metadata and state
    weights: tuple[str, ...]  # checkpoint tensors, named as in the official checkpoint
    nodes: tuple[Node, ...]
    outputs: tuple[tuple[str, str], ...]  # (label, value name)
    types: dict[str, TensorType] = field(compare=False)  # value name -> type, for every value
    meta: tuple[tuple[str, AttrValue], ...] = ()  # graph attributes (model name, step kind, ...)

    # -- queries -----------------------------------------------------------------------------
    def type_of(self, name: str) -> TensorType:
        try:
            return self.types[name]
        except KeyError:
            raise IRError(f"graph {self.name}: value %{name} is not defined") from None

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None:
                    out.setdefault(i, []).append(n)
        return out

    def output_value(self, label: str) -> str:
        for lab, v in self.outputs:
            if lab == label:
                return v
        raise IRError(f"graph {self.name}: no output labelled {label!r}")

    @property
    def state_labels(self) -> tuple[str, ...]:
        """Outputs that update an input of the same name (the step's state)."""
        ins = set(self.inputs)
        return tuple(lab for lab, _ in self.outputs if lab in ins)

    def meta_value(self, key: str, default: AttrValue = None) -> AttrValue:
        return dict(self.meta).get(key, default)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    # -- rebuilding --------------------------------------------------------------------------
    def with_nodes(self, nodes: Iterable[Node], types: dict[str, TensorType] | None = None,
                   outputs: tuple[tuple[str, str], ...] | None = None) -> "Graph":
        """A new graph with these nodes; unused weights are dropped, types are pruned to live values."""
        nodes = tuple(nodes)
        all_types = dict(self.types)
        if types:
            all_types.update(types)
        outputs = self.outputs if outputs is None else outputs
        used = {i for n in nodes for i in n.inputs if i is not None} | {v for _, v in outputs}
        weights = tuple(w for w in self.weights if w in used)
        live = set(self.inputs) | set(weights) | {o for n in nodes for o in n.outputs}
        return replace(self, nodes=nodes, weights=weights, outputs=outputs,
                       types={k: v for k, v in all_types.items() if k in live})

    def with_meta(self, **changes: AttrValue) -> "Graph":
        d = dict(self.meta)
        d.update(changes)
        return replace(self, meta=freeze_attrs(d))

    def __str__(self) -> str:
        from .text import print_graph

        return print_graph(self)
