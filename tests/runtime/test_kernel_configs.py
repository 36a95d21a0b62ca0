"""Kernel configs from the compiler to the runtime: `compile --set / --kernel-config` change
plan.yaml and the manifest's hash, the runtime binds exactly the plan's values to the fast
kernels of the family, and bad input or a kernel that cannot load fails with its reason.

The family is a toy registered by a fixture (and removed after), so these tests do not depend on
which real families exist: it claims `rms_norm`, whose fast kernel on h200 is triton.rms_norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import yaml

from megagraph.main import main as cli
from megagraph.kernels import kernel_config as kc
from megagraph.kernels import registry
from megagraph.runtime import kernels as rk
from megagraph.runtime.plan import ArtifactsError, RunPlan

MODEL = "v4.1-flash-tiny"


@dataclass(frozen=True)
class ToyConfig(kc.KernelConfig):
    FAMILY = "toy"
    OPS = ("rms_norm",)
    block: int = 64
    variant: Literal["a", "b"] = "a"
    split: bool = False
    scale: float = 1.0

    def choose(self, shape):
        return {"path": "small" if shape["tokens"] <= self.block else "big"}


@dataclass(frozen=True)
class ToyConfigGrown(ToyConfig):
    """The toy family after a field was added: old plans no longer match their hash."""

    stages: int = 2


def rms_norm(x, w, *, kernel_config: ToyConfig | None = None, **attrs):
    """The toy's fast kernel (the registry is pointed at this module in the tests)."""
    raise AssertionError("bound, never called in these tests")


@pytest.fixture
def toy():
    kc.register(ToyConfig)
    yield ToyConfig
    kc._FAMILIES.pop("toy", None)


def compile_to(tmp_path, name, *extra, hw="h200"):
    out = tmp_path / name
    rc = cli(["compile", "--model", MODEL, "--hw", hw, "--out", str(out), *extra])
    assert rc == 0
    return out


def read(out, name):
    return yaml.safe_load((out / name).read_text())


def test_set_changes_plan_hash_and_binding(toy, tmp_path, monkeypatch):
    base = compile_to(tmp_path, "base")
    tuned = compile_to(tmp_path, "tuned", "--set", "toy.block=128", "--set", "toy.variant=b")
    pb, pt = read(base, "plan.yaml"), read(tuned, "plan.yaml")
    assert pb["kernels"]["rms_norm"]["family"] == "toy"
    assert pb["kernel_configs"]["toy"]["fields"] == ToyConfig().to_dict()
    assert pt["kernel_configs"]["toy"]["fields"] == {**ToyConfig().to_dict(), "block": 128,
                                                     "variant": "b"}
    assert pt["kernel_configs"]["toy"]["ops"] == {"rms_norm": pb["kernels"]["rms_norm"]["nodes"]}
    mb, mt = read(base, "manifest.yaml"), read(tuned, "manifest.yaml")
    assert mb["kernel_config_hash"] != mt["kernel_config_hash"]
    assert mt["options"]["kernel_config"] == {"toy": {"block": 128, "variant": "b"}}

    # the runtime binds the plan's object to the fast kernel, as `kernel_config`
    monkeypatch.setitem(registry.LOADABLE, "triton.rms_norm", __name__)
    monkeypatch.setattr(rk, "device_arch", lambda device: "sm_90")
    for out, block in ((base, 64), (tuned, 128)):
        plan = RunPlan.from_artifacts(out)
        assert plan.kernel_configs["toy"] == ToyConfig(block=block,
                                                       variant="b" if block == 128 else "a")
        ks = rk.resolve_kernels(plan, [plan.graph], torch.device("cpu"))
        norms = [n.outputs[0] for n in plan.graph.nodes if n.op == "rms_norm"]
        assert norms and not ks.fallbacks
        for name in norms:
            fn = ks.impls[name]
            assert fn.func is rms_norm
            assert fn.keywords == {"kernel_config": plan.kernel_configs["toy"]}
        others = [n for n in plan.graph.nodes if plan.kernels.get(n.op) == "reference"]
        assert all(not hasattr(ks.impls[n.outputs[0]], "keywords") for n in others)


def test_choose_runs_per_bucket(toy, tmp_path):
    out = compile_to(tmp_path, "a", "--set", "toy.block=16")
    plan = read(out, "plan.yaml")
    prefill = plan["buckets"]["prefill_tokens"]
    runs = plan["kernel_configs"]["toy"]["choose"]["prefill"]
    small = [b for b in prefill if b <= 16]
    assert [r["choose"]["path"] for r in runs] == ["small", "big"]
    assert runs[0]["buckets"] == [small[0], small[-1]] and runs[0]["count"] == len(small)
    assert runs[1]["buckets"] == [prefill[len(small)], prefill[-1]]
    assert sum(r["count"] for r in runs) == len(prefill)
    decode = plan["kernel_configs"]["toy"]["choose"]["decode"]
    assert sum(r["count"] for r in decode) == len(plan["buckets"]["decode_rows"])


