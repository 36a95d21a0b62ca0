"""What a result was measured on: ceilings measured in the run (bf16 / FP8 GEMM, copy
bandwidth), the hardware profile's datasheet peaks, the libraries present, and the environment
header (device, driver, versions, commit, command)."""
from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def ceilings(device: torch.device, smoke: bool) -> dict:
    """Measured ceilings: bf16 GEMM, FP8 _scaled_mm (per-tensor scales), copy bandwidth (bytes
    read + written): what the kernel table and the MFU / roofline figures compare with."""
    from kernel_rows import time_ms

    out: dict = {}
    n = 256 if (smoke or device.type != "cuda") else 8192
    try:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        ms = time_ms(lambda: a @ b, device=device, graph=False)
        out["bf16_tflops"] = round(2 * n ** 3 / ms / 1e9, 1)
    except Exception as e:  # noqa: BLE001
        out["bf16_error"] = f"{type(e).__name__}: {e}"
    if device.type == "cuda":
        try:
            a8 = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b8 = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)
            ms = time_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                  out_dtype=torch.bfloat16),
                         device=device, graph=False)
            out["fp8_tflops"] = round(2 * n ** 3 / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            out["fp8_error"] = f"{type(e).__name__}: {e}"
    try:
        nb = (1 << 30) if (device.type == "cuda" and not smoke) else (1 << 24)
        src = torch.empty(nb, dtype=torch.uint8, device=device).random_(0, 255)
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src), device=device, graph=False)
        out["copy_tbps"] = round(2 * nb / ms / 1e9, 3)
    except Exception as e:  # noqa: BLE001
        out["copy_error"] = f"{type(e).__name__}: {e}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def hw_peaks(hw: str) -> dict:
    """The hardware profile's datasheet numbers (configs/hw/<hw>.yaml)."""
    from megagraph.passes import load_hw_profile

    p = load_hw_profile(hw)
    return {"profile": hw, "fp8_tflops": p.tflops("fp8"), "bf16_tflops": p.tflops("bf16"),
            "hbm_tbps": p.hbm_tbps, "graph_token_limit": p.graph_token_limit}


def libraries() -> dict[str, str]:
    """DeepGEMM / FlashMLA: importable or not (an extra column where they are)."""
    out = {}
    for mod, name in (("deep_gemm", "DeepGEMM"), ("flash_mla", "FlashMLA")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        out[name] = "installed" if found else "not installed"
    return out


def environment(device) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "python": platform.python_version(),
           "command": " ".join([Path(sys.executable).name] + sys.argv),
           "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda"
           else platform.processor() or "cpu",
           "cuda": torch.version.cuda,
           "unvalidated_kernels": os.environ.get("MEGAGRAPH_UNVALIDATED_KERNELS", "")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    env["driver"] = "-"
    if torch.device(device).type == "cuda":
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0] if smi else "?"
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    if commit:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        env["commit"] = commit + ("+dirty" if dirty else "")
    return env


def _run(cmd) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=15, check=False)
        return p.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def env_lines(env: dict) -> list[str]:
    return [f"{env.get('device')} (driver {env.get('driver', '-')}), torch {env.get('torch')} "
            f"(CUDA {env.get('cuda')}), triton {env.get('triton')}, Python {env.get('python')}; "
            f"{env.get('date')}; commit {env.get('commit', '?')}; "
            f"MEGAGRAPH_UNVALIDATED_KERNELS={env.get('unvalidated_kernels') or '(unset)'}", "",
            f"`{env.get('command')}`"]
