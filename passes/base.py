"""The Pass base class, the PASSES registry, and the rewrite helpers every pass uses.

A pass is a frozen dataclass with a kebab-case `name` and a pure `run(graph) -> PassResult`. A pass
that does not apply returns its input graph object unchanged (`result.graph is graph`) and says
why in `result.note`; the pipeline writes that note into the manifest and the graph dump.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from megagraph.graph.errors import IRError
from megagraph.graph.ir import Graph, Node, freeze_attrs
from megagraph.graph.registry import REQUIRED, get_op
from megagraph.graph.types import TensorType

from .hw import HwProfile

PASSES: dict[str, type["Pass"]] = {}


class PassError(RuntimeError):
    """A pass failed; the message names the pass and the pipeline so far."""


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the new graph, one line on what it did or why not, and counts."""

    graph: Graph
    note: str  # "fused 9 FFN sites ..." or "skipped: profile cpu has no fused MoE kernel"
    stats: dict = field(default_factory=dict)  # small ints/strings for the manifest
    extra_graphs: dict = field(default_factory=dict)  # name -> Graph (bounded-replay graphs)

    @property
    def skipped(self) -> bool:
        return self.note.startswith("skipped")


@dataclass(frozen=True)
class Pass:
    """Base class: subclasses set `name` and implement `run`."""

    name: ClassVar[str] = ""

    def run(self, g: Graph) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def skip(self, g: Graph, why: str, **stats) -> PassResult:
        return PassResult(g, f"skipped: {why}", stats)

    def options(self) -> dict:
        """The pass's option fields (for the manifest), hardware profiles by name."""
        out = {}
        for k, v in vars(self).items():
            out[k] = getattr(v, "name", v)
        return out


@dataclass(frozen=True)
class FusionPass(Pass):
    """A pass that fires where the hardware profile lists its fusion: `run` asks the profile for
    `fusion` and skips, naming the `kernel` it lacks, or calls `fuse(g, how)`."""

    fusion: ClassVar[str] = ""  # the profile's fusion key
    kernel: ClassVar[str] = ""  # what the skip note says is missing
    hw: HwProfile

    def run(self, g: Graph) -> PassResult:
        how = self.hw.fusion(self.fusion)
        if how is None:
            return self.skip(g, f"profile {self.hw.name} has no {self.kernel}")
        return self.fuse(g, how)

    def fuse(self, g: Graph, how) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError


def register_pass(cls: type[Pass]) -> type[Pass]:
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", cls.name or ""):
        raise ValueError(f"pass {cls.__name__} needs a kebab-case name, got {cls.name!r}")
    if cls.name in PASSES:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    PASSES[cls.name] = cls
    return cls


# -- graph queries -------------------------------------------------------------------------------
_LAYER = re.compile(r"^L(\d+)\.")


def layer_of(name: str) -> int | None:
    """Layer index from a scoped value name (`L7.attn.o` -> 7), None outside layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def attrs_without_defaults(opname: str, attrs: dict) -> dict:
    """Drop attributes equal to the op's default (dumps stay short; required ones always kept)."""
    d = get_op(opname)
    return {k: v for k, v in attrs.items()
            if v is not None and (d.attrs.get(k, REQUIRED) is REQUIRED or d.attrs[k] != v)}


def dead_code(g: Graph) -> Graph:
    """Remove nodes none of whose outputs is used (graph outputs count as uses)."""
    live = {v for _, v in g.outputs}
    keep = []
    for n in reversed(g.nodes):
        if any(o in live for o in n.outputs):
            keep.append(n)
            live.update(i for i in n.inputs if i is not None)
    if len(keep) == len(g.nodes):
        return g
    return g.with_nodes(reversed(keep))


# -- rewriting -----------------------------------------------------------------------------------
class Rewrite:
    """Collects edits to one graph and applies them at once.

    Edits: remove nodes, insert new nodes before/after an existing node (by its first output),
    redirect every use of a value to another value. New nodes get their types from the op's type
    rule, so a wrong rewrite fails here, naming the node.
    """

    def __init__(self, g: Graph, origin: str):
        self.g = g
        self.origin = origin  # pass name, for error messages
        self.types: dict[str, TensorType] = dict(g.types)
        self.removed: set[str] = set()  # first output names of removed nodes
        self.before: dict[str, list[Node]] = {}
        self.after: dict[str, list[Node]] = {}
        self.renames: dict[str, str] = {}
        self.producer = g.producers()
        self.users = g.users()

    def fresh(self, base: str) -> str:
        if base not in self.types:
            return base
        k = 1
        while f"{base}.{k}" in self.types:
            k += 1
        return f"{base}.{k}"

    def node(self, opname: str, inputs, outputs, **attrs) -> Node:
        """A new node with inferred output types (outputs may reuse names of removed values)."""
        attrs = attrs_without_defaults(opname, attrs)
        ins = tuple(inputs)
        where = f"pass {self.origin}: new {opname} -> %{outputs[0]}"
        for i in ins:
            if i is not None and i not in self.types:
                raise IRError(f"{where}: input %{i} is not defined")
        tys = get_op(opname).infer([None if i is None else self.types[i] for i in ins], attrs, where)
        if len(tys) != len(outputs):
            raise IRError(f"{where}: {len(outputs)} output names for {len(tys)} results")
        for o, t in zip(outputs, tys):
            self.types[o] = t
        return Node(opname, ins, tuple(outputs), freeze_attrs(attrs))

    def remove(self, *nodes: Node) -> None:
        self.removed.update(n.outputs[0] for n in nodes)

    def insert_before(self, anchor: Node, *nodes: Node) -> None:
        self.before.setdefault(anchor.outputs[0], []).extend(nodes)

    def insert_after(self, anchor: Node, *nodes: Node) -> None:
        self.after.setdefault(anchor.outputs[0], []).extend(nodes)

    def replace_uses(self, old: str, new: str) -> None:
        self.renames[old] = new

    def apply(self) -> Graph:
        def rn(v):
            while v in self.renames:
                v = self.renames[v]
            return v

        out: list[Node] = []
        for n in self.g.nodes:
            key = n.outputs[0]
            out.extend(self.before.get(key, ()))
            if key not in self.removed:
                out.append(n)
            out.extend(self.after.get(key, ()))
        nodes = [Node(n.op, tuple(None if i is None else rn(i) for i in n.inputs), n.outputs, n.attrs)
                 if any(i in self.renames for i in n.inputs) else n for n in out]
        outputs = tuple((lab, rn(v)) for lab, v in self.g.outputs)
        g = self.g.with_nodes(nodes, types=self.types, outputs=outputs)
        return dead_code(g)


def escapes(g: Graph, users: dict[str, list[Node]], value: str, inside: set[int]) -> bool:
    """Is `value` read outside a region (nodes by id in `inside`), or returned by the graph?"""
    return any(id(u) not in inside for u in users.get(value, [])) or any(
        v == value for _, v in g.outputs)


def only_user(users: dict[str, list[Node]], value: str) -> Node | None:
    us = users.get(value, [])
    return us[0] if len(us) == 1 else None