def test_layers_in_order(toy, tmp_path, monkeypatch):
    """defaults <- configs/kernels/<hw>.yaml <- --kernel-config FILE <- --set."""
    prof = tmp_path / "profiles"
    prof.mkdir()
    (prof / "h200.yaml").write_text("toy: {block: 32, split: true}\n")
    monkeypatch.setattr(kc, "KERNEL_CONFIG_DIR", prof)
    f = tmp_path / "k.yaml"
    f.write_text("toy: {block: 48, scale: 2}\n")
    out = compile_to(tmp_path, "a", "--kernel-config", str(f), "--set", "toy.variant=b")
    fields = read(out, "plan.yaml")["kernel_configs"]["toy"]["fields"]
    assert fields == {"block": 48, "variant": "b", "split": True, "scale": 2.0}
    out = compile_to(tmp_path, "b", "--kernel-config", str(f), "--set", "toy.block=8")
    assert read(out, "plan.yaml")["kernel_configs"]["toy"]["fields"]["block"] == 8


@pytest.mark.parametrize("args, message", [
    (["--set", "toy.nope=1"], "--set toy.nope=1: toy has no field 'nope'"),
    (["--set", "toy.block=big"], "toy.block: expected an integer, got 'big'"),
    (["--set", "toy.variant=c"], "'c' is not one of 'a', 'b'"),
    (["--set", "blah.block=1"], "no kernel family 'blah'"),
    (["--set", "toyblock"], "expected family.field=value"),
])
def test_bad_set_is_a_clear_error(toy, tmp_path, capsys, args, message):
    rc = cli(["compile", "--model", MODEL, "--hw", "h200", "--out", str(tmp_path / "x"), *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert "megagraph compile: error:" in err and message in err
    assert not (tmp_path / "x").exists()


def test_bad_file_is_a_clear_error(toy, tmp_path, capsys):
    f = tmp_path / "k.yaml"
    f.write_text("toy: {split: maybe}\n")
    rc = cli(["compile", "--model", MODEL, "--hw", "h200", "--out", str(tmp_path / "x"),
              "--kernel-config", str(f)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{f}: toy.split: expected true or false, got 'maybe'" in err
    f.write_text("[1, 2]\n")
    assert cli(["compile", "--model", MODEL, "--hw", "h200", "--out", str(tmp_path / "x"),
                "--kernel-config", str(f)]) == 2
    assert "expected a mapping family -> fields" in capsys.readouterr().err


def test_plan_round_trip_and_hash_check(toy, tmp_path):
    out = compile_to(tmp_path, "a", "--set", "toy.scale=0.5")
    plan, manifest = read(out, "plan.yaml"), read(out, "manifest.yaml")
    objs = kc.from_plan({f: r["fields"] for f, r in plan["kernel_configs"].items()})
    assert objs["toy"] == ToyConfig(scale=0.5)
    assert kc.plan_hash(plan["kernel_configs"]) == manifest["kernel_config_hash"]
    assert RunPlan.from_artifacts(out).kernel_configs["toy"] == ToyConfig(scale=0.5)
    # the family gains a field: the plan's values no longer hash to what the compile recorded
    kc.register(ToyConfigGrown)
    with pytest.raises(ArtifactsError, match="kernel family's fields changed since compile"):
        RunPlan.from_artifacts(out)


def test_kernel_that_cannot_load(toy, tmp_path, monkeypatch):
    out = compile_to(tmp_path, "a")
    monkeypatch.setitem(registry.LOADABLE, "triton.rms_norm", "megagraph.no_such_module")
    monkeypatch.setattr(rk, "device_arch", lambda device: "sm_90")
    plan = RunPlan.from_artifacts(out)
    with pytest.raises(ArtifactsError) as e:
        rk.resolve_kernels(plan, [plan.graph], torch.device("cpu"))
    assert "triton.rms_norm" in str(e.value)
    assert "megagraph.no_such_module does not import: ModuleNotFoundError" in str(e.value)
    ks = rk.resolve_kernels(plan, [plan.graph], torch.device("cpu"), allow_fallback=True)
    assert ks.fallbacks["rms_norm"].startswith("triton.rms_norm -> reference (megagraph.no_such")


def test_kernel_without_config_keyword(toy, tmp_path, monkeypatch):
    out = compile_to(tmp_path, "a")
    monkeypatch.setitem(registry.LOADABLE, "triton.rms_norm", "megagraph.kernels.dense.norm")
    monkeypatch.setattr(rk, "device_arch", lambda device: "sm_90")
    plan = RunPlan.from_artifacts(out)
    with pytest.raises(ArtifactsError, match="takes no kernel_config keyword"):
        rk.resolve_kernels(plan, [plan.graph], torch.device("cpu"))


def test_compile_options_recorded(tmp_path):
    out = compile_to(tmp_path, "a", "--allow-unvalidated", "--disable-pass", "cse", hw="cpu")
    m = read(out, "manifest.yaml")
    assert m["options"]["allow_unvalidated"] is True
    assert m["options"]["disable_passes"] == ["cse"]
    cse = next(p for p in m["passes"] if p["name"] == "cse")
    assert cse["status"] == "skipped" and "--disable-pass" in cse["note"]
    plan = read(out, "plan.yaml")
    assert plan["kernel_configs"] == {} and plan["kernel_options"] == {"allow_unvalidated": True}


def test_unvalidated_kernels_need_the_option():
    caps = frozenset({"sm_100f", "deepgemm", "mxfp4", "sm_90", "triton", "cuda"})
    name, why = registry.choose_kernel("mega_moe", {}, caps, "sm_100")
    assert name == "triton.mega_moe"
    name, why = registry.choose_kernel("mega_moe", {}, caps, "sm_100", allow_unvalidated=True)
    assert name == "deepgemm.fp8_fp4_mega_moe" and "--allow-unvalidated" in why


def test_inspect_shows_and_diffs_configs(toy, tmp_path, capsys):
    a = compile_to(tmp_path, "a", "--set", "toy.block=16")
    b = compile_to(tmp_path, "b", "--set", "toy.block=16", "--set", "toy.split=true")
    c = compile_to(tmp_path, "c")
    capsys.readouterr()
    assert cli(["inspect", str(a)]) == 0
    out = capsys.readouterr().out
    assert "kernel configs (hash " in out
    assert "toy [rms_norm x" in out and "block=16, scale=1.0, split=False, variant=a" in out
    assert "prefill: 4..16: path=small; 20..8192: path=big" in out
    assert cli(["inspect", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "kernel config toy.split: False -> True" in out and "toy.block" not in out
    assert cli(["inspect", str(a), str(c)]) == 0
    out = capsys.readouterr().out
    assert "kernel config toy.block: 16 -> 64" in out
    assert "kernel config toy prefill choice: " in out


class _Zero(float):
    """Stands for every scheduler / cache figure /metrics reads: 0 however it is read."""

    def __new__(cls):
        return super().__new__(cls, 0.0)

    def __getattr__(self, name):
        return _Zero()

    def __call__(self, *args, **kw):
        return _Zero()

    def __len__(self):
        return 0

    def items(self):
        return []


def test_fallbacks_in_startup_report_and_metrics(toy, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from megagraph.runtime.compile import StartupReport
    from megagraph.runtime.server.metrics import Metrics

    out = compile_to(tmp_path, "a")
    monkeypatch.setitem(registry.LOADABLE, "triton.rms_norm", "megagraph.no_such_module")
    monkeypatch.setattr(rk, "device_arch", lambda device: "sm_90")
    plan = RunPlan.from_artifacts(out)
    ks = rk.resolve_kernels(plan, [plan.graph], torch.device("cpu"), allow_fallback=True)
    report = StartupReport(kernel_fallbacks=dict(ks.fallbacks),
                           kernel_configs={"toy": "block=64, variant=a"})
    lines = "\n".join(report.lines())
    assert "kernel fallbacks: rms_norm: triton.rms_norm -> reference (" in lines
    assert "kernel config toy: block=64, variant=a" in lines
    svc = SimpleNamespace(scheduler=_Zero(), cache=_Zero(), model_name="m", capacity=1,
                          healthy=True, engine=SimpleNamespace(kernels=ks))
    text = Metrics(svc).render()
    assert '\nmegagraph_kernel_fallback{kernel="rms_norm"} 1\n' in text
    svc.engine.kernels = rk.KernelSet({}, set())
    assert "megagraph_kernel_fallback{" not in Metrics(svc).render()


def test_edited_plan_configs(toy, tmp_path):
    """plan.yaml's configs are covered by its file hash; an edited one loads only when asked,
    and then its values are what the runtime binds."""
    out = compile_to(tmp_path, "a")
    path = out / "plan.yaml"
    plan = yaml.safe_load(path.read_text())
    plan["kernel_configs"]["toy"]["fields"]["block"] = 99
    path.write_text(yaml.safe_dump(plan))
    with pytest.raises(ArtifactsError, match="plan.yaml: content does not match"):
        RunPlan.from_artifacts(out)
    assert RunPlan.from_artifacts(out, allow_edited=True).kernel_configs["toy"].block == 99
    plan["kernel_configs"]["toy"]["fields"]["block"] = "big"
    path.write_text(yaml.safe_dump(plan))
    with pytest.raises(ArtifactsError, match="toy.block: expected an integer, got 'big'"):
        RunPlan.from_artifacts(out, allow_edited=True)
