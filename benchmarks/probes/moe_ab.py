"""A/B of MegaMoE configurations in one process: kernel-config fields (MoeConfig / GemmConfig,
"family.field=value" as `compile --set` takes them, e.g. moe.cublas_prefill=false,
moe.gluon_decode_load=cp.async, gemm.cublas_form_prefill=1x128) set per row, rows interleaved over rounds (each round's order rotated by one) so that they compare within
one run (between device calls the same row moves by up to 5%). Real V4.1-Flash dims and the
inputs of benchmarks/kernels.py's MoE rows.
Each configuration's output is compared with the first configuration's (relative Frobenius
error), so a faster row that is wrong shows.

    python3 benchmarks/probes/moe_ab.py --out DIR --tokens 8192 \
        --configs "base:/no_fp8h:moe.fp8_h_prefill=false/triton_l2:moe.gluon_prefill_l2=false"

Writes DIR/moe-ab.json and DIR/moe-ab.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),  # probes/ and benchmarks/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from kernel_rows import moe as m, time_ms  # noqa: E402


def parse_configs(spec: str) -> list[tuple[str, list[str], dict]]:
    """"name:fam.field=v,fam.field=v/name2:..." -> [(name, settings, {family: KernelConfig})]:
    the settings resolved by kernel_config (values are YAML scalars; the settings are
    comma-separated, so a list-valued field needs a kernel-config file instead).
    Configurations are separated by "/" (or ";", which benchmarks/h200_check.sh splits steps
    on)."""
    from megagraph.kernels import kernel_config as kc

    out = []
    for part in filter(None, (p.strip() for p in spec.replace(";", "/").split("/"))):
        name, _, knobs = part.partition(":")
        sets = [kv.strip() for kv in knobs.split(",") if kv.strip()]
        try:
            out.append((name.strip(), sets, kc.resolve(kc.parse_set(sets), where=name)))
        except kc.KernelConfigError as e:
            raise SystemExit(f"--configs: {e}") from e
    if not out:
        raise SystemExit("--configs: no configuration given")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--configs", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--routing", default="gate", choices=("gate", "balanced"),
                    help="gate: top-k of the random gate's scores (~89..183 rows per expert at "
                         "8192 tokens); balanced: every expert T k / E rows, through tid2eid "
                         "(kernel_rows.moe.balanced_routing: #7's target case)")
    args = ap.parse_args()
    configs = parse_configs(args.configs)
    dev = torch.device("cuda")
    w = m.make_weights(m.V41, dev)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        calls = {name: m.layer_call(m.V41, w, T, dev, args.routing, cfgs)
                 for name, _, cfgs in configs}
        ref, times = None, {name: [] for name, _, _ in configs}
        errs = {}
        for rnd in range(args.rounds):
            # each round starts one configuration later: the H200's clocks drift down as it
            # heats under this load (5.80 -> 6.32 ms for one configuration between the first two
            # rounds), so a fixed order would favour whichever runs first
            # (round 0 in the given order: the first configuration is the rel errs' reference)
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for name, _, _ in order:
                call = calls[name]
                try:
                    if rnd == 0:
                        out = call().float()
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = out
                        errs[name] = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
                    times[name].append(time_ms(call, device="cuda"))
                except Exception as e:  # a failing configuration is a row, not the end of the run
                    errs.setdefault(name, float("nan"))
                    times[name].append(float("nan"))
                    print(f"T={T} {name}: {type(e).__name__}: {e}", flush=True)
                print(f"T={T} round {rnd} {name}: {times[name][-1]:.4f} ms "
                      f"rel_err {errs[name]:.2e}", flush=True)
        for name, sets, _ in configs:
            rows.append(dict(tokens=T, config=name, settings=sets,
                             ms=times[name], median_ms=statistics.median(times[name]),
                             rel_err_vs_first=errs[name]))
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, configs=args.configs,
                routing=args.routing, rows=rows)
    for ext, text in (("json", json.dumps(meta, indent=1)), ("md", _md(meta))):
        path = os.path.join(args.out, f"moe-ab.{ext}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def _md(meta: dict) -> str:
    lines = [f"# MegaMoE A/B: {meta['device']} (torch {meta['torch']}, Triton {meta['triton']})",
             "", f"configs: `{meta['configs']}`, routing: {meta.get('routing', 'gate')}", "",
             "| tokens | config | runs (ms) | median ms | rel err vs first |", "|---|---|---|---:|---:|"]
    for r in meta["rows"]:
        lines.append(f"| {r['tokens']} | {r['config']} | "
                     f"{', '.join(f'{t:.4f}' for t in r['ms'])} | {r['median_ms']:.4f} | "
                     f"{r['rel_err_vs_first']:.2e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
