"""inspect: summarize an artifact dir (ops per kind per pass, segments, buckets, memory, kernel
configs), diff two, or render the step graph as Graphviz.

It sits next to the artifacts code it reads (passes/artifacts.py), above the IR: graph/ imports
nothing from passes/."""

from __future__ import annotations

import argparse
import sys

from megagraph.graph.ir import Graph


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="artifact directory written by `megagraph compile`")
    p.add_argument("dir2", metavar="DIR2", nargs="?",
                   help="a second artifact directory to diff against")
    p.add_argument("--dot", action="store_true",
                   help="print the step graph as Graphviz (DOT) instead")


def main(args: argparse.Namespace) -> int:
    from .artifacts import ArtifactError, load_artifacts

    try:
        a = load_artifacts(args.dir)
        b = load_artifacts(args.dir2) if args.dir2 else None
    except (ArtifactError, ValueError) as e:
        print(f"megagraph inspect: error: {e}", file=sys.stderr)
        return 2
    if args.dot:
        print(to_dot(a.graphs["step"], a.plan), end="")
    elif b is not None:
        print(diff(a, b), end="")
    else:
        print(summary(a), end="")
    return 0


# -- summary -------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    """Bytes in a readable unit (B, KiB, MiB, GiB)."""
    if n is None:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [fmt(header), *(fmt(r) for r in rows)]


def op_count_table(manifest: dict) -> list[str]:
    """Rows: op kinds; columns: stages (00 = built); only ops present at some stage."""
    stages = manifest["stages"]
    ops = sorted({op for s in stages for op in s["ops"]})
    header = ["op"] + [s["file"].rsplit("/", 1)[-1][:2] for s in stages]
    rows = [[op] + [str(s["ops"].get(op, ".")) for s in stages] for op in ops]
    rows.append(["(nodes)"] + [str(s["nodes"]) for s in stages])
    return _table(header, rows)


def summary(a) -> str:
    m, plan = a.manifest, a.plan
    out = [f"artifacts {a.path.name}: {m['model']['name']} ({m['model']['family']}) for "
           f"{m['hardware']['name']} ({m['hardware']['arch']}), schema {m['schema_version']}, "
           f"megagraph {m['megagraph_version']}",
           "options: " + ", ".join(f"{k}={v}" for k, v in sorted(m["options"].items())),
           *_index_keys(plan), "", "passes:"]
    for p in m["passes"]:
        out.append(f"  {p['index']:02d} {p['name']:<20} {p['status']:<9} "
                   f"{p['nodes_before']:>5} -> {p['nodes_after']:<5} {p['note']}")
    out += ["", "ops per kind after each stage (00 = built):"]
    out += ["  " + line for line in op_count_table(m)]
    out += ["", "segments:"]
    for s in plan["segments"]:
        why = "; ".join(s.get("breaks", [])) or s.get("why_eager", "")
        out.append(f"  {s['index']} {s['kind']:<5} {s['nodes']:>5} node(s)  "
                   f"{s['first']} .. {s['last']}" + (f"  [{why}]" if why else ""))
    bk = plan["buckets"]
    pre = bk["prefill_tokens"]
    out += ["", "buckets:",
            f"  prefill tokens: {_span(pre)}; above {bk['graph_token_limit']}: {bk['above_limit']}",
            f"  decode rows: {_span(bk['decode_rows'])}"]
    if "suffix_rows" in bk:
        out.append(f"  bounded-suffix rows: {_span(bk['suffix_rows'])}")
    mem = plan["memory"]
    w, st = mem["weights"], mem["state"]
    out += ["", "memory:",
            f"  weights: {_gib(w['total_bytes'])} ({_gib(w['device_bytes'])} on device, "
            f"{_gib(w['host_resident_bytes'])} host-resident); by dtype: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in w["by_dtype_bytes"].items()),
            f"  state: {st['total_per_token_bytes']} B per token of context "
            f"({_kv(st['per_token_bytes'])}) + {st['total_per_slot_fixed_bytes']} B per slot "
            f"({_kv(st['per_slot_fixed_bytes'])})",
            "  graph pools (peak intermediates at the largest bucket): "
            + ", ".join(f"{k} {_gib(v)}" for k, v in mem["graph_pools_bytes"].items()),
            f"  one slot at {plan['assumptions']['context_tokens']} tokens: "
            f"{_gib(mem['one_slot_at_context_bytes'])} "
            + (f"of {_gib(mem['device_memory_bytes'])} (fits one device: {mem['fits_one_device']})"
               if mem["device_memory_bytes"] else "(device memory not modelled)")]
    kernels = plan["kernels"]
    fast = {k: v for k, v in kernels.items() if v["kernel"] != "reference"}
    out += ["", f"kernels: {len(kernels)} op variants, {len(fast)} with a non-reference kernel"]
    out += kernel_config_lines(plan.get("kernel_configs") or {}, m.get("kernel_config_hash"))
    return "\n".join(out) + "\n"


