"""Random weights for transformers' DeepseekV4 modules, shared by the V4 tests that compare
megagraph with them (tests/kernels/v4, tests/models/test_v4_parity.py): _init_weights leaves
zeros and ones (position_bias, sinks, hc base, norms) that would hide wiring errors."""
from __future__ import annotations

import torch


def randomize_params(module: torch.nn.Module, g: torch.Generator) -> None:
    """Every parameter of module random from g, in place: norm weights 1 + 0.3 N(0, 1); other
    vectors and the position biases N(0, 1) (sinks, hc base / scale, ...); matrices
    N(0, 1) / sqrt(fan-in)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() <= 1 or "position_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def randomize_model(model: torch.nn.Module, g: torch.Generator) -> None:
    """randomize_params, then the routing buffers from g: each token's hash experts (tid2eid) a
    random choice of distinct experts, the score-correction biases 0.3 N(0, 1)."""
    randomize_params(model, g)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                v, k = b.shape
                b.copy_(torch.stack([torch.randperm(model.config.n_routed_experts, generator=g)[:k]
                                     for _ in range(v)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
