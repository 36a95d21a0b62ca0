"""The artifact directory: written atomically by `compile`, read (and validated) by the runtime.

    artifacts/
      manifest.yaml          schema version, versions, model, hardware, hashes, passes + stats
      model.yaml             the resolved model config
      plan.yaml              segments, breaks, buckets, static buffers, kernels, memory
      graph/00-built.mgir    the built step graph, then one dump after every pass (NN-<pass>.mgir)
      graph/<name>.mgir      side graphs (bounded replay: prefill-prefix, prefill-suffix,
                             encoder-replay)

Everything but the manifest's `timing` section is deterministic: compiling twice gives the same
bytes. Loading checks every file against the manifest's hash (an edited `model.yaml` or
`plan.yaml` would otherwise be served as if compiled); `allow_edited=True` loads them anyway, for
experiments, and says which differ (`Artifacts.edited`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from megagraph.graph.ir import Graph
from megagraph.graph.text import parse_graph, print_graph
from megagraph.kernels.kernel_config import KernelConfigError, plan_hash

from .pipeline import Compiled
from .plan import build_plan
from .staging import make_staging_dir, remove_stale_staging_dirs

SCHEMA_VERSION = 1
GRAPH_DIR = "graph"


class ArtifactError(ValueError):
    """Artifacts that cannot be written or read; the message names the path and the fix."""


def megagraph_version() -> str:
    try:
        from importlib.metadata import version

        return version("megagraph")
    except Exception:  # noqa: BLE001 - not installed: fall back to the package constant
        from megagraph import __version__

        return __version__


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):  # never write &id001 anchors: every value in full
        return True


def dump_yaml(data) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=True, default_flow_style=None, width=100,
                     allow_unicode=True)


def render(c: Compiled, *, model_arg: str | None = None) -> dict[str, str]:
    """Every artifact file as {relative path: text} (manifest last: it hashes the others)."""
    files: dict[str, str] = {}
    stage_rows = []
    for stem, g in c.stages:
        path = f"{GRAPH_DIR}/{stem}.mgir"
        files[path] = print_graph(g)
        stage_rows.append({"file": path, "nodes": len(g.nodes), "ops": g.op_counts()})
    graphs = {"step": stage_rows[-1]["file"]}
    for name, g in sorted(c.extra_graphs.items()):
        path = f"{GRAPH_DIR}/{name}.mgir"
        files[path] = print_graph(g)
        graphs[name] = path
    opt = c.options
    plan = build_plan(c.graph, c.hw, context=opt.context, extra=c.extra_graphs, cfg=c.cfg,
                      kernel_overrides=opt.kernel_config,
                      allow_unvalidated=opt.allow_unvalidated)
    files["plan.yaml"] = dump_yaml(plan)
    files["model.yaml"] = dump_yaml(c.cfg.to_dict())
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "megagraph_version": megagraph_version(),
        "model": {"name": c.cfg.name, "family": c.cfg.family, "requested": model_arg or c.cfg.name,
                  "config_hash": c.cfg.config_hash()},
        "hardware": {"name": c.hw.name, "arch": c.hw.arch, "profile_hash": c.hw.profile_hash()},
        "options": {"bounded_replay": opt.replay_enabled(c.hw), "logits": opt.logits,
                    "keep": opt.resolved_keep(c.cfg) if opt.replay_enabled(c.hw) else None,
                    "context": opt.context, "passes": list(opt.passes) if opt.passes else None,
                    "numerics": opt.numerics,
                    "disable_passes": list(opt.disable_passes),
                    "kernel_config": opt.kernel_config,
                    "allow_unvalidated": opt.allow_unvalidated},
        "kernel_config_hash": plan_hash(plan["kernel_configs"]),
        "graphs": graphs,
        "stages": stage_rows,
        "passes": [{**r.summary(), "file": stage_rows[r.index]["file"]} for r in c.records],
        "files": {p: _sha(t) for p, t in sorted(files.items())},
        "timing": {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "build_seconds": round(c.build_seconds, 4),
                   "passes_seconds": {r.name: round(r.seconds, 4) for r in c.records}},
    }
    files["manifest.yaml"] = dump_yaml(manifest)
    return files


def check_output_dir(out: Path, *, force: bool) -> None:
    """Fail early (before compiling) on an output dir that cannot be written."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"--out {out}: exists and is not a directory")
    if out.exists() and not force:
        raise ArtifactError(f"--out {out}: already exists; pass --force to replace it")
    parent = out.resolve().parent
    while not parent.exists():  # missing parents are created; the first existing one must be writable
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"--out {out}: directory {parent} is not writable")


