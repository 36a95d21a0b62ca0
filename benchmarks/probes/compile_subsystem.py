"""Which part of torch.compile makes the compiled engine's logits differ: torch's own compiler
bisector (torch._inductor.compiler_bisector) driven by the engine's first decode step.

compile_parity.py says *that* Inductor's logits differ (and aot_eager's do not); compile_bisect.py
compiles chunks of nodes on their eager inputs. This asks torch instead: the bisector re-runs the
check with backends, then Inductor subsystems (pre/post-grad passes, lowerings, ...) switched off,
then bisects how many applications of the guilty subsystem it takes (for lowerings: which op's
lowering). Each try builds and compiles the engine anew (~20 s on the tiny model).

    python benchmarks/probes/compile_subsystem.py --out /tmp/cs        # GPU, the tiny V4.1, B=8
    python benchmarks/probes/compile_subsystem.py --out /tmp/cs --only lowerings  # which lowering
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # the sibling probes, benchmarks/harness
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from compile_parity import make, parser, results, run  # noqa: E402
from harness.models import load_model  # noqa: E402


@contextlib.contextmanager
def only_subsystems(names: str | None):
    """torch's bisector restricted to these Inductor subsystems (its module-level BACKENDS table,
    changed in place and restored): the backends before Inductor and the other subsystems are
    skipped."""
    from torch._inductor import compiler_bisector as cb

    if not names:
        yield
        return
    want = names.split(",")
    known = {s.name: s for s in cb.BACKENDS["inductor"]}
    if unknown := [n for n in want if n not in known]:
        raise ValueError(f"unknown Inductor subsystem(s) {unknown}; known: {sorted(known)}")
    saved = dict(cb.BACKENDS)
    cb.BACKENDS.clear()
    cb.BACKENDS["inductor"] = [known[n] for n in want]
    try:
        yield
    finally:
        cb.BACKENDS.clear()
        cb.BACKENDS.update(saved)


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=1, help="decode steps compared per try")
    p.add_argument("--rel", type=float, default=1e-3,
                   help="largest max|diff| / max|logit| a try may show and still pass")
    p.add_argument("--only", default=None,
                   help="comma-separated Inductor subsystems to bisect (e.g. lowerings), skipping "
                        "the backends and the others: ~30 s per try saved each")
    args = p.parse_args(argv)
    from torch._inductor.compiler_bisector import CompilerBisector

    torch._inductor.config.force_disable_caches = True  # every try compiles under its own switches
    device, res, save = results(args, "compile_subsystem", tries=[])
    with tempfile.TemporaryDirectory(prefix="megagraph-cs-") as tmp:
        m = load_model(args.model, device, Path(tmp), hw=args.hw, log=print)
        want = run(make(m.plan, m.weights, "padded", args, device), args)

        def agrees() -> bool:
            t = time.perf_counter()
            got = run(make(m.plan, m.weights, "inductor", args, device), args)
            rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))
            ok = rel <= args.rel
            res["tries"].append({"backend": CompilerBisector.get_backend(),
                                 "subsystem": CompilerBisector.get_subsystem(),
                                 "rel": rel, "ok": ok,
                                 "seconds": round(time.perf_counter() - t, 1)})
            print(json.dumps(res["tries"][-1]), flush=True)
            save()
            return ok

        if agrees():
            res["result"] = "compiled logits agree: nothing to bisect"
        else:
            with only_subsystems(args.only):
                r = CompilerBisector.do_bisect(agrees)
            res["result"] = None if r is None else vars(r)
        print("result:", json.dumps(res["result"], default=str), flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
