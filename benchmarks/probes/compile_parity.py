"""Where torch.compile's logits leave the uncompiled engine's: per step, per compile variant.

On the H200 the compiled tiny model's tokens can disagree with eager (decode_runtime.py shows it)
while the CPU test (tests/runtime/test_compile_parity.py, fp32 activations) agrees to 1e-4. This
separates the candidate causes with the same inputs and buffers (the `padded` engine: same
buckets, no capture) as the reference:

- `aot_eager`: Dynamo + AOTAutograd (functionalization, graph breaks around the Triton kernels,
  in-place state) without Inductor's code: a difference here is a tracing / mutation bug;
- `inductor`: Inductor's generated kernels: fused bf16 chains computed in fp32 without the
  intermediate roundings eager does;
- `inductor+emulate`: the same with `torch._inductor.config.emulate_precision_casts` (Inductor
  rounds every intermediate to its eager dtype): if this agrees, the difference is rounding,
  which FP8 activation codes and top-k selections then amplify over layers and steps;
- `inductor+noalias`: state pools not aliased to the static output buffers
  (`GraphRunner._aliasable` empty: every state update is copied into its pool after the segment);
- `inductor+functional`: the library state kernels (Triton compressor, ring copies) return new
  tensors instead of writing their pools in place (`runtime/kernels.py:_state_in_place` off).
  If either agrees where `inductor` does not, that engine feature meets Inductor badly;
- `inductor+clone`: every input of a compiled segment cloned at the call (no input aliases another
  or a pool: the state a step writes is lost, so only `decode 1` counts);
- `inductor+nofusion`: Inductor fuses nothing (`max_fusion_size = 1`, no pattern matcher);
- `inductor+static`: Dynamo never turns a recompile dynamic (`automatic_dynamic_shapes` off; the
  engine asks for static shapes, but frames between graph breaks can recompile up to the
  limit);
- `inductor+e8m0`: E8M0 scale weights enter the compiled segments as float8_e8m0fnu, not as their
  uint8 bytes (runtime/compile.py:wrap; compile_bisect.py passes them as they are). Compiling
  may fail;
- `padded+again`: the uncompiled engine a second time: any difference here is eager's own
  run-to-run nondeterminism (atomic adds), which no compiled variant can be expected to beat;
- `inductor+fast`: Inductor's own numerics (`--compile-numerics fast`); every other Inductor
  variant compiles with the engine's default eager numerics (fp32 division and bf16 casts rounded
  as eager rounds them, runtime/compile.py:numerics_options);
- `inductor+deterministic`: `torch.use_deterministic_algorithms(True)` while building and
  running (Inductor then emits no atomic scatter-adds); if it agrees where `inductor` does not,
  the difference is summation order, not a miscompile.
Each variant also records Dynamo's graph and recompile counts.

Every state pool (but its scratch slot, where pad rows write) is compared too, after start-up
and after each step: the first step whose pools differ is where the compiled engine leaves the
uncompiled one, even where its logits do not show it.

    python benchmarks/probes/compile_parity.py --out /tmp/cp                # GPU
    python benchmarks/probes/compile_parity.py --out /tmp/cp --device cpu   # CPU (slow: Inductor)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # the sibling probes, benchmarks/harness
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from harness.engines import sync  # noqa: E402
from harness.env import environment  # noqa: E402
from harness.models import load_model  # noqa: E402

VARIANTS = ("padded", "aot_eager", "inductor", "inductor+emulate", "inductor+noalias",
            "inductor+functional", "inductor+clone", "inductor+nofusion", "inductor+static",
            "inductor+e8m0", "padded+again", "inductor+deterministic", "inductor+fast")


def make(plan, weights, variant: str, args, device):
    """The engine of `variant` (the engine features a variant turns off stay off only while it
    is built: buffers and kernels are chosen at start-up)."""
    import contextlib
    import functools
    from unittest import mock

    from megagraph.runtime import cuda_graphs, kernels
    from megagraph.runtime.engine import Engine, EngineConfig
    from megagraph.runtime.token_map import stand_in_token_map

    backend = {"padded": "none", "padded+again": "none",
               "aot_eager": "aot_eager"}.get(variant, "inductor")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._inductor.config.emulate_precision_casts = variant == "inductor+emulate"
    conf = EngineConfig(device=str(device), max_slots=args.batch, capacity=256,
                        max_step_tokens=4096, kernels="capturable", progress=False,
                        allow_fallback=device.type == "cpu", cuda_graphs=False,
                        buckets=(args.batch,), compile=backend,
                        compile_numerics="fast" if variant.endswith("+fast") else "eager")
    torch._inductor.config.max_fusion_size = 1 if variant == "inductor+nofusion" else 64
    torch._inductor.config.pattern_matcher = variant != "inductor+nofusion"
    torch._dynamo.config.automatic_dynamic_shapes = variant != "inductor+static"
    from megagraph.runtime import compile as rc

    def wrap_cloned(program, *a, **k):
        f = rc_wrap(program, *a, **k)
        return lambda env: f({n: v.clone() if isinstance(v, torch.Tensor) else v
                              for n, v in env.items()})
    rc_wrap = rc.wrap
    off = {"inductor+clone": mock.patch.object(rc, "wrap", wrap_cloned),
           "inductor+e8m0": mock.patch.object(rc, "wrap",
                                              functools.partial(rc_wrap, e8m0_as_bytes=False)),
           "inductor+noalias": mock.patch.object(cuda_graphs.GraphRunner, "_aliasable",
                                                 lambda self: {}),
           "inductor+functional": mock.patch.object(kernels, "_state_in_place",
                                                    lambda fn, n, unsafe: fn)}
    with off.get(variant, contextlib.nullcontext()):
        return Engine(plan, dict(weights), conf, token_map=stand_in_token_map(plan.cfg))


def steps(eng, args):
    """A prefill of `--context` random tokens per request, then teacher-forced decode steps (the
    same seeded inputs in every variant): yields each step's logits on the CPU."""
    from megagraph.runtime.batch import SeqChunk

    gen = torch.Generator().manual_seed(7)
    vocab = eng.cfg.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.context), generator=gen).tolist()
    slots = [eng.slots.allocate() for _ in range(args.batch)]
    yield eng.step([SeqChunk(s, tuple(p)) for s, p in zip(slots, prompts)]).float().cpu()
    while True:
        row = torch.randint(3, vocab, (args.batch,), generator=gen).tolist()
        yield eng.step([SeqChunk(s, (t,)) for s, t in zip(slots, row)]).float().cpu()


