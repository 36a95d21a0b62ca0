"""Typed kernel configurations: every choice a kernel family makes, as data the compiler resolves.

A family (MoE, dense FP8 GEMM, sparse attention, indexer / top-k, ...) declares one frozen
dataclass subclassing `KernelConfig`: its variant switches, tiles, stages and row thresholds,
with the tuned defaults as field defaults. A hardware profile may override them in
`configs/kernels/<profile>.yaml`; a user overrides them through the compiler
(`compile --kernel-config FILE`, `--set moe.fp8_h_prefill=false`). The resolved values are
written into `plan.yaml`, and the runtime hands each family's kernels exactly that object, so two
runs of the same artifacts run the same code. Nothing here (or anywhere under kernels/) reads the
process environment.

`choose(shape)` is the family's dispatcher decision as a pure function of the config and the
problem's facts (tokens, experts, widths; no tensors, no device): the plan calls it per bucket to
write down which variant each bucket runs, and the kernels call the same function at launch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml


class KernelConfigError(ValueError):
    """A kernel configuration that names an unknown family or field, or a value of the wrong
    type; the message names where it came from."""


@dataclass(frozen=True)
class KernelConfig:
    """Base of every family's configuration. Subclasses set FAMILY and OPS and add fields."""

    FAMILY: ClassVar[str] = ""
    # kernel keys (registry.kernel_key: "op" or "op[attr=value]") whose fast kernels take this
    # config as their `kernel_config` keyword
    OPS: ClassVar[tuple[str, ...]] = ()

    def choose(self, shape: dict[str, int]) -> dict[str, str]:
        """Which variant each stage of the family runs for a problem described by `shape`
        (e.g. {"tokens": 8192, "experts": 384, "topk": 6, "hidden": 4096}); {} when the
        family has a single path. Must not touch tensors or devices."""
        return {}

    # -- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "") -> "KernelConfig":
        return cls().with_overrides(data, where=where)

    def with_overrides(self, data: dict[str, Any], *, where: str = "") -> "KernelConfig":
        """A copy with `data`'s fields replaced, each checked against the field's type."""
        if not isinstance(data, dict):
            raise KernelConfigError(f"{where or self.FAMILY}: expected a mapping of "
                                    f"{self.FAMILY} fields, got {type(data).__name__}")
        known = {f.name: f for f in fields(self)}
        hints = typing.get_type_hints(type(self))
        out = {}
        for k, v in data.items():
            if k not in known:
                raise KernelConfigError(
                    f"{where or self.FAMILY}: {self.FAMILY} has no field {k!r}; "
                    f"its fields: {', '.join(sorted(known))}")
            out[k] = _coerce(v, hints[k], f"{where or self.FAMILY}: {self.FAMILY}.{k}")
        return dataclasses.replace(self, **out)


def _plain(v):
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _coerce(v, hint, where: str):
    """`v` as a value of type `hint` (bool, int, float, str, Literal, Optional, tuple[...])."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        if v not in args:
            raise KernelConfigError(f"{where}: {v!r} is not one of {', '.join(map(repr, args))}")
        return v
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(v, a, where)
            except KernelConfigError as e:
                errors.append(str(e))
        raise KernelConfigError(errors[0] if errors else f"{where}: {v!r} does not fit {hint}")
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise KernelConfigError(f"{where}: expected a list, got {v!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(x, args[0], where) for x in v)
        if len(args) != len(v):
            raise KernelConfigError(f"{where}: expected {len(args)} values, got {len(v)}")
        return tuple(_coerce(x, a, where) for x, a in zip(v, args))
    if hint is bool:
        if isinstance(v, bool):
            return v
        raise KernelConfigError(f"{where}: expected true or false, got {v!r}")
    if hint is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise KernelConfigError(f"{where}: expected an integer, got {v!r}")
    if hint is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise KernelConfigError(f"{where}: expected a number, got {v!r}")
    if hint is str:
        if isinstance(v, str):
            return v
        raise KernelConfigError(f"{where}: expected a string, got {v!r}")
    raise KernelConfigError(f"{where}: unsupported field type {hint}")


# -- the families ----------------------------------------------------------------------------------
# modules that define (and register) one family's config each; imported by `families()`
FAMILY_MODULES: tuple[str, ...] = (
    "megagraph.kernels.moe.config",
    "megagraph.kernels.gemm.config",
    "megagraph.kernels.attention.config",
    "megagraph.kernels.indexer.config",
    "megagraph.kernels.mhc.config",
)
_FAMILIES: dict[str, type[KernelConfig]] = {}


def register(cls: type[KernelConfig]) -> type[KernelConfig]:
    """Class decorator: make `cls` the configuration of family `cls.FAMILY`."""
    if not cls.FAMILY:
        raise TypeError(f"{cls.__name__} sets no FAMILY")
    _FAMILIES[cls.FAMILY] = cls
    return cls


def families() -> dict[str, type[KernelConfig]]:
    """Every registered family, name -> config class."""
    for m in FAMILY_MODULES:
        importlib.import_module(m)
    return dict(sorted(_FAMILIES.items()))


def family_of(key: str) -> str | None:
    """The family whose config the fast kernels of kernel key `key` take, or None."""
    for name, cls in families().items():
        if key in cls.OPS:
            return name
    return None


KERNEL_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "kernels"


def profile_overrides(hw_name: str) -> dict[str, dict]:
    """The tuned values of hardware profile `hw_name` (configs/kernels/<name>.yaml; {} if none)."""
    path = KERNEL_CONFIG_DIR / f"{hw_name}.yaml"
    if not path.exists():
        return {}
    return load_overrides(path)


def load_overrides(path: Path) -> dict[str, dict]:
    """{family: {field: value}} from a YAML file, checked against the families."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise KernelConfigError(f"{path}: cannot read kernel config: {e}") from e
    if not isinstance(data, dict):
        raise KernelConfigError(f"{path}: expected a mapping family -> fields")
    resolve(data, where=str(path))  # validate now, with the file's name in the error
    return data


