"""Where torch.compile's logits leave the uncompiled engine's: per step, per compile variant.

decode_runtime.py found the compiled tiny model's tokens disagreeing with eager on the H200 while
the CPU test (tests/runtime/test_compile_parity.py, fp32 activations) agrees to 1e-4. This separates
the candidate causes with the same inputs and buffers (the `padded` engine: same buckets, no
capture) as the reference:

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
- `inductor+nofusion`: Inductor fuses nothing (`max_fusion_size = 1`, no pattern matcher).

    python benchmarks/compile_parity.py --out /tmp/cp                # GPU
    python benchmarks/compile_parity.py --out /tmp/cp --device cpu   # CPU (slow: Inductor on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from workloads import environment, load_model, sync  # noqa: E402

VARIANTS = ("padded", "aot_eager", "inductor", "inductor+emulate", "inductor+noalias",
            "inductor+functional", "inductor+clone", "inductor+nofusion")


def make(plan, weights, variant: str, args, device):
    """The engine of `variant` (the engine features a variant turns off stay off only while it
    is built: buffers and kernels are chosen at start-up)."""
    import contextlib
    from unittest import mock

    from megagraph.runtime import cuda_graphs, kernels
    from megagraph.runtime.engine import Engine, EngineConfig

    backend = {"padded": "none", "aot_eager": "aot_eager"}.get(variant, "inductor")
    torch._dynamo.reset()
    torch._inductor.config.emulate_precision_casts = variant == "inductor+emulate"
    conf = EngineConfig(device=str(device), max_slots=args.batch, capacity=256,
                        max_step_tokens=4096, kernels="capturable", progress=False,
                        allow_fallback=device.type == "cpu", cuda_graphs=False,
                        buckets=(args.batch,), compile=backend,
                        unverified_compile=True)
    torch._inductor.config.max_fusion_size = 1 if variant == "inductor+nofusion" else 64
    torch._inductor.config.pattern_matcher = variant != "inductor+nofusion"
    from megagraph.runtime import compile as rc

    def wrap_cloned(program, *a, **k):
        f = rc_wrap(program, *a, **k)
        return lambda env: f({n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in env.items()})
    rc_wrap = rc.wrap
    off = {"inductor+clone": mock.patch.object(rc, "wrap", wrap_cloned),
           "inductor+noalias": mock.patch.object(cuda_graphs.GraphRunner, "_aliasable", lambda self: {}),
           "inductor+functional": mock.patch.object(kernels, "_state_in_place", lambda fn, n, unsafe: fn)}
    with off.get(variant, contextlib.nullcontext()):
        return Engine(plan, dict(weights), conf)


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


def run(eng, args) -> list[torch.Tensor]:
    """Logits of the prefill step and `--steps` decode steps."""
    it = steps(eng, args)
    outs = [next(it) for _ in range(1 + args.steps)]
    sync(torch.device(eng.config.device))
    return outs


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments compile_parity.py and compile_bisect.py share."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--hw", default=None, help="hardware profile (default: this device's)")
    return p


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"environment": environment(device), "args": vars(args), "variants": {}}
    with tempfile.TemporaryDirectory(prefix="megagraph-cp-") as tmp:
        m = load_model(args.model, device, Path(tmp), hw=args.hw, log=print)
        logits = {}
        for v in ["padded"] + [v for v in args.variants.split(",") if v != "padded"]:
            try:
                logits[v] = run(make(m.plan, m.weights, v, args, device), args)
            except Exception as e:  # keep the other variants
                res["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
                print(v, "FAILED", e, flush=True)
                continue
            if v == "padded":
                continue
            rows = []
            for k, (a, b) in enumerate(zip(logits[v], logits["padded"])):
                rows.append({"step": "prefill" if k == 0 else f"decode {k}",
                             "max_abs_diff": (a - b).abs().max().item(),
                             "max_abs_ref": b.abs().max().item(),
                             "nan": bool(torch.isnan(a).any()),
                             "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()})
            res["variants"][v] = {"steps": rows}
            print(v, json.dumps(rows), flush=True)
    (out / "compile_parity.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
