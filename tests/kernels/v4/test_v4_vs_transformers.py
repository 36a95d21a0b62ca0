"""V4-specific reference ops (kernels/v4/reference.py) against transformers' DeepseekV4 submodules.

Fresh random inputs every run (the seed is in each assertion message). fp32 everywhere; tolerance
rtol = atol = 1e-5 (values are O(1)). Also: step-splitting consistency of the stateful compressor
(random chunks across steps == one shot; several requests in one step == each alone).
"""
from __future__ import annotations

import pytest
import torch

from megagraph.kernels.v4.reference import V4_REFERENCE, hash_route, hc_head_mix, v4_compress_pool
from tests.v4_weights import randomize_params

tfm = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _gen():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return torch.Generator().manual_seed(seed), seed


def _cfg(**kw) -> DeepseekV4Config:
    base = dict(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16,
        q_lora_rank=32, o_lora_rank=16, o_groups=2, n_routed_experts=8, num_experts_per_tok=3,
        layer_types=[SWA, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
        sliding_window=16, index_n_heads=16, index_head_dim=32, index_topk=8,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=65536, routed_scaling_factor=1.5, swiglu_limit=1.5,
    )
    base.update(kw)
    return DeepseekV4Config(**base)


def _randomize(module: torch.nn.Module, g: torch.Generator) -> torch.nn.Module:
    """Overwrite every parameter (incl. the ones _init_weights zeroes: position_bias, sinks, hc base)."""
    randomize_params(module, g)
    return module.float().eval()


def _capture_input(module: torch.nn.Module, store: list):
    return module.register_forward_pre_hook(lambda m, args: store.append(args[0].detach().clone()))


# -------------------------------------------------------------------------------- compressor pooling


def _pool_one_shot(kv, gate, ape, *, ratio, overlap, slot=0, S=1):
    T, width = kv.shape
    P = (2 if overlap else 1) * ratio
    pend = torch.zeros(S, P, width)
    pos = torch.arange(T)
    lat, pk, pg = v4_compress_pool(kv, gate, ape, pend, pend.clone(), pos, torch.zeros(T, dtype=torch.int64),
                                   torch.tensor([slot]), ratio=ratio, overlap=overlap)
    return lat, pk, pg


@pytest.mark.parametrize("kind", ["csa", "indexer", "hca"])
def test_compress_pool_vs_transformers(kind):
    g, seed = _gen()
    cfg = _cfg()
    T = 300
    if kind == "hca":
        mod = _randomize(tfm.DeepseekV4HCACompressor(cfg), g)
        pool_mod, ratio, overlap = mod, 128, False
    else:
        mod = _randomize(tfm.DeepseekV4CSACompressor(cfg), g)
        pool_mod = mod if kind == "csa" else mod.indexer
        ratio, overlap = 4, True
    x = torch.randn(1, T, cfg.hidden_size, generator=g)
    qr = torch.randn(1, T, cfg.q_lora_rank, generator=g)
    pooled, normed = [], []
    h1 = _capture_input(pool_mod.kv_norm, pooled)
    h2 = pool_mod.kv_norm.register_forward_hook(lambda m, a, out: normed.append(out.detach().clone()))
    with torch.no_grad():
        out, _ = mod(x, qr, torch.arange(T)[None], None, 0)
    h1.remove(), h2.remove()
    want = pooled[0][0]  # [n_win, D] — transformers' pooled entries before kv_norm
    kv = pool_mod.kv_proj(x)[0].detach()
    gate = pool_mod.gate_proj(x)[0].detach()
    lat, _, _ = _pool_one_shot(kv, gate, pool_mod.position_bias.detach(), ratio=ratio, overlap=overlap)
    done = (torch.arange(T) + 1) % ratio == 0
    assert want.shape[0] == int(done.sum())
    torch.testing.assert_close(lat[done], want, **TOL, msg=lambda m: f"seed {seed}: {m}")
    assert (lat[~done] == 0).all()
    # RoPE position of entry g is its first token g*r = p+1-r (transformers' compressed output)
    if kind != "indexer":
        e = normed[0][0]
        pos = torch.arange(e.shape[0]) * ratio
        cos, sin = mod.rotary_emb(e, position_ids=pos[None], layer_type="compress")
        roped = tfm.apply_rotary_pos_emb(e[None, None], cos, sin)[0, 0]
        torch.testing.assert_close(roped, out[0, 0], rtol=0, atol=0)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (4, False), (128, False), (3, True)])
def test_compress_pool_step_splitting(ratio, overlap):
    """Random chunks across steps (state carried) == one shot; pending state identical too."""
    g, seed = _gen()
    T, D, S, slot = 300, 8, 3, 2
    width = (2 if overlap else 1) * D
    kv, gate = torch.randn(T, width, generator=g), 2 * torch.randn(T, width, generator=g)
    ape = torch.randn(ratio, width, generator=g)
    P = width // D * ratio
    ref, rpk, rpg = _pool_one_shot(kv, gate, ape, ratio=ratio, overlap=overlap, slot=slot, S=S)
    pk, pg = torch.zeros(S, P, width), torch.zeros(S, P, width)
    outs, c = [], 0
    while c < T:
        n = min(T - c, int(torch.randint(1, 2 * ratio + 3, (1,), generator=g)))
        sl = slice(c, c + n)
        lat, pk, pg = v4_compress_pool(kv[sl], gate[sl], ape, pk, pg, torch.arange(c, c + n),
                                       torch.zeros(n, dtype=torch.int64), torch.tensor([slot]),
                                       ratio=ratio, overlap=overlap)
        outs.append(lat)
        c += n
    msg = lambda m: f"seed {seed}: {m}"  # noqa: E731
    torch.testing.assert_close(torch.cat(outs), ref, **TOL, msg=msg)
    torch.testing.assert_close(pk, rpk, rtol=0, atol=0, msg=msg)
    torch.testing.assert_close(pg, rpg, rtol=0, atol=0, msg=msg)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False)])
