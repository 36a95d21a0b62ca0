"""Balanced expert routing for the benchmarks: token t of a step takes experts (t*k + j) mod E.

The runtime has no public way to give an Engine other kernels than its plan names (no
implementation hook on `Engine` / `EngineConfig`), and balanced routing is a benchmark workload,
not a plan choice, so it is installed here for the whole process: the kernels the engine module
resolves are wrapped (mega_moe through its hash-routing inputs, unfused `route` nodes replaced),
and the router the capturable mega_moe calls is replaced. Only benchmark processes install it
(`--routing balanced`).
"""
from __future__ import annotations

import inspect

import torch

_BALANCED: dict = {}
_INSTALLED = False


def _balanced_table(E: int, k: int, device) -> torch.Tensor:
    key = (E, k, str(device))
    if key not in _BALANCED:
        r = torch.arange(E, dtype=torch.int64, device=device)
        _BALANCED[key] = (r[:, None] * k + torch.arange(k, dtype=torch.int64, device=device)) % E
    return _BALANCED[key]


def install_balanced_routing() -> None:
    """Route every MoE round-robin: token t of a step takes experts (t*k + j) mod E, j < k (each
    expert gets T*k/E rows), the weights still coming from the gate's scores at those experts.
    Kernels with mega_moe's hash-routing inputs (Triton, reference) get a table of E rows and
    token index t mod E through them; the capturable mega_moe's router and unfused `route` nodes
    are replaced by the capturable hash router over the same table. For the whole process
    (benchmarks only)."""
    import megagraph.kernels.fused.capturable as capfused
    import megagraph.runtime.engine as engine_mod
    from megagraph.kernels.moe.capturable import hash_route

    global _INSTALLED
    if _INSTALLED:
        return

    def route(x, gate_w, bias, *, topk, route_scale, norm_topk=True, score_func="sqrtsoftplus"):
        table = _balanced_table(gate_w.shape[0], topk, x.device)
        tok = torch.arange(x.shape[0], dtype=torch.int64, device=x.device) % gate_w.shape[0]
        return hash_route(x, gate_w, table, tok, topk=topk, route_scale=route_scale,
                          score_func=score_func, norm_topk=norm_topk)

    if not callable(getattr(capfused, "route", None)):  # fail loudly, never route silently
        raise RuntimeError("balanced routing: kernels.fused.capturable has no module-level "
                           "`route` to replace")
    capfused.route = route  # what the capturable mega_moe calls

    def hashed(fn):
        def run(*args, **attrs):
            a = list(args) + [None] * (22 - len(args))
            x, gate_w = a[0], a[6]
            a[7] = None  # no selection bias with hash routing
            a[20] = _balanced_table(gate_w.shape[0], attrs["topk"], x.device)
            a[21] = torch.arange(x.shape[0], dtype=torch.int64, device=x.device) % gate_w.shape[0]
            return fn(*a, **attrs)

        for k in ("capturable",):
            if hasattr(fn, k):
                setattr(run, k, getattr(fn, k))
        return run

    resolve = engine_mod.resolve_kernels

    def resolve_balanced(plan, graphs, device, **kw):
        ks = resolve(plan, graphs, device, **kw)
        for g in graphs:
            for n in g.nodes:
                fn = ks.impls.get(n.outputs[0])
                if n.op == "mega_moe" and fn is not None and _takes(fn, "tid2eid"):
                    ks.impls[n.outputs[0]] = hashed(fn)
                elif n.op == "route":  # unfused graphs (the CPU profile)
                    ks.impls[n.outputs[0]] = route
        return ks

    engine_mod.resolve_kernels = resolve_balanced  # what Engine.__init__ calls
    _INSTALLED = True


def _takes(fn, param: str) -> bool:
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
