"""Kernel choices of the plan -> one implementation per node, with the fallbacks said out loud.

Choice names map to tables: `reference` -> kernels.reference_table.reference_impls() (runs
anywhere, may sync with the host, so never captured), `capturable` ->
kernels.capturable_table.CAPTURABLE (vectorized, host-sync free: the only kernels a CUDA graph
captures). Other names are loaded through kernels.registry when it can load them, with the plan's
config of their kernel family bound as `kernel_config`. Artifacts compiled for another device, or
a choice this machine cannot load, are an error (naming why) unless fallback to the reference
kernels is allowed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial

import torch

from megagraph.graph.interp import Impl
from megagraph.graph.ir import Graph, Node
from megagraph.kernels.reference_table import reference_impls

from .host_gather import host_rows
from .plan import ArtifactsError, RunPlan


def device_arch(device: torch.device) -> str:
    """"cpu", or the CUDA device's "sm_XY" (sm_90 Hopper, sm_100 / sm_103 Blackwell)."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def capturable_tables(g: Graph) -> tuple[dict[str, Impl], dict[str, Impl], set[str]]:
    """(functional table, in-place-state table, nodes that must stay functional) for `g`;
    empty tables when kernels/capturable is not installed."""
    try:
        from megagraph.kernels.capturable_table import capturable_impls, inplace_hazards
    except ImportError:
        return {}, {}, set()
    unsafe = {h.split(" ", 1)[0].lstrip("%") for h in inplace_hazards(g)}
    return capturable_impls(), capturable_impls(inplace_state=True), unsafe


def _named_kernel(name: str, op: str) -> tuple[Impl | None, str]:
    """(function, "") or (None, why it cannot load), through kernels.registry.try_load."""
    try:
        from megagraph.kernels import registry
    except ImportError as e:
        return None, f"megagraph.kernels.registry does not import: {e}"
    return registry.try_load(name, op)


def bind_config(fn: Impl, key: str, want: str, plan: RunPlan) -> Impl:
    """`fn` (the fast kernel `want` of kernel key `key`) with the plan's config of its family
    bound as `kernel_config` (and another family's as `<family>_config` where the entry point
    takes one), so that it runs exactly the values plan.yaml records; unchanged
    for a key of no family. A kernel whose entry point takes no `kernel_config` is an error."""
    fam = plan.kernel_families.get(key)
    if fam is None:
        return fn
    cfg = plan.kernel_configs.get(fam)
    where = plan.source or "artifacts"
    if cfg is None:
        raise ArtifactsError(f"{where}: the plan gives {key} kernel family {fam!r}, but its "
                             "kernel_configs section has no such family")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes = "kernel_config" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if not takes:
        raise ArtifactsError(f"{where}: {want} (for {key}) takes no kernel_config keyword, but "
                             f"the plan gives it the {fam} config")
    # a kernel that composes another family's kernels (mega_moe's shared expert on the dense
    # GEMMs) takes that family's config as `<family>_config`
    others = {f"{name}_config": c for name, c in plan.kernel_configs.items()
              if name != fam and f"{name}_config" in params}
    bound = partial(fn, kernel_config=cfg, **others)
    bound.capturable = getattr(fn, "capturable", False)  # type: ignore[attr-defined]
    return bound


@dataclass
class KernelSet:
    """The implementation of every node of a graph and what the choice honoured."""

    impls: dict[str, Impl]  # node (first output) -> implementation
    capture_safe: set[str]  # nodes whose implementation may be captured in a CUDA graph
    fallbacks: dict[str, str] = field(default_factory=dict)  # kernel key -> what happened
    opaque: set[str] = field(default_factory=set)  # nodes run by a library kernel (not torch ops)

    def for_node(self, n: Node) -> Impl:
        return self.impls[n.outputs[0]]

    def run_on_host(self, g: Graph, host_weights: set[str]) -> list[str]:
        """Wrap the nodes reading host-resident weights with `on_host` (Engram lookups with
        `gather_on_host`); returns their names."""
        moved = [n for n in g.nodes if host_weights.intersection(n.inputs)]
        for n in moved:
            name = n.outputs[0]
            wrap = gather_on_host if n.op == "engram_lookup" else on_host
            self.impls[name] = wrap(self.impls[name])
            self.capture_safe.discard(name)
        return [n.outputs[0] for n in moved]


