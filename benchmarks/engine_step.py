"""Engine.step time per decode batch on the artifacts a server serves: the engine-alone baseline
of the serving overhead (served inter-token latency / engine step time at the same batch).

The same measurement as benchmarks/decode.py (harness/engines.py run_steps: a device synchronize around
`Engine.step`, random contents in every state pool, every request at `--context` cached tokens,
one token each), but on the served artifact directory rather than a fresh compile, with the
server's state capacity and slot count, and with the bucket the server pads B decode rows to
(the plan's smallest bucket >= B, captured as a CUDA graph on CUDA; on the CPU the server runs
exact shapes eagerly, and so does this). Weights: random, made on the device with the server's
seed. Run it in its own process before the server starts: the two would otherwise hold two copies
of the weights. What it leaves out of a served step is the serving path: sampling, the host work
of the scheduler not hidden by the overlap, detokenization, SSE and HTTP.

Served steps are not all decode-only: the prompt chunks of arriving requests join the decode
rows of the steps they arrive in. `--mixes D:P,...` measures steps of D decode rows (at
`--context`) plus P prompt tokens, cut into chunks of at most `--chunk` tokens, each a new
request's first chunk (nothing cached), on slots of their own: the engine alone at the batch
composition the server reports for a point (/metrics: decode-only and mixed steps, their decode
rows and prompt tokens), so that served ITL can be set against a step of the same mix. A mix
`D:P:C` gives its own chunk size C.

    python benchmarks/engine_step.py --artifacts A --device cuda --capacity 16640 --slots 256 \
        --batches 1,8,32,64,128,256 --context 1152 --out engine_step.json
    python benchmarks/engine_step.py ... --batches= --mixes 250:0,247:1310 --chunk 1024
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import engines as wl  # noqa: E402
from harness.env import environment  # noqa: E402


def served_bucket(plan_buckets: tuple[int, ...], rows: int) -> int | None:
    """The bucket the server's engine pads `rows` decode rows to (None: above every bucket)."""
    return next((b for b in sorted(plan_buckets) if b >= rows), None)


def mix_chunks(decode: int, prompt: int, chunk: int) -> list[int]:
    """Token counts of the step's chunks: `decode` single tokens, then `prompt` tokens in chunks
    of at most `chunk` (the server cuts a prompt at its prefill cap and takes whole prompts up
    to it, so an arriving request of the sweep's input length is one chunk)."""
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be at least 1")
    return [1] * decode + [min(chunk, prompt - i) for i in range(0, prompt, chunk)]


def run_mixed(eng, chunks, cached: dict[int, int], warmup: int, iters: int, device,
              cap_s: float = 3.0) -> list[float]:
    """ms per step over `chunks`, each slot starting from its `cached` tokens every time:
    the per-slot form of harness.engines.run_steps (decode rows at the context, prompt chunks at 0)."""
    times: list[float] = []
    n_warm = 0
    while True:
        eng.cached.update(cached)
        wl.sync(device)
        t0 = time.perf_counter()
        eng.step(chunks)
        wl.sync(device)
        dt = time.perf_counter() - t0
        if n_warm < warmup:  # a slow path (over cap_s) ends the warm-up
            n_warm = warmup if dt > cap_s else n_warm + 1
            continue
        times.append(1e3 * dt)
        if len(times) >= iters or sum(times) > 1e3 * cap_s:
            break
    eng.cached.update(cached)
    return times


