"""The REFERENCE registry: every op of the brief is registered and documented."""
import importlib
import inspect

from megagraph.kernels.reference_table import REFERENCE

EXPECTED = {
    "rms_norm", "linear", "grouped_linear", "rope", "fake_quant", "hc_embed", "hc_mixer",
    "hc_collapse", "hc_expand", "embed", "sparse_attn", "ring_update", "compress_pool",
    "cache_write", "index_scores", "candidate_mask", "topk_select", "route", "moe_experts",
    "swiglu_mlp", "add", "token_map", "engram_hash", "engram_hist_update", "engram_lookup",
    "engram_gate",
}


def test_registry_complete_and_documented():
    assert EXPECTED <= set(REFERENCE)
    for name, fn in REFERENCE.items():
        assert callable(fn), name
        assert fn.__doc__ and len(fn.__doc__.strip()) > 20, name
        mod = importlib.import_module(fn.__module__)
        assert mod.__doc__ and 1 <= len(mod.__doc__.strip().splitlines()) <= 3, fn.__module__


def test_attributes_are_keyword_only():
    # tensor inputs positional, attributes keyword-only (the interpreter's calling convention)
    kw = {"rms_norm": {"eps"}, "rope": {"rope_dim", "theta"}, "sparse_attn": {"window", "scale", "ratio"},
          "fake_quant": {"fmt", "block"}, "route": {"topk", "route_scale"}}
    for name, attrs in kw.items():
        params = inspect.signature(REFERENCE[name]).parameters
        for a in attrs:
            assert params[a].kind is inspect.Parameter.KEYWORD_ONLY, (name, a)


def test_available_library_kernels_are_marked_capturable():
    """Every loadable kernel marked available says it can be captured (fn.capturable): the
    runtime captures a node only when its kernel says so (runtime.kernels), so an unmarked one
    silently splits the decode CUDA graph into eager segments (an unmarked hc_expand took
    45.6 against 18.7 ms per decode step on the H200)."""
    import pytest

    pytest.importorskip("triton")
    from megagraph.kernels.registry import KERNELS, LOADABLE, load_impl

    unmarked = [(impl.name, key) for key, impls in KERNELS.items() for impl in impls
                if impl.status == "available" and impl.name in LOADABLE
                and not getattr(load_impl(impl.name, key.split("[")[0]), "capturable", False)]
    assert unmarked == []
