"""Which node torch.compile computes differently: the segments of one decode step, compiled in
chunks of nodes (then node by node inside a chunk that differs) on the eager inputs of that chunk.

compile_parity.py shows *that* the compiled engine leaves the uncompiled one (and that aot_eager,
i.e. tracing and functionalization without Inductor's code, does not); this finds *where*. Each
chunk starts from the eager values at its start (so errors do not propagate between chunks), runs
eagerly and compiled (Inductor) on clones, and compares every output and every input it mutated:
floats by max |diff| / max |eager|, integers and FP8 codes by the fraction of elements that
differ. Library kernels (the plan's Triton nodes) and the engine's untraced nodes
(runtime/engine.py:untraced_nodes) run opaque, as in runtime/compile.py:wrap.

    python benchmarks/probes/compile_bisect.py --out /tmp/cb            # GPU, the tiny V4.1, B=8
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # the sibling probes, benchmarks/harness
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from compile_parity import make, parser, results, steps  # noqa: E402
from harness.models import load_model  # noqa: E402


def clone(v):
    return v.clone() if isinstance(v, torch.Tensor) else v


def compare(a, b) -> dict:
    """How far `a` (compiled) is from `b` (eager)."""
    if not isinstance(b, torch.Tensor):
        return {"kind": "other", "bad": a != b}
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"kind": "shape", "bad": True, "got": f"{tuple(a.shape)} {a.dtype}",
                "want": f"{tuple(b.shape)} {b.dtype}"}
    if b.numel() == 0:
        return {"kind": "empty", "bad": False}
    if b.dtype.is_floating_point and b.element_size() > 1:
        af, bf = a.float(), b.float()
        nan = bool((torch.isnan(af) != torch.isnan(bf)).any())
        fin = ~(torch.isnan(af) | torch.isnan(bf))
        scale = bf[fin].abs().max().item() if fin.any() else 0.0
        diff = (af - bf)[fin].abs().max().item() if fin.any() else 0.0
        rel = diff / scale if scale else diff
        return {"kind": "float", "rel": rel, "nan_mismatch": nan, "bad": nan or rel > 1e-2}
    x, y = (a.view(torch.uint8), b.view(torch.uint8)) if b.element_size() == 1 and \
        b.dtype.is_floating_point else (a, b)
    frac = (x != y).float().mean().item()
    return {"kind": str(b.dtype), "mismatch": frac, "bad": frac > 0}


def run_calls(calls, vals: dict, fns=None) -> None:
    """Run `calls` (with `fns` in place of their kernels, if given) on `vals`, adding outputs."""
    for c, fn in zip(calls, fns or [c.fn for c in calls]):
        out = fn(*[None if i is None else vals[i] for i in c.inputs], **c.attrs)
        vals.update(zip(c.outputs, out if isinstance(out, tuple) else (out,)))


def chunk_fn(calls, names, opaque):
    """A function of the chunk's input values that runs its calls and returns (outputs, inputs)."""
    fns = [torch.compiler.disable(c.fn) if c.outputs[0] in opaque else c.fn for c in calls]

    def f(*tensors):
        vals = dict(zip(names, tensors))
        run_calls(calls, vals, fns)
        return tuple(vals[o] for c in calls for o in c.outputs), tuple(vals[n] for n in names)

    return f


def split_backend(backend: str) -> tuple[str, str]:
    """"inductor" -> (inductor, eager numerics), "inductor+fast" -> (inductor, fast)."""
    name, _, fast = backend.partition("+")
    return name, "fast" if fast == "fast" else "eager"


def compiled(f, backend: str):
    """torch.compile of `f` with the engine's numerics options for `backend`."""
    from megagraph.runtime.compile import numerics_options

    name, numerics = split_backend(backend)
    return torch.compile(f, backend=name, options=numerics_options(name, numerics) or None)


def checked(calls, vals, opaque, backend, where: str, weights=frozenset()) -> list[dict]:
    """check_chunk, with a compile failure recorded as a finding."""
    try:
        return check_chunk(calls, vals, opaque, backend, weights)
    except Exception as e:  # noqa: BLE001
        return [{"value": where, "bad": True, "error": f"{type(e).__name__}: {e}"[:300]}]


def check_chunk(calls, vals, opaque, backend, weights=frozenset()) -> list[dict]:
    """Run `calls` from `vals` eagerly and compiled; one record per output / mutated input."""
    names = list(dict.fromkeys(i for c in calls for i in c.inputs if i is not None and i in vals))
    f = chunk_fn(calls, names, opaque)
    # weights are read only: shared, not cloned (a full-width slice's 30 GiB would not fit thrice)
    fresh = lambda: [vals[n] if n in weights else clone(vals[n]) for n in names]  # noqa: E731
    want = f(*fresh())
    torch._dynamo.reset()
    got = compiled(f, backend)(*fresh())
    outs = [o for c in calls for o in c.outputs]
    recs = []
    for name, a, b in zip(outs + [f"{n} (after, input)" for n in names],
                          list(got[0]) + list(got[1]), list(want[0]) + list(want[1])):
        r = compare(a, b)
        r["value"] = name
        recs.append(r)
    return recs


