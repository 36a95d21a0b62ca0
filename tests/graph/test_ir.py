"""The IR on its own: types, the text format's round trip and errors, the verifier, the interpreter."""

import pytest
import torch

from megagraph.graph.builder import GraphBuilder
from megagraph.graph.errors import IRError, ParseError
from megagraph.graph.interp import interpret
from megagraph.graph.registry import all_ops, get_op
from megagraph.graph.text import parse_graph, print_graph
from megagraph.graph.types import T, TensorType, eval_dim, parse_dim, scale_dim
from megagraph.kernels.reference_table import reference_impls

SMALL = """\
graph small {
  meta {note="x"}
  dims T
  input %x : f32[T, 8]
  weight @w : f32[4, 8]
  weight @n : f32[4]
  %h = linear(%x, @w, _) : f32[T, 4]
  %y = rms_norm(%h, @n) {eps=1e-06} : f32[T, 4]
  return y=%y
}
"""


def test_dims_and_types():
    assert parse_dim("N / 2") == "N/2" and parse_dim("T*1") == "T" and parse_dim("64") == 64
    assert eval_dim("N/2", {"N": 10}) == 5 and eval_dim("T*4", {"T": 3}) == 12
    assert scale_dim("N/2", 4) == "N*2" and scale_dim(6, 1, 3) == 2
    t = TensorType.parse("fp8e4m3[S, N/2, 512]")
    assert str(t) == "fp8e4m3[S, N/2, 512]" and t.nbytes({"S": 2, "N": 8}) == 2 * 4 * 512
    with pytest.raises(IRError, match="not divisible"):
        eval_dim("N/2", {"N": 7})
    with pytest.raises(IRError, match="unknown dtype 'f12'"):
        T("f12", 3)


def test_round_trip_small():
    g = parse_graph(SMALL)
    assert print_graph(g) == SMALL


def test_interpret_small():
    g = parse_graph(SMALL)
    x, w, n = torch.randn(3, 8), torch.randn(4, 8), torch.rand(4) + 0.5
    y = interpret(g, {"x": x}, {"w": w, "n": n}, reference_impls())["y"]
    h = x @ w.T
    torch.testing.assert_close(y, n * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    with pytest.raises(IRError, match="x has shape"):
        interpret(g, {"x": torch.randn(3, 7)}, {"w": w, "n": n}, reference_impls())
    with pytest.raises(IRError, match="missing weight 'n'"):
        interpret(g, {"x": x}, {"w": w}, reference_impls())


@pytest.mark.parametrize("edit,match", [
    (("%y = rms_norm(%h, @n) {eps=1e-06} : f32[T, 4]", "%y = rms_norm(%h, @n) {eps=1e-06} : f32[T, 5]"),
     "declared f32\\[T, 5\\] but its type rule gives f32\\[T, 4\\]"),
    (("weight @n : f32[4]", "weight @n : f32[5]"), "weight must be \\[4\\]"),
    (("linear(%x, @w, _)", "linear(%z, @w, _)"), "uses %z before it is defined"),
    (("%y = rms_norm", "%h = rms_norm"), "defined twice"),
    (("rms_norm(%h, @n) {eps=1e-06}", "rms_norm(%h, @n) {eps=1e-06, bogus=1}"), "no attribute"),
    (("rms_norm(%h, @n) {eps=1e-06}", "rms_norm(%h, @n)"), "needs attribute 'eps'"),
    (("= rms_norm(", "= rms_nrom("), "unknown op 'rms_nrom'"),
    (("input %x : f32[T, 8]", "input %x : f32[Q, 8]"), "dim 'Q'"),
])
def test_verifier_names_the_problem(edit, match):
    with pytest.raises(IRError, match=match):
        parse_graph(SMALL.replace(*edit))


def test_parse_errors_carry_the_line():
    with pytest.raises(ParseError, match="line 7"):
        parse_graph(SMALL.replace("%h = linear(%x, @w, _) : f32[T, 4]", "%h = linear(%x, @w, _) f32[T, 4]"))
    with pytest.raises(ParseError, match="no 'return'"):
        parse_graph("\n".join(ln for ln in SMALL.splitlines() if "return" not in ln))
    with pytest.raises(ParseError, match="expected 'graph NAME"):
        parse_graph("grph x {\n}")


def test_builder_scopes_and_errors():
    b = GraphBuilder("g", ("T",))
    x = b.input("x", T("f32", "T", 8))
    w = b.weight("w", T("f32", 4, 8))
    with b.scope("L0"):
        h = b.op("linear", x, w, None, name="h")
        h2 = b.op("linear", x, w, None, name="h")
    assert (h, h2) == ("L0.h", "L0.h.1")
    with pytest.raises(IRError, match="x's last dim 8 != weight's in-features 9"):
        b.op("linear", x, b.weight("w9", T("f32", 4, 9)), None)
    with pytest.raises(IRError, match="redeclared"):
        b.weight("w", T("f32", 4, 9))


def test_every_op_has_a_doc_and_a_reference_kernel():
    impls = reference_impls()
    for name, d in all_ops().items():
        assert d.doc, f"op {name} has no docstring"
        assert name in impls, f"op {name} has no reference kernel"
    assert get_op("engram_lookup").is_break and not get_op("linear").is_break