def write_artifacts(c: Compiled, out: str | Path, *, force: bool = False,
                    model_arg: str | None = None, note=None) -> Path:
    """Write into a temp dir next to `out`, then rename it into place (old dir replaced with
    --force). Nothing half-written is ever left at `out`; the staging dirs an interrupted
    compile left next to it are removed first (staging.py), each reported through `note`."""
    out = Path(out)
    check_output_dir(out, force=force)
    files = render(c, model_arg=model_arg)
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    for p in remove_stale_staging_dirs(parent, out.name):
        if note is not None:
            note(f"removed {p} (left by an interrupted compile)")
    tmp = make_staging_dir(parent, out.name, "tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the artifacts are for everyone
    try:
        for rel, text in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
        old = None
        if out.exists():
            old = make_staging_dir(parent, out.name, "old")
            os.replace(out, old / "dir")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass
class Artifacts:
    """A loaded artifact directory."""

    path: Path
    manifest: dict
    model: dict
    plan: dict
    graphs: dict[str, Graph]  # "step" and side graphs, parsed and verified
    edited: tuple[str, ...] = ()  # files that differ from the manifest (loaded with allow_edited)

    def stage(self, index_or_name: int | str) -> Graph:
        """A per-pass dump by index (0 = built) or pass name, parsed on demand."""
        for row, rec in zip(self.manifest["stages"], [None, *self.manifest["passes"]]):
            name = "built" if rec is None else rec["name"]
            idx = 0 if rec is None else rec["index"]
            if index_or_name in (idx, name):
                return _read_graph(self.path, row["file"], self.manifest, self.edited)
        raise ArtifactError(f"{self.path}: no stage {index_or_name!r}")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ArtifactError(f"{path}: malformed YAML: {e}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a mapping")
    return data


def _read_graph(root: Path, rel: str, manifest: dict, allowed: tuple[str, ...] = ()) -> Graph:
    p = root / rel
    try:
        text = p.read_text()
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read: {e.strerror}") from None
    want = manifest.get("files", {}).get(rel)
    if want is not None and rel not in allowed and _sha(text) != want:
        raise edited_error(root, manifest, [rel])
    return parse_graph(text)


def recompile_command(root: Path, manifest: dict) -> str:
    return (f"megagraph compile --model {manifest.get('model', {}).get('requested', 'M')} "
            f"--hw {manifest.get('hardware', {}).get('name', 'H')} --out {root} --force")


def edited_error(root: Path, manifest: dict, rels: list[str]) -> ArtifactError:
    names = ", ".join(str(root / r) for r in rels)
    return ArtifactError(
        f"{names}: content does not match the manifest's hash (edited after compile?); "
        f"recompile with `{recompile_command(root, manifest)}`, or, to experiment with the "
        "edited files, serve them with `megagraph runtime serve --allow-edited-artifacts`")


def verify_files(root: Path, manifest: dict) -> list[str]:
    """The manifest's files whose content differs from its hash (a missing or unreadable one is
    an error: nothing can be served without it)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{root / 'manifest.yaml'}: no `files` hashes; recompile with "
                            f"`{recompile_command(root, manifest)}`")
    edited = []
    for rel, want in sorted(files.items()):
        p = root / rel
        try:
            data = p.read_bytes()
        except OSError as e:
            raise ArtifactError(f"{p}: cannot read ({e.strerror}); the manifest lists it. "
                                f"Recompile with `{recompile_command(root, manifest)}`") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != want:
            edited.append(rel)
    return edited


def read_manifest(path: str | Path) -> dict:
    """The validated manifest of an artifact directory (schema version checked)."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root}: not an artifact directory (no such directory)")
    mpath = root / "manifest.yaml"
    if not mpath.exists():
        raise ArtifactError(f"{root}: not an artifact directory (no manifest.yaml); "
                            "create one with `megagraph compile --model M --hw H --out DIR`")
    manifest = _read_yaml(mpath)
    got = manifest.get("schema_version")
    if got != SCHEMA_VERSION:
        raise ArtifactError(
            f"{mpath}: artifacts have schema version {got!r} (megagraph "
            f"{manifest.get('megagraph_version', '?')}), this megagraph ({megagraph_version()}) reads "
            f"schema version {SCHEMA_VERSION}; recompile with `megagraph compile --model "
            f"{manifest.get('model', {}).get('requested', 'M')} --hw "
            f"{manifest.get('hardware', {}).get('name', 'H')} --out {root} --force`")
    return manifest


def load_artifacts(path: str | Path, *, allow_edited: bool = False) -> Artifacts:
    """Read an artifact directory: validate its schema version and every file's hash, parse (and
    verify) the step graph and the side graphs, load the plan and the model config. Edited files
    are refused, naming them, unless `allow_edited` (then listed in `Artifacts.edited`)."""
    root = Path(path)
    manifest = read_manifest(root)
    edited = verify_files(root, manifest)
    if edited and not allow_edited:
        raise edited_error(root, manifest, edited)
    allowed = tuple(edited)
    graphs = {name: _read_graph(root, rel, manifest, allowed)
              for name, rel in manifest["graphs"].items()}
    plan = _read_yaml(root / "plan.yaml")
    check_kernel_configs(root, manifest, plan, edited=allowed)
    return Artifacts(root, manifest, _read_yaml(root / "model.yaml"), plan, graphs, allowed)


def check_kernel_configs(root: Path, manifest: dict, plan: dict, *, edited=()) -> None:
    """The plan's kernel configs must resolve, with this megagraph's families, to the hash the
    manifest recorded: a family whose fields changed since the compile would otherwise hand its
    kernels values nobody chose. An edited plan.yaml (loaded with allow_edited) is exempt."""
    want = manifest.get("kernel_config_hash")
    if want is None or "plan.yaml" in edited:
        return
    where = root / "plan.yaml"
    try:
        got = plan_hash(plan.get("kernel_configs") or {})
    except KernelConfigError as e:
        raise ArtifactError(f"{where}: kernel_configs: {e}; recompile with "
                            f"`{recompile_command(root, manifest)}`") from None
    if got != want:
        raise ArtifactError(
            f"{where}: kernel_configs resolve to hash {got[:12]} with this megagraph, the "
            f"manifest recorded {want[:12]} (a kernel family's fields changed since compile); "
            f"recompile with `{recompile_command(root, manifest)}`")
