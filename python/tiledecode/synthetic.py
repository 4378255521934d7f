"""Synthetic weights, caches and inputs with the statistics of decode/synthetic.hpp (seeded torch
draws, not the C++ generator's numbers): for examples, tests and benchmarks without a checkpoint."""
import math

import torch

from . import CSA, HCA, SWA, Config, cache_shapes, weight_shapes


def _gen(seed, layer, tensor):
    g = torch.Generator()
    g.manual_seed((seed * 1000003 + layer * 1009 + tensor) & 0x7FFFFFFFFFFFFFFF)
    return g


def _normal(shape, g, mean, std, dtype):
    return (torch.randn(shape, generator=g) * std + mean).to(dtype)


def _int8(shape, g):
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


def _scale(shape, g, center):
    return center * (0.75 + 0.5 * torch.rand(shape, generator=g))


def hadamard(n, dtype=torch.bfloat16):
    """Sylvester Hadamard matrix / sqrt(n) (the CSA indexer rotation, spec §6.4)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)


def rms_rows(shape, g, dtype=torch.bfloat16):
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-12)
    return x.to(dtype)


def weights(kind, config="flash", layer=0, seed=20240601):
    """{name: tensor} of one layer (weight_shapes), synthetic."""
    c = Config(config) if not isinstance(config, Config) else config
    s = weight_shapes(kind, c)
    D = c.hidden
    w = {}
    g = lambda i: _gen(seed, layer, i)  # noqa: E731
    bf = torch.bfloat16
    w["hc_fn"] = _normal(s["hc_fn"][0], g(1), 0.0, 1.0 / math.sqrt(4 * D), torch.float32)
    w["hc_scale"] = torch.full((3,), 0.5)
    base = torch.zeros(24)
    for j in range(24):
        cc = j - 8
        if cc >= 0 and cc // 4 == cc % 4:
            base[j] = 1.0
    w["hc_base"] = base
    w["attn_norm"] = _normal((D,), g(2), 1.0, 0.1, bf)
    w["wq_a"] = _normal(s["wq_a"][0], g(3), 0.0, 0.02, bf)
    w["gamma_cq"] = _normal((c.q_lora,), g(4), 1.0, 0.1, bf)
    w["wq_b"] = _int8(s["wq_b"][0], g(5))
    w["wq_b_scale"] = _scale(s["wq_b_scale"][0], g(6), 1.0 / (127.0 * math.sqrt(c.q_lora)))
    w["wkv"] = _normal(s["wkv"][0], g(7), 0.0, 0.02, bf)
    w["gamma_ckv"] = _normal((c.head_dim,), g(8), 1.0, 0.1, bf)
    w["attn_sink"] = torch.full((c.n_heads,), 4.0 if kind == CSA else 0.0)
    w["wo_a"] = _normal(s["wo_a"][0], g(9), 0.0, 0.02, bf)
    w["wo_b"] = _int8(s["wo_b"][0], g(10))
    w["wo_b_scale"] = _scale((D,), g(11), 0.125 / (73.0 * math.sqrt(c.o_groups * c.o_lora)))
    if kind == SWA:
        return w
    w["cmp_wkv"] = _normal(s["cmp_wkv"][0], g(12), 0.0, 0.0245, bf)
    w["cmp_wgate"] = _normal(s["cmp_wgate"][0], g(13), 0.0, 0.0388, bf)
    w["cmp_ape"] = _normal(s["cmp_ape"][0], g(14), 0.0, 0.1243, torch.float32)
    w["cmp_norm_w"] = _normal((c.head_dim,), g(15), 0.9666, 0.19, bf)
    if kind == HCA:
        return w
    w["idx_wq_b"] = _int8(s["idx_wq_b"][0], g(16))
    w["idx_wq_b_scale"] = _scale(s["idx_wq_b_scale"][0], g(17),
                                 1.0 / (127.0 * math.sqrt(c.q_lora)))
    w["weights_proj"] = _normal(s["weights_proj"][0], g(18), 0.0, 0.2313, bf)
    w["hadamard"] = hadamard(c.idx_head_dim)
    w["inner_wkv"] = _normal(s["inner_wkv"][0], g(19), 0.0, 0.0293, bf)
    w["inner_wgate"] = _normal(s["inner_wgate"][0], g(20), 0.0, 0.0512, bf)
    w["inner_ape"] = _normal(s["inner_ape"][0], g(21), 0.0, 0.1528, torch.float32)
    w["inner_norm_w"] = _normal((c.idx_head_dim,), g(22), 0.685, 0.26, bf)
    return w


def q8_rows(x):
    """Per-row INT8 quantiser Q8 (spec §2): codes and FP32 dequant scale."""
    x = x.to(torch.float32)
    amax = torch.clamp(x.abs().amax(-1, keepdim=True), min=1e-4)
    sq = 127.0 / amax
    q = torch.round(x * sq).clamp(-127, 127).to(torch.int8)
    return q, (1.0 / sq).squeeze(-1)


def caches(kind, pools, config="flash", layer=0, seed=20240601):
    """{name: tensor} pools of one layer (cache_shapes) filled with a history: unit-RMS BF16 KV
    rows, N(0, 0.05) CSA states, zero HCA states, Q8 of unit-RMS rows in the index cache."""
    c = Config(config) if not isinstance(config, Config) else config
    s = cache_shapes(kind, pools, c)
    g = lambda i: _gen(seed, layer, 64 + i)  # noqa: E731
    out = {"kv_cache": rms_rows(s["kv_cache"][0], g(0))}
    if kind == SWA:
        return out
    out["cmp_kv"] = rms_rows(s["cmp_kv"][0], g(1))
    if kind == HCA:
        out["state"] = torch.zeros(s["state"][0])
        return out
    out["state"] = torch.randn(s["state"][0], generator=g(2)) * 0.05
    out["inner_state"] = torch.randn(s["inner_state"][0], generator=g(3)) * 0.05
    q, sc = q8_rows(rms_rows(s["idx_kv_cache"][0], g(4)).to(torch.float32))
    out["idx_kv_cache"], out["idx_kv_scale"] = q, sc.contiguous()
    return out


def x_hc(tokens, config="flash", step=0, seed=20240601):
    """The layer input stack [T, 4, D] FP32 ~ N(0, 1), a different draw per step."""
    c = Config(config) if not isinstance(config, Config) else config
    return torch.randn((tokens, 4, c.hidden), generator=_gen(seed, 1 << 20, step))