def resolve_kernels(plan: RunPlan, graphs: list[Graph], device: torch.device, *,
                    allow_fallback: bool = False, override: str = "plan") -> KernelSet:
    """Pick each node's implementation from the plan's choice; raise or fall back per the flag.

    `override="capturable"` runs every op that has a capturable kernel with it where the plan
    chose `reference` (for benchmarks while the plan's fast kernels are only planned); state ops
    write their pools in place unless a later node still reads the old state."""
    from megagraph.kernels.registry import kernel_key

    arch = device_arch(device)
    if arch != plan.hw_arch and not allow_fallback:
        raise ArtifactsError(
            f"{plan.source or 'artifacts'}: compiled for hardware profile {plan.hw_name!r} "
            f"({plan.hw_arch}), but this device is {arch}. Compile for this device (megagraph compile "
            f"--hw {'cpu' if arch == 'cpu' else '<profile of ' + arch + '>'}) or pass "
            "--allow-fallback to run every kernel this device lacks as its reference kernel")
    if override not in ("plan", "capturable"):
        raise ValueError(f"unknown kernel override {override!r}; choose plan or capturable")
    ks = KernelSet({}, set())
    for g in graphs:
        functional, inplace, unsafe = capturable_tables(g)
        tables = {"reference": reference_impls(), "capturable": functional}
        for n in g.nodes:
            key = kernel_key(n.op, n.attr_dict)
            want = plan.kernels.get(key, "reference")
            if override == "capturable" and want == "reference" and n.op in functional:
                want = "capturable"
            tables["capturable"] = functional if n.outputs[0] in unsafe else inplace
            fn, safe, why = _lookup(tables, want, n.op)
            if fn is not None and want.split(".")[0] not in tables:
                fn = _state_in_place(bind_config(fn, key, want, plan), n, unsafe)
            if fn is None:
                if not allow_fallback:
                    raise ArtifactsError(
                        f"{plan.source or 'artifacts'}: the plan runs {key} with kernel {want!r}, "
                        f"which cannot run on this {arch} machine ({why}); pass "
                        "--allow-fallback to use the reference kernel")
                fn, safe = tables["reference"][n.op], False
                ks.fallbacks[key] = f"{want} -> reference ({why})"
            ks.impls[n.outputs[0]] = fn
            if want.split(".")[0] not in tables:
                ks.opaque.add(n.outputs[0])
            if safe:
                ks.capture_safe.add(n.outputs[0])
    return ks


def gather_on_host(fn: Impl) -> Impl:
    """An Engram lookup over a host-resident table: only the rows the step needs are gathered on
    the host, in their storage format (FP8 + e8m0 scales: 1 byte per value instead of the 4 of the
    host's fp32 dequantization and the 2 of its bf16 copy), into reused pinned staging buffers
    (host_gather: no page faults of a fresh 50 MB tensor per prefill step, an asynchronous copy),
    moved to the device, and dequantized there by `fn` itself (over local row indices), so the
    result is the same as `on_host(fn)`."""

    def run(table, scale, ids, **attrs):
        if table.device == ids.device:
            return fn(table, scale, ids, **attrs)
        return fn(*host_rows(table, scale, ids, ids.device), **attrs)

    return run


def on_host(fn: Impl) -> Impl:
    """`fn` run on the host: device tensors in, device tensors out (for breaks that read
    host-resident weights, e.g. Engram row gathers from memory-mapped tables)."""

    def run(*args, **attrs):
        dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"),
                   None)
        out = fn(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **attrs)
        if dev is None:
            return out
        if isinstance(out, tuple):
            return tuple(o.to(dev) for o in out)
        return out.to(dev)

    return run


def _state_in_place(fn: Impl, n: Node, unsafe: set[str]) -> Impl:
    """A library kernel of a state op (Triton compressor, ring copies) writing its state pools in
    place, like the capturable in-place table, unless a later node still reads the old state: the
    functional form copies every pool it updates (whole [slots, capacity, ...] tensors) per step."""
    try:
        from megagraph.kernels.capturable_table import INPLACE_STATE_OPS
    except ImportError:
        return fn
    if n.op not in INPLACE_STATE_OPS or n.outputs[0] in unsafe:
        return fn
    try:
        takes = "inplace" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return fn
    wrapped = partial(fn, inplace=True)
    wrapped.capturable = getattr(fn, "capturable", False)  # type: ignore[attr-defined]
    return wrapped


def _lookup(tables: dict[str, dict[str, Impl]], want: str, op: str
            ) -> tuple[Impl | None, bool, str]:
    """(function, capture-safe, why it is missing)."""
    base = want.split(".")[0]
    if base in tables:
        fn = tables[base].get(op)
        return fn, base == "capturable" and fn is not None, "" if fn else f"no {base} {op}"
    fn, why = _named_kernel(want, op)
    return fn, fn is not None and getattr(fn, "capturable", False), why
