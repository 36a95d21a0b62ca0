"""The one textual format of the IR: printed for dumps, snapshots and errors, parsed back exactly.

    graph v4.1-flash-tiny/step {
      meta {model="v4.1-flash-tiny"}
      dims T, R, S, N
      input %token_ids : i64[T]
      weight @embed.weight : bf16[1024, 64]
      %L0.x, %L0.pre = hc_embed(%emb) {n_hc=4} : bf16[T, 4, 64], f32[T, 4]
      %y = sparse_attn(%q, %kv, %ring, _, _, @sink, ...) {ratio=0, ...} : bf16[T, 8, 32]
      return logits=%logits, state.L0.ring=%L0.ring.next
    }

`_` is an absent optional input. Attributes are sorted, values are JSON (floats by repr), so
`parse_graph(print_graph(g))` prints identically.
"""

from __future__ import annotations

import json
import re

from .errors import IRError, ParseError
from .ir import Graph, Node, freeze_attrs
from .types import TensorType

NAME = r"[A-Za-z0-9_.\-*'/]+"
_HEADER = re.compile(rf"^graph ({NAME}) \{{$")
_DECL = re.compile(rf"^(input|weight) ([%@])({NAME}) : (.+)$")
_NODE = re.compile(rf"^(.+?) = ([a-z0-9_.]+)\((.*?)\)(?: (\{{.*\}}))? : (.+)$")


def _fmt_value(v) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(_fmt_value(x) for x in v) + "]"
    if isinstance(v, float):
        return json.dumps(v)  # repr-exact; inf -> Infinity
    return json.dumps(v)


def format_attrs(attrs) -> str:
    return "{" + ", ".join(f"{k}={_fmt_value(v)}" for k, v in attrs) + "}"


def print_node(g: Graph, n: Node) -> str:
    weights = set(g.weights)

    def ref(name):
        if name is None:
            return "_"
        return ("@" if name in weights else "%") + name

    outs = ", ".join("%" + o for o in n.outputs)
    ins = ", ".join(ref(i) for i in n.inputs)
    attrs = f" {format_attrs(n.attrs)}" if n.attrs else ""
    types = ", ".join(str(g.types[o]) for o in n.outputs)
    return f"{outs} = {n.op}({ins}){attrs} : {types}"


def print_graph(g: Graph) -> str:
    lines = [f"graph {g.name} {{"]
    if g.meta:
        lines.append(f"  meta {format_attrs(g.meta)}")
    lines.append(f"  dims {', '.join(g.dims)}")
    lines += [f"  input %{i} : {g.types[i]}" for i in g.inputs]
    lines += [f"  weight @{w} : {g.types[w]}" for w in g.weights]
    lines += [f"  {print_node(g, n)}" for n in g.nodes]
    weights = set(g.weights)
    rets = ", ".join(f"{lab}={'@' if v in weights else '%'}{v}" for lab, v in g.outputs)
    lines.append(f"  return {rets}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets/braces/strings."""
    parts, depth, cur, in_str, esc = [], 0, [], False, False
    for ch in text:
        if in_str:
            cur.append(ch)
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def parse_attrs(text: str) -> dict:
    body = text.strip()[1:-1].strip()
    out = {}
    dec = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        m = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)=").match(body, pos)
        if not m:
            raise IRError(f"bad attribute list {text!r}")
        val, end = dec.raw_decode(body, m.end())
        out[m.group(1)] = val
        pos = end
        rest = re.compile(r"\s*,\s*").match(body, pos)
        if rest:
            pos = rest.end()
        elif body[pos:].strip():
            raise IRError(f"bad attribute list {text!r} near {body[pos:]!r}")
        else:
            break
    return out


def _ref(tok: str, line_no: int, line: str) -> str | None:
    tok = tok.strip()
    if tok == "_":
        return None
    if not re.fullmatch(rf"[%@]{NAME}", tok):
        raise ParseError(f"bad value reference {tok!r}", line_no, line)
    return tok[1:]


def parse_graph(text: str, *, verify: bool = True) -> Graph:
    """Parse the printed form back to a Graph; with `verify`, re-run every type rule."""
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    if not lines:
        raise ParseError("empty text")
    no, first = lines[0]
    m = _HEADER.match(first.strip())
    if not m:
        raise ParseError("expected 'graph NAME {'", no, first)
    name = m.group(1)
    meta, dims, inputs, weights, nodes, outputs, types = (), (), [], [], [], None, {}
    for no, raw in lines[1:]:
        line = raw.strip()
        try:
            if line == "}":
                break
            if line.startswith("meta "):
                meta = freeze_attrs(parse_attrs(line[5:]))
            elif line.startswith("dims"):
                dims = tuple(d.strip() for d in line[4:].split(",") if d.strip())
            elif line.startswith(("input ", "weight ")):
                dm = _DECL.match(line)
                if not dm:
                    raise ParseError("bad declaration", no, raw)
                kind, _, vname, ty = dm.groups()
                (inputs if kind == "input" else weights).append(vname)
                types[vname] = TensorType.parse(ty)
            elif line.startswith("return"):
                outputs = []
                for part in _split_top(line[len("return"):]):
                    lab, _, ref = part.partition("=")
                    outputs.append((lab.strip(), _ref(ref, no, raw)))
            else:
                nm = _NODE.match(line)
                if not nm:
                    raise ParseError("expected '%out, ... = op(%in, ...) {attrs} : types'", no, raw)
                outs_s, opname, ins_s, attrs_s, types_s = nm.groups()
                outs = [_ref(o, no, raw) for o in _split_top(outs_s)]
                ins = [_ref(i, no, raw) for i in _split_top(ins_s)]
                tys = [TensorType.parse(t) for t in _split_top(types_s)]
                if len(tys) != len(outs):
                    raise ParseError(f"{len(outs)} outputs but {len(tys)} types", no, raw)
                attrs = parse_attrs(attrs_s) if attrs_s else {}
                for o, t in zip(outs, tys):
                    types[o] = t
                nodes.append(Node(opname, tuple(ins), tuple(outs), freeze_attrs(attrs)))
        except ParseError:
            raise
        except (IRError, ValueError) as e:
            raise ParseError(str(e), no, raw) from None
    if outputs is None:
        raise ParseError("graph has no 'return' line")
    g = Graph(name, dims, tuple(inputs), tuple(weights), tuple(nodes), tuple(outputs), types, meta)
    if verify:
        from .verify import verify_graph

        verify_graph(g)
    return g
