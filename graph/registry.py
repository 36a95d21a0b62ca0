"""The op registry: one definition per op with its signature, type rule and capture class.

The builder, the verifier and the parser all call the same type rule, so there is no separate
shape-inference pass. Whether an op can live inside a CUDA graph is a property of the op (its
`capture` field), not of the partitioning pass that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .errors import IRError
from .types import TensorType

TypeRule = Callable[..., "TensorType | tuple[TensorType, ...]"]


@dataclass(frozen=True)
class OpDef:
    """Signature and semantics summary of one op (its reference kernel lives in kernels/)."""

    name: str  # e.g. "sparse_attn"
    inputs: tuple[str, ...]  # input names; a trailing '?' marks an optional (may be absent) input,
    #                          a trailing '*' on the last one a variadic group (passed as a tuple)
    outputs: tuple[str, ...]  # output names (a node must define exactly these many values), or
    #                           one name ending in '*': as many as the type rule returns
    attrs: dict[str, object]  # attr name -> default (REQUIRED for none)
    rule: TypeRule  # (input types..., **attrs) -> output type(s)
    doc: str  # one paragraph: what it computes
    capture: str = "graph"  # "graph" (capturable) or "break: <why it must run eagerly>"
    cost: str = ""  # free-form hint for the planner ("gemm", "memory", "host")
    fused_from: tuple[str, ...] = field(default=())  # ops a fusion op replaces (for dumps)

    @property
    def is_break(self) -> bool:
        return self.capture.startswith("break")

    @property
    def break_reason(self) -> str:
        return self.capture.partition(":")[2].strip()

    @property
    def is_variadic(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].endswith("*")

    @property
    def variadic_outputs(self) -> bool:
        return len(self.outputs) == 1 and self.outputs[0].endswith("*")

    def optional(self, i: int) -> bool:
        return self.inputs[min(i, len(self.inputs) - 1)].endswith("?")

    def input_name(self, i: int) -> str:
        if self.is_variadic and i >= len(self.inputs) - 1:
            return f"{self.inputs[-1][:-1]}[{i - len(self.inputs) + 1}]"
        return self.inputs[i].rstrip("?")

    def resolve_attrs(self, attrs: dict[str, object], where: str) -> dict[str, object]:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise IRError(f"{where}: {self.name} has no attribute(s) {sorted(unknown)}; "
                          f"known: {sorted(self.attrs)}")
        out = {}
        for k, default in self.attrs.items():
            if k in attrs:
                out[k] = attrs[k]
            elif default is REQUIRED:
                raise IRError(f"{where}: {self.name} needs attribute {k!r}")
            else:
                out[k] = default
        return out

    def infer(self, in_types: list[TensorType | None], attrs: dict[str, object],
              where: str) -> tuple[TensorType, ...]:
        """Run the type rule; errors name the node and show the operand types."""
        fixed = len(self.inputs) - self.is_variadic
        if len(in_types) != len(self.inputs) and not (self.is_variadic and len(in_types) >= fixed):
            raise IRError(f"{where}: {self.name} takes {len(self.inputs)} inputs "
                          f"({', '.join(self.inputs)}), got {len(in_types)}")
        for i, t in enumerate(in_types):
            if t is None and not self.optional(i):
                raise IRError(f"{where}: {self.name} input {self.input_name(i)!r} is required")
        full = self.resolve_attrs(attrs, where)
        args = [*in_types[:fixed], tuple(in_types[fixed:])] if self.is_variadic else in_types
        try:
            out = self.rule(*args, **full)
        except IRError as e:
            operands = "\n".join(f"  {self.input_name(i):<12}: {t}" for i, t in enumerate(in_types))
            raise IRError(f"{where}: {self.name}: {e}\n{operands}") from None
        out = out if isinstance(out, tuple) else (out,)
        if len(out) != len(self.outputs) and not self.variadic_outputs:
            raise IRError(f"{self.name}: type rule returned {len(out)} types for outputs {self.outputs}")
        return out


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()
OPS: dict[str, OpDef] = {}


def op(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...] = ("out",), *,
       attrs: dict[str, object] | None = None, capture: str = "graph", cost: str = "",
       fused_from: tuple[str, ...] = ()):
    """Decorator registering a type rule as op `name`; its docstring is the op's doc."""

    def register(rule: TypeRule) -> TypeRule:
        if name in OPS:
            raise IRError(f"op {name!r} is registered twice")
        OPS[name] = OpDef(name, tuple(inputs), tuple(outputs), dict(attrs or {}), rule,
                          (rule.__doc__ or "").strip(), capture, cost, tuple(fused_from))
        return rule

    return register


def get_op(name: str) -> OpDef:
    _load_op_library()
    try:
        return OPS[name]
    except KeyError:
        raise IRError(f"unknown op {name!r}; known: {', '.join(sorted(OPS))}") from None


def all_ops() -> dict[str, OpDef]:
    _load_op_library()
    return dict(sorted(OPS.items()))


def _load_op_library() -> None:
    from . import ops  # noqa: F401  (registers the op definitions on import)


def expect(cond: bool, message: str) -> None:
    """Type-rule assertion: raise an IRError with `message` unless `cond`."""
    if not cond:
        raise IRError(message)