def run(eng, args, states: list | None = None) -> list[torch.Tensor]:
    """Logits of the prefill step and `--steps` decode steps; with `states`, a CPU copy of every
    state pool after start-up and after each step is appended there."""
    scratch = eng.slots.scratch_slot

    def snap():
        # the scratch slot (where every pad row writes) is left out: pad rows' values are never
        # read by a request, and compiled code may compute them differently (empty contexts)
        if states is not None:
            states.append({k: (v[:scratch] if v.dim() and v.shape[0] == scratch + 1 else v)
                           .cpu().clone() for k, v in eng.state.items()})
    snap()
    it = steps(eng, args)
    outs = []
    for _ in range(1 + args.steps):
        outs.append(next(it))
        snap()
    sync(torch.device(eng.config.device))
    return outs


def dynamo_counts() -> dict:
    """Dynamo's counters since the last reset (unique graphs, frames, recompile reasons)."""
    from torch._dynamo.utils import counters

    return {k: dict(counters[k]) for k in ("stats", "recompiles", "graph_break") if counters.get(k)}


def state_diffs(got: list[dict], want: list[dict]) -> list[dict]:
    """Per snapshot (start-up, prefill, decode 1, ...): the state pools that differ, and how."""
    from compile_bisect import compare

    rows = []
    for k, (a, b) in enumerate(zip(got, want)):
        bad = {}
        for name in b:
            r = compare(a[name], b[name])
            if r["bad"] or r.get("rel", 0) > 0:
                bad[name] = r
        rows.append({"after": ["start-up", "prefill"][k] if k < 2 else f"decode {k - 1}",
                     "differing_pools": bad})
    return rows


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments compile_parity.py, compile_bisect.py and compile_subsystem.py share."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--hw", default=None, help="hardware profile (default: this device's)")
    return p


def results(args, name: str, **fields):
    """(device, result dict, save()) of a diagnostic writing `<out>/<name>.json`: the environment
    and the arguments first, `fields` after; save() rewrites the file (a run cut short keeps what
    it found)."""
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"environment": environment(device), "args": vars(args), **fields}

    def save():
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return device, res, save


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    device, res, save = results(args, "compile_parity", variants={})
    with tempfile.TemporaryDirectory(prefix="megagraph-cp-") as tmp:
        m = load_model(args.model, device, Path(tmp), hw=args.hw, log=print)
        logits, states = {}, {}
        for v in ["padded"] + [v for v in args.variants.split(",") if v != "padded"]:
            try:
                states[v] = []
                torch.use_deterministic_algorithms(v.endswith("+deterministic"), warn_only=True)
                logits[v] = run(make(m.plan, m.weights, v, args, device), args, states[v])
            except Exception as e:  # keep the other variants
                res["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
                print(v, "FAILED", e, flush=True)
                continue
            finally:
                torch.use_deterministic_algorithms(False)
            if v == "padded":
                continue
            rows = []
            for k, (a, b) in enumerate(zip(logits[v], logits["padded"])):
                rows.append({"step": "prefill" if k == 0 else f"decode {k}",
                             "max_abs_diff": (a - b).abs().max().item(),
                             "max_abs_ref": b.abs().max().item(),
                             "nan": bool(torch.isnan(a).any()),
                             "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()})
            res["variants"][v] = {"steps": rows, "state": state_diffs(states[v], states["padded"]),
                                  "dynamo": dynamo_counts()}
            print(v, json.dumps(rows), flush=True)
            for r in res["variants"][v]["state"]:
                print(f"  state after {r['after']}: {len(r['differing_pools'])} pools differ "
                      f"{sorted(r['differing_pools'])[:6]}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
