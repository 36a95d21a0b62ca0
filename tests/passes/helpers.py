"""Shared helpers of the compiler tests: compiled tiny models (cached), a multi-step scenario run
through ReferenceSession, stage diffs, and the plain-text snapshot extension."""

from __future__ import annotations

import difflib
from functools import lru_cache

import pytest
import torch
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from megagraph.models.config import load_model_config
from megagraph.passes import CompileOptions, compile_graph, compile_model, load_hw_profile
from tests.tiny import TINY, SeqChunk, random_tokens, session, tiny

HW = ("gb300", "b300", "h200", "cpu")


class TextSnapshot(SingleFileSnapshotExtension):
    """One plain .txt file per snapshot: a graph dump reads as a plain diff in review."""

    _write_mode = WriteMode.TEXT
    file_extension = "txt"


def model_params(models=TINY):
    """Parametrize over models; V4 ones skip while megagraph.models.v4 is not importable."""
    out = []
    for m in models:
        marks = ()
        if m.startswith("v4-"):
            try:
                import megagraph.models.v4  # noqa: F401
            except ImportError:
                marks = (pytest.mark.skip(reason="megagraph.models.v4 is not importable yet"),)
        out.append(pytest.param(m, id=m, marks=marks))
    return out


@lru_cache(maxsize=32)
def compiled(model: str, hw: str, *, bounded_replay: bool = False):
    """The bf16 (release numerics) compile of a model for a profile, as `megagraph compile` does."""
    cfg = load_model_config(model)
    return compile_model(cfg, load_hw_profile(hw), CompileOptions(bounded_replay=bounded_replay))


@lru_cache(maxsize=16)
def compiled_f32(model: str, hw: str):
    """(cfg, weights, consts, [(stage name, graph)]) of the f32 tiny model (exact comparisons)."""
    cfg, g, w, consts = tiny(model, "f32")
    final, records = compile_graph(g, load_hw_profile(hw), CompileOptions())
    return cfg, w, consts, [("built", g)] + [(r.name, r.graph) for r in records]


# two prefills (crossing the tiny windows and compressor groups), one decode row per request, then
# a mixed step (a new prefill beside a decode row and a 3-row verify)
STEPS = (
    ("prefill", ((0, random_tokens(20, 1)), (1, random_tokens(6, 2)))),
    ("decode", ((0, (17,)), (1, (23,)))),
    ("mixed", ((2, random_tokens(5, 3)), (0, (41,)), (1, (7, 8, 9)))),
)


def run_scenario(cfg, g, w, consts, steps=STEPS) -> dict[str, torch.Tensor]:
    """{"<kind>.logits": ..., "state.<name>": ...} after running every step."""
    s = session(cfg, g, w, consts, slots=3, capacity=128)
    out = {}
    for kind, chunks in steps:
        out[f"{kind}.logits"] = s.step([SeqChunk(slot, toks) for slot, toks in chunks])
    out.update({f"state.{k}": v for k, v in s.state.items()})
    return out


def notes_apart(text: str) -> str:
    """A dump with the meta line's pass notes moved to one `# <pass>: <note>` line each (so a
    diff shows the new note, not a changed 2000-character meta line)."""
    from megagraph.graph.text import format_attrs, parse_attrs

    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("  meta {"):
            meta = parse_attrs(line.strip()[len("meta "):])
            notes = meta.pop("notes", [])
            out.append(f"  meta {format_attrs(sorted(meta.items()))}\n")
            out += [f"  # {n}\n" for n in notes]
        else:
            out.append(line)
    return "".join(out)


def stage_diff(before: str, after: str, name: str) -> str:
    """Unified diff of two dumps (the snapshot of what one pass did); notes one per line."""
    lines = difflib.unified_diff(notes_apart(before).splitlines(keepends=True),
                                 notes_apart(after).splitlines(keepends=True),
                                 fromfile="before", tofile=f"after {name}", n=1)
    return "".join(lines) or "(no change)\n"