def kernel_config_lines(section: dict, digest: str | None) -> list[str]:
    """Each family's resolved fields, the ops using it, and its choice per bucket run."""
    if not section:
        return ["kernel configs: none (no op of this graph has a kernel family)"]
    out = ["", f"kernel configs (hash {(digest or '-')[:12]}):"]
    for fam, row in section.items():
        ops = ", ".join(f"{k} x{n}" for k, n in row["ops"].items())
        out.append(f"  {fam} [{ops}]: " + _fields(row["fields"]))
        for kind in ("prefill", "decode"):
            runs = row.get("choose", {}).get(kind) or []
            if runs and any(r["choose"] for r in runs):
                out.append(f"    {kind}: " + "; ".join(_run(r) for r in runs))
    return out


def _fields(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def _run(r: dict) -> str:
    a, b = r["buckets"]
    span = f"{a}" if a == b else f"{a}..{b}"
    return f"{span}: {_fields(r['choose']) or '-'}"


def _index_keys(plan: dict) -> list[str]:
    """One line: the decode index-key reading (docs/index-key-reading.md); none for plans that
    predate it."""
    ik = plan.get("index_keys")
    if ik is None:
        return []
    if ik["reading"] == "owner":
        return ["index keys: owner (each indexer reads its own KV owner's keys; decode == prefill)"]
    reads = ", ".join(f"{a} <- {b}" for a, b in ik["published_reads"].items()) or "none here"
    return [f"index keys: {ik['reading']} (decode rows whose owner leaves a group open read the "
            f"last published keys: {reads}; decode != prefill)"]


def _span(xs: list[int]) -> str:
    return f"{xs[0]}..{xs[-1]} ({len(xs)} buckets)" if xs else "none"


def _kv(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "none"


# -- diff ----------------------------------------------------------------------------------------
def diff(a, b) -> str:
    ma, mb = a.manifest, b.manifest
    out = [f"--- {a.path}", f"+++ {b.path}"]
    for key in ("model", "hardware", "options"):
        if ma[key] != mb[key]:
            out.append(f"{key}: {ma[key]} -> {mb[key]}")
    pa = {p["name"]: p for p in ma["passes"]}
    pb = {p["name"]: p for p in mb["passes"]}
    for name in dict.fromkeys([*pa, *pb]):
        x, y = pa.get(name), pb.get(name)
        if x is None or y is None:
            out.append(f"pass {name}: only in {b.path if x is None else a.path}")
        elif ((x["status"], x["note"], x["nodes_after"])
              != (y["status"], y["note"], y["nodes_after"])):
            out += [f"pass {name}:", f"  - {x['status']} ({x['nodes_after']} nodes) {x['note']}",
                    f"  + {y['status']} ({y['nodes_after']} nodes) {y['note']}"]
    oa, ob = ma["stages"][-1]["ops"], mb["stages"][-1]["ops"]
    changed = [op for op in sorted(set(oa) | set(ob)) if oa.get(op, 0) != ob.get(op, 0)]
    if changed:
        out.append("final ops:")
        out += [f"  {op}: {oa.get(op, 0)} -> {ob.get(op, 0)}" for op in changed]
    ia, ib = a.plan.get("index_keys"), b.plan.get("index_keys")
    if ia != ib:
        out.append(f"index keys: {ia} -> {ib}")
    sa, sb = a.plan["segments"], b.plan["segments"]
    if [(s["kind"], s["nodes"]) for s in sa] != [(s["kind"], s["nodes"]) for s in sb]:
        out.append("segments: " + _segs(sa) + " -> " + _segs(sb))
    ka, kb = a.plan["kernels"], b.plan["kernels"]
    for k in sorted(set(ka) | set(kb)):
        x, y = ka.get(k, {}).get("kernel"), kb.get(k, {}).get("kernel")
        if x != y:
            out.append(f"kernel {k}: {x or '-'} -> {y or '-'}")
    out += kernel_config_diff(a.plan.get("kernel_configs") or {},
                              b.plan.get("kernel_configs") or {}, a.path, b.path)
    pools_a, pools_b = a.plan["memory"]["graph_pools_bytes"], b.plan["memory"]["graph_pools_bytes"]
    if pools_a != pools_b:
        out.append("graph pools: " + ", ".join(
            f"{k} {_gib(pools_a.get(k))} -> {_gib(pools_b.get(k))}"
            for k in sorted(set(pools_a) | set(pools_b))))
    if len(out) == 2:
        out.append("(no differences)")
    return "\n".join(out) + "\n"


def kernel_config_diff(ca: dict, cb: dict, pa, pb) -> list[str]:
    """Kernel configs field by field: a family in one plan only, each field whose value differs,
    and each bucket kind whose choices differ."""
    out = []
    for fam in sorted(set(ca) | set(cb)):
        x, y = ca.get(fam), cb.get(fam)
        if x is None or y is None:
            out.append(f"kernel config {fam}: only in {pb if x is None else pa}")
            continue
        fx, fy = x["fields"], y["fields"]
        for k in dict.fromkeys([*fx, *fy]):
            if fx.get(k, "-") != fy.get(k, "-"):
                out.append(f"kernel config {fam}.{k}: {fx.get(k, '-')} -> {fy.get(k, '-')}")
        for kind in ("prefill", "decode"):
            rx, ry = x.get("choose", {}).get(kind, []), y.get("choose", {}).get(kind, [])
            if rx != ry:
                was, now = "; ".join(map(_run, rx)) or "-", "; ".join(map(_run, ry)) or "-"
                out.append(f"kernel config {fam} {kind} choice: {was} -> {now}")
    return out


def _segs(segs: list[dict]) -> str:
    return "[" + ", ".join(f"{s['kind']}:{s['nodes']}" for s in segs) + "]"


# -- graphviz ------------------------------------------------------------------------------------
def to_dot(g: Graph, plan: dict | None = None) -> str:
    """DOT of a graph: one box per node (op + first output), edges along values, one cluster per
    plan segment (eager ones red)."""
    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    prod = {o: n.outputs[0] for n in g.nodes for o in n.outputs}
    seg_of: dict[str, int] = {}
    segs = (plan or {}).get("segments", [])
    names = [n.outputs[0] for n in g.nodes]
    pos = {name: i for i, name in enumerate(names)}
    for s in segs:
        if s["first"] in pos and s["last"] in pos:
            for name in names[pos[s["first"]]:pos[s["last"]] + 1]:
                seg_of[name] = s["index"]
    lines = [f"digraph {q(g.name)} {{", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    for s in segs:
        color = "red" if s["kind"] == "eager" else "blue"
        label = q(f"{s['kind']} {s['index']}")
        lines.append(f"  subgraph cluster_{s['index']} {{ label={label}; color={color};")
        lines += [f"    {q(n)};" for n, i in seg_of.items() if i == s["index"]]
        lines.append("  }")
    for n in g.nodes:
        lines.append(f"  {q(n.outputs[0])} [label={q(n.op + chr(10) + n.outputs[0])}];")
        for i in n.inputs:
            if i in prod:
                lines.append(f"  {q(prod[i])} -> {q(n.outputs[0])};")
    lines.append("}")
    return "\n".join(lines) + "\n"