def test_compress_pool_batched_requests(ratio, overlap):
    """Several requests (different slots, cached lengths, chunk sizes) in one step == each alone."""
    g, seed = _gen()
    D, S = 8, 5
    width = (2 if overlap else 1) * D
    P = width // D * ratio
    ape = torch.randn(ratio, width, generator=g)
    slots = [4, 0, 2]
    cached = [int(torch.randint(0, 300, (1,), generator=g)) for _ in slots]
    new = [1, int(torch.randint(1, 40, (1,), generator=g)), 2 * ratio + 5]
    seqs = [(torch.randn(c + n, width, generator=g), torch.randn(c + n, width, generator=g))
            for c, n in zip(cached, new)]
    pk0, pg0 = torch.randn(S, P, width, generator=g), torch.randn(S, P, width, generator=g)  # junk rows
    # establish each request's state alone (prefix step), then its chunk alone
    pk, pg = pk0.clone(), pg0.clone()
    alone = []
    for (kv, gt), s, c, n in zip(seqs, slots, cached, new):
        if c:
            _, pk, pg = v4_compress_pool(kv[:c], gt[:c], ape, pk, pg, torch.arange(c), torch.zeros(c, dtype=torch.int64),
                                         torch.tensor([s]), ratio=ratio, overlap=overlap)
        lat, pk_a, pg_a = v4_compress_pool(kv[c:], gt[c:], ape, pk, pg, torch.arange(c, c + n),
                                           torch.zeros(n, dtype=torch.int64), torch.tensor([s]),
                                           ratio=ratio, overlap=overlap)
        alone.append((lat, pk_a[s].clone(), pg_a[s].clone()))
    # pk/pg now hold every request's prefix state; one batched step
    kv_b = torch.cat([kv[c:] for (kv, _), c in zip(seqs, cached)])
    gt_b = torch.cat([gt[c:] for (_, gt), c in zip(seqs, cached)])
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    req = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(new)])
    lat_b, pk_b, pg_b = v4_compress_pool(kv_b, gt_b, ape, pk, pg, pos, req, torch.tensor(slots),
                                         ratio=ratio, overlap=overlap)
    msg = lambda m: f"seed {seed}: {m}"  # noqa: E731
    torch.testing.assert_close(lat_b, torch.cat([a[0] for a in alone]), **TOL, msg=msg)
    for (lat, pks, pgs), s in zip(alone, slots):
        torch.testing.assert_close(pk_b[s], pks, rtol=0, atol=0, msg=msg)
        torch.testing.assert_close(pg_b[s], pgs, rtol=0, atol=0, msg=msg)
    untouched = [s for s in range(S) if s not in slots]
    assert torch.equal(pk_b[untouched], pk0[untouched]) and torch.equal(pg_b[untouched], pg0[untouched])


# ------------------------------------------------------------------------------------- hash routing


def test_hash_route_vs_transformers():
    g, seed = _gen()
    cfg = _cfg()
    mod = _randomize(tfm.DeepseekV4HashRouter(cfg), g)
    V, k, E = cfg.vocab_size, cfg.num_experts_per_tok, cfg.n_routed_experts
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]).to(torch.int32)
    mod.tid2eid.copy_(tid2eid)
    T = 50
    x = torch.randn(1, T, cfg.hidden_size, generator=g)
    ids_tok = torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        _, w_ref, i_ref = mod(x, ids_tok)
    ids, w = hash_route(x[0], mod.weight.detach(), tid2eid, ids_tok[0], topk=k,
                        route_scale=cfg.routed_scaling_factor, score_func=cfg.scoring_func)
    assert ids.dtype == torch.int64 and torch.equal(ids, i_ref), f"seed {seed}"
    torch.testing.assert_close(w, w_ref, **TOL, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(w.sum(-1), torch.full((T,), 1.5), **TOL)


# ------------------------------------------------------------------------------------------ hc_head


def test_hc_head_mix_vs_transformers():
    g, seed = _gen()
    cfg = _cfg()
    mod = _randomize(tfm.DeepseekV4HyperHead(cfg), g)
    T, n, d = 40, cfg.hc_mult, cfg.hidden_size
    H = torch.randn(1, T, n, d, generator=g) * 3
    with torch.no_grad():
        ref = mod(H)[0]
    pre = hc_head_mix(H[0], mod.hc_fn.detach(), mod.hc_base.detach(), mod.hc_scale.detach(),
                      eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    assert pre.shape == (T, n) and pre.dtype == torch.float32
    got = (pre[:, :, None] * H[0]).sum(1)
    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"seed {seed}: {m}")
    # the weights themselves (transformers' lines: sigmoid(linear(rms(h)) * scale + base) + eps)
    flat = mod.input_norm(H[0].flatten(1))
    want = torch.sigmoid(flat @ mod.hc_fn.detach().t() * mod.hc_scale.detach() + mod.hc_base.detach()) + cfg.hc_eps
    torch.testing.assert_close(pre, want, **TOL)


def test_registry():
    assert set(V4_REFERENCE) == {"v4_compress_pool", "hash_route", "hc_head_mix"}
    assert all(callable(f) for f in V4_REFERENCE.values())
