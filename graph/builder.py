"""GraphBuilder: the API model descriptions use to emit a step graph.

Method calls mirror op names (`b.op("rms_norm", x, w, eps=1e-6)`); types come from the op
registry's rules, so a wrong shape fails at the line of the model description that made it.
`b.scope("L3.attn")` prefixes output names, which keeps dumps readable (%L3.attn.q).
"""

from __future__ import annotations

from contextlib import contextmanager

from .errors import IRError
from .ir import Graph, Node, freeze_attrs
from .registry import get_op
from .types import TensorType


class GraphBuilder:
    def __init__(self, name: str, dims: tuple[str, ...], **meta):
        self.name = name
        self.dims = tuple(dims)
        self.meta = meta
        self.inputs: list[str] = []
        self.weights: list[str] = []
        self.nodes: list[Node] = []
        self.outputs: list[tuple[str, str]] = []
        self.types: dict[str, TensorType] = {}
        self._scope: list[str] = []
        self._counter: dict[str, int] = {}

    # -- declarations ------------------------------------------------------------------------
    def _declare(self, name: str, t: TensorType) -> str:
        if name in self.types:
            raise IRError(f"{self.name}: value %{name} declared twice")
        self.types[name] = t
        return name

    def input(self, name: str, t: TensorType) -> str:
        self.inputs.append(self._declare(name, t))
        return name

    def weight(self, name: str, t: TensorType) -> str:
        """A checkpoint tensor; declaring the same name twice with the same type returns it."""
        if name in self.types:
            if self.types[name] != t or name not in self.weights:
                raise IRError(f"{self.name}: weight @{name} redeclared as {t} (was {self.types[name]})")
            return name
        self.weights.append(self._declare(name, t))
        return name

    def output(self, label: str, value: str) -> None:
        self.outputs.append((label, value))

    # -- nodes -------------------------------------------------------------------------------
    @contextmanager
    def scope(self, prefix: str):
        self._scope.append(prefix)
        try:
            yield
        finally:
            self._scope.pop()

    def fresh(self, hint: str) -> str:
        base = ".".join([*self._scope, hint])
        if base not in self.types:
            return base
        k = self._counter.get(base, 1)
        while f"{base}.{k}" in self.types:
            k += 1
        self._counter[base] = k + 1
        return f"{base}.{k}"

    def op(self, opname: str, *inputs: str | None, name: str | tuple[str, ...] | None = None,
           **attrs) -> str | tuple[str, ...]:
        d = get_op(opname)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        where = f"{self.name}: building {opname} in scope {'.'.join(self._scope) or '<top>'}"
        for i in inputs:
            if i is not None and i not in self.types:
                raise IRError(f"{where}: input %{i} is not defined")
        out_types = d.infer([None if i is None else self.types[i] for i in inputs], attrs, where)
        names = (name,) if isinstance(name, str) else name
        if names is None:
            names = tuple(o if len(d.outputs) > 1 else opname for o in d.outputs)
        if len(names) != len(out_types):
            raise IRError(f"{where}: {len(names)} names for {len(out_types)} outputs")
        # names are hints: scoped, and suffixed .1, .2 ... where taken
        names = tuple(self._declare(self.fresh(n), t) for n, t in zip(names, out_types))
        full = d.resolve_attrs(attrs, where)
        stored = {k: v for k, v in full.items() if k in attrs}
        self.nodes.append(Node(opname, tuple(inputs), names, freeze_attrs(stored)))
        return names[0] if len(names) == 1 else names

    def type_of(self, name: str) -> TensorType:
        return self.types[name]

    def build(self) -> Graph:
        from .verify import verify_graph

        g = Graph(self.name, self.dims, tuple(self.inputs), tuple(self.weights), tuple(self.nodes),
                  tuple(self.outputs), dict(self.types), freeze_attrs(self.meta))
        return verify_graph(g)