def parse_set(items: list[str]) -> dict[str, dict]:
    """`--set family.field=value` items -> {family: {field: value}}; values are YAML scalars
    (true / 128 / fp8 / [4, 2])."""
    out: dict[str, dict] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        fam, dot, name = key.strip().partition(".")
        if not eq or not dot or not fam or not name:
            raise KernelConfigError(f"--set {item!r}: expected family.field=value, "
                                    "e.g. --set moe.shared_stream=true")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise KernelConfigError(f"--set {item!r}: cannot read the value: {e}") from e
        out.setdefault(fam, {})[name] = value
    return out


def merge(*layers: dict[str, dict]) -> dict[str, dict]:
    """Later layers' fields win over earlier ones, family by family."""
    out: dict[str, dict] = {}
    for layer in layers:
        for fam, vals in layer.items():
            out.setdefault(fam, {}).update(vals or {})
    return out


def resolve(overrides: dict[str, dict], *, where: str = "") -> dict[str, KernelConfig]:
    """Every family's config: its defaults with `overrides` applied (unknown family or field,
    or a wrongly typed value, is a KernelConfigError naming `where`)."""
    fams = families()
    for fam in overrides:
        if fam not in fams:
            raise KernelConfigError(f"{where or 'kernel config'}: no kernel family {fam!r}; "
                                    f"families: {', '.join(fams) or 'none'}")
    return {name: cls().with_overrides(overrides.get(name, {}), where=where)
            for name, cls in fams.items()}


def from_plan(data: dict[str, dict], *, where: str = "plan.yaml") -> dict[str, KernelConfig]:
    """The configs a plan wrote (every field present) back as objects."""
    return resolve(data, where=where)


def config_hash(configs: dict[str, KernelConfig]) -> str:
    """sha256 of the configs' canonical JSON (recorded in the manifest)."""
    blob = json.dumps({k: v.to_dict() for k, v in sorted(configs.items())}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# -- the compiler's side -------------------------------------------------------------------------
# The problem facts `choose(shape)` receives from the plan, one shape per bucket: `tokens` is the
# bucket's rows (prefill tokens or decode rows), `decode` 1 for a decode bucket, the rest the
# model's widths. A family reads only the keys it needs; the plan always passes all of them.
SHAPE_KEYS = ("tokens", "decode", "hidden", "intermediate", "experts", "topk", "heads",
              "head_dim", "index_topk", "vocab")


def user_overrides(file: str | Path | None = None, sets: list[str] = ()) -> dict[str, dict]:
    """The user's layers of `compile`: `--kernel-config FILE`, then each `--set` item, every layer
    checked on its own so that an error names the file or the item it came from."""
    layers = [load_overrides(Path(file))] if file else []
    for item in sets:
        one = parse_set([item])
        resolve(one, where=f"--set {item}")
        layers.append(one)
    return merge(*layers)


def compile_configs(hw_name: str, overrides: dict[str, dict] | None = None
                    ) -> dict[str, KernelConfig]:
    """Every family's config for a compile: defaults <- configs/kernels/<hw_name>.yaml <-
    `overrides` (the user's layers, `user_overrides`)."""
    return resolve(merge(profile_overrides(hw_name), overrides or {}),
                   where=f"kernel config for profile {hw_name}")


def choice_runs(cfg: KernelConfig, shapes: list[dict[str, int]]) -> list[dict]:
    """`cfg.choose` over consecutive buckets, as runs of buckets with the same choice:
    [{"buckets": [first, last], "count": n, "choose": {...}}, ...] (the plan's compact form)."""
    runs: list[dict] = []
    for shape in shapes:
        try:
            got = cfg.choose(dict(shape))
        except KeyError as e:
            raise KernelConfigError(
                f"{cfg.FAMILY}.choose reads shape key {e.args[0]!r}, which the plan does not "
                f"pass; it passes {', '.join(SHAPE_KEYS)}") from None
        got = {k: str(v) for k, v in sorted(got.items())}
        if runs and runs[-1]["choose"] == got:
            runs[-1]["buckets"][1] = shape["tokens"]
            runs[-1]["count"] += 1
        else:
            runs.append({"buckets": [shape["tokens"], shape["tokens"]], "count": 1,
                         "choose": got})
    return runs


def plan_hash(section: dict[str, dict]) -> str:
    """`config_hash` of a plan's `kernel_configs` section (its families' fields), as the
    manifest records it; a section whose fields no longer resolve is a KernelConfigError."""
    fields_ = {fam: row.get("fields", {}) for fam, row in section.items()}
    objs = from_plan(fields_)
    return config_hash({fam: objs[fam] for fam in fields_})