def bisect(program, env, opaque, chunk: int, backend: str, log, found: list, save,
           every: list | None = None, refine: bool = True) -> None:
    """Chunks of `chunk` calls; a chunk with a bad record is re-checked call by call (findings
    appended to `found`, `save()` after each chunk: a run cut short keeps what it found). With
    `every`, each chunk's records are kept there too (in call order: how an error grows)."""
    vals = {**program.weights, **{k: clone(v) for k, v in env.items()}}
    weights = frozenset(program.weights)
    calls = list(program.calls)
    for s in range(0, len(calls), chunk):
        part = calls[s:s + chunk]
        recs = checked(part, vals, opaque, backend, "(chunk)", weights)
        bad = [r for r in recs if r["bad"]]
        worst = max([r for r in recs if "rel" in r or "mismatch" in r],
                    key=lambda r: r.get("rel", r.get("mismatch", 0)), default={})
        log(f"  {program.name} calls {s}-{s + len(part) - 1}: {len(bad)} differing values; "
            f"largest difference {worst.get('value')}: "
            f"{worst.get('rel', worst.get('mismatch'))}")
        if every is not None:
            every.extend(recs)
        if bad and refine:
            for c in part:
                for r in checked([c], vals, opaque, backend, "(call)", weights):
                    if r["bad"]:
                        r["call"] = c.label
                        found.append(r)
                        log(f"    {c.label}: {json.dumps(r)}")
                run_calls([c], vals)
        else:
            run_calls(part, vals)
        save()


def engine_fn_check(plan, weights, args, device, seen, log) -> list[dict]:
    """The compiled engine's own segment functions (runtime/compile.py:wrap with `--backend`
    inductor, or aot_eager for any other backend; compiled at its
    start-up warm-up) on the recorded eager inputs, against eager; then the same `wrap` of each
    program compiled afresh on those inputs ("fresh wrap", no warm-up). Where the engine's
    functions differ and the chunks compiled here do not, the difference is in how the engine
    compiles: at the warm-up (if the fresh wrap agrees) or in `wrap` itself (if it does not)."""
    from megagraph.runtime import compile as rc
    from megagraph.runtime.engine import untraced_nodes

    backend = args.backend if split_backend(args.backend)[0] == "inductor" else "aot_eager"
    eng = make(plan, weights, backend, args, device)
    fresh = {}  # segment -> wrap() of its program, compiled on the recorded inputs (no warm-up)
    recs = []
    for which in ("engine fn", "fresh wrap"):
        for program, env in seen:
            if not program.name.endswith(":graph"):
                continue
            k = int(program.name.split(":")[0])
            if which == "engine fn":
                fn = eng.runner.fns[k]
            else:
                torch._dynamo.reset()
                name, numerics = split_backend(backend)
                fn = fresh.setdefault(k, rc.wrap(program, name, 1, False,
                                                 eng.kernels.opaque | untraced_nodes(plan.graph),
                                                 numerics=numerics))
            want = program({n: clone(v) for n, v in env.items()})
            got = fn({n: clone(v) for n, v in env.items()})
            mine = []
            for name, b in want.items():
                r = compare(got[name], b)
                r["value"], r["segment"], r["check"] = name, program.name, which
                mine.append(r)
            recs += mine
            log(f"  {which} {program.name}: {sum(r['bad'] for r in mine)} of {len(want)} outputs "
                "differ")
    return recs


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--chunk", type=int, default=12, help="calls per compiled chunk")
    p.add_argument("--backend", default="inductor",
                   help="inductor (the engine's eager numerics), inductor+fast, aot_eager, eager")
    p.add_argument("--every", action="store_true", help="keep every value's comparison")
    p.add_argument("--no-refine", action="store_true", help="no node-by-node pass")
    p.add_argument("--engine-fn", action="store_true",
                   help="also run the compiled engine's own segment functions on the same inputs")
    p.add_argument("--decode-step", type=int, default=1,
                   help="which decode step's inputs to record (1: the first after the prefill)")
    args = p.parse_args(argv)
    from megagraph.runtime import segments
    from megagraph.runtime.engine import untraced_nodes

    device, res, save = results(args, "compile_bisect", segments=[])
    with tempfile.TemporaryDirectory(prefix="megagraph-cb-") as tmp:
        m = load_model(args.model, device, Path(tmp), hw=args.hw, log=print)
        eng = make(m.plan, m.weights, "padded", args, device)
        it = steps(eng, args)
        next(it)  # the prefill, uncompiled
        for _ in range(args.decode_step - 1):
            next(it)  # earlier decode steps, uncompiled
        seen = []
        orig = segments.Program.__call__

        def record(self, env):
            seen.append((self, {k: clone(v) for k, v in env.items()}))
            return orig(self, env)

        segments.Program.__call__ = record
        try:
            next(it)  # decode step `--decode-step`: the one to bisect
        finally:
            segments.Program.__call__ = orig
        if args.engine_fn:
            res["engine_fn"] = engine_fn_check(m.plan, m.weights, args, device, seen, print)
            save()
        for program, env in seen:
            if not program.name.endswith(":graph"):
                continue  # break segments run eagerly under compile too (runtime/engine.py)
            print(f"segment {program.name}: {len(program.calls)} calls", flush=True)
            found: list[dict] = []
            every: list[dict] | None = [] if args.every else None
            res["segments"].append({"name": program.name, "calls": len(program.calls),
                                    "differing": found, "every": every})
            opaque = eng.kernels.opaque | untraced_nodes(eng.plan.graph)
            bisect(program, env, opaque, args.chunk, args.backend, print, found, save, every,
                   not args.no_refine)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