def measure(artifacts: str, *, device: str, capacity: int, slots: int, batches: list[int],
            context: int, warmup: int = 3, iters: int = 10, seed: int = 0,
            cuda_graphs: bool = True, mixes: list[tuple[int, ...]] = (),
            chunk: int = 1024) -> dict:
    import torch

    from megagraph.runtime.batch import SeqChunk
    from megagraph.runtime.engine import Engine, EngineConfig
    from megagraph.runtime.plan import RunPlan

    dev = torch.device(device)
    plan = RunPlan.from_artifacts(artifacts)
    graphs = dev.type == "cuda" and cuda_graphs
    mixes = [(m[0], m[1], m[2] if len(m) > 2 else chunk) for m in mixes]
    sizes = list(batches) + [d + p for d, p, _ in mixes]
    buckets = tuple(sorted({b for T in sizes if (b := served_bucket(plan.buckets, T))})) \
        if graphs else ()
    t0 = time.perf_counter()
    eng = Engine(plan, None, EngineConfig(device=device, max_slots=slots, capacity=capacity,
                                          seed=seed, random_weights="fast", progress=False,
                                          cuda_graphs=graphs, buckets=buckets))
    startup_s = time.perf_counter() - t0
    wl.fill_state(eng, seed)
    if context + 1 > capacity:
        raise ValueError(f"--context {context} leaves no room for a token at --capacity {capacity}")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for B in batches:
        if B > slots:
            rows.append({"B": B, "skipped": f"more requests than the {slots} slots"})
            continue
        ids = torch.randint(100, eng.cfg.vocab_size - 300, (B,), generator=gen).tolist()
        chunks = [SeqChunk(i, (t,)) for i, t in enumerate(ids)]
        times = wl.run_steps(eng, chunks, context, warmup, iters, dev)
        rows.append({"B": B, "path": wl.step_path(eng, B),
                     "ms": float(sorted(times)[len(times) // 2]),
                     "ms_mean": sum(times) / len(times), "ms_all": times})
    mix_rows = []
    for D, P, C in mixes:
        sizes = mix_chunks(D, P, C)
        if len(sizes) > slots:
            mix_rows.append({"decode": D, "prompt": P, "chunk": C,
                             "skipped": f"{len(sizes)} chunks, {slots} slots"})
            continue
        ids = torch.randint(100, eng.cfg.vocab_size - 300, (D + P,), generator=gen).tolist()
        chunks, at = [], 0
        for slot, n in enumerate(sizes):
            chunks.append(SeqChunk(slot, tuple(ids[at:at + n])))
            at += n
        cached = {slot: context if slot < D else 0 for slot in range(len(sizes))}
        times = run_mixed(eng, chunks, cached, warmup, iters, dev)
        mix_rows.append({"decode": D, "prompt": P, "chunk": C, "chunks": sizes[D:],
                         "path": wl.step_path(eng, D + P),
                         "ms": float(sorted(times)[len(times) // 2]),
                         "ms_mean": sum(times) / len(times), "ms_all": times})
    out = {"artifacts": str(artifacts), "model": eng.cfg.name, "device": device,
           "capacity": capacity, "slots": slots, "context": context, "warmup": warmup,
           "iters": iters, "buckets": list(buckets), "startup_s": round(startup_s, 2),
           "startup": eng.report.lines(), "rows": rows, "chunk": chunk, "mix_rows": mix_rows,
           "environment": environment(dev)}
    if dev.type == "cuda":
        out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    eng.close()
    return out


def step_ms(engine: dict | None, B: int) -> float | None:
    """The engine's step time at B requests from a measure() result."""
    for r in (engine or {}).get("rows", ()):
        if r["B"] == B and "ms" in r:
            return r["ms"]
    return None


def mix_ms(engine: dict | None, decode: int, prompt: int, chunk: int) -> float | None:
    """The engine's step time at `decode` rows + `prompt` tokens in chunks of at most `chunk`,
    from a measure() result."""
    for r in (engine or {}).get("mix_rows", ()):
        if (r["decode"], r["prompt"], r["chunk"]) == (decode, prompt, chunk) and "ms" in r:
            return r["ms"]
    return None


def parse_mixes(text: str) -> list[tuple[int, ...]]:
    """'250:0,247:1310:1024' -> [(250, 0), (247, 1310, 1024)]"""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = tuple(int(x) for x in item.split(":"))
        if len(parts) not in (2, 3):
            raise ValueError(f"mix {item!r}: D:P or D:P:C")
        out.append(parts)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--capacity", type=int, required=True, help="the server's --capacity")
    p.add_argument("--slots", type=int, required=True, help="the server's --max-running")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--context", type=int, required=True, help="cached tokens per request")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="the server's --seed")
    p.add_argument("--no-cuda-graphs", action="store_true", help="as the server's flag")
    p.add_argument("--mixes", default="",
                   help="D:P[:C],... steps of D decode rows + P prompt tokens (chunks <= C)")
    p.add_argument("--chunk", type=int, default=1024, help="largest prompt chunk of a mix")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)
    res = measure(a.artifacts, device=a.device, capacity=a.capacity, slots=a.slots,
                  batches=[int(b) for b in a.batches.split(",") if b], context=a.context,
                  warmup=a.warmup, iters=a.iters, seed=a.seed, cuda_graphs=not a.no_cuda_graphs,
                  mixes=parse_mixes(a.mixes), chunk=a.chunk)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        print(f"B={r['B']}: " + (f"{r['ms']:.3f} ms ({r['path']})" if "ms" in r else r["skipped"]),
              flush=True)
    for r in res["mix_rows"]:
        print(f"{r['decode']} decode rows + {r['prompt']} prompt tokens: "
              + (f"{r['ms']:.3f} ms ({r['path']})" if "ms" in r else r["skipped"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
