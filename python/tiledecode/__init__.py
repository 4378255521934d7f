"""TileDecode from PyTorch: the DeepSeek-V4 attention decode step on torch tensors, zero-copy.

    import torch, tiledecode as td
    cfg = td.Config("flash")
    md = td.StepMetadata(max_batch=4, max_seq=2, config=cfg)      # once
    ws = td.Workspace(max_batch=4, max_seq=2, config=cfg)         # once
    w = td.Weights(td.CSA, {"hc_fn": ..., ...}, config=cfg)       # once per layer (packs)
    # every step
    md.build(starts, seq=2, commit_tokens=1, tables=tables, pools=pools)
    td.layer_step(x_out, x_hc, w, caches, md, rope, ws)

Every kernel is also an op of its own, `torch.ops.tiledecode.<name>` (the schemas are in
docs/python.md and `print(torch.ops.tiledecode.<name>.default._schema)`): the engine's tensors
go in as they are (BF16 = torch.bfloat16, INT8 = torch.int8, CPU only), outputs and caches are
written in place, nothing is copied. Bad dtype / device / rank: ValueError; any other bad
argument: RuntimeError with the library's message naming it (nothing written then).
"""
import glob as _glob
import math as _math
import os as _os

import torch

_here = _os.path.dirname(_os.path.abspath(__file__))
_libs = sorted(_glob.glob(_os.path.join(_here, "_tiledecode_ops*.so")))
if not _libs:
    raise ImportError("tiledecode: the extension _tiledecode_ops.so is not next to " + __file__ +
                      " (build the project with libtorch-dev installed; see docs/python.md)")
torch.ops.load_library(_libs[0])

ops = torch.ops.tiledecode
"""The registered ops (torch.ops.tiledecode)."""

SWA, CSA, HCA = 0, 4, 128
"""Layer kinds (the compress ratio): sliding-window, compressed-sparse, heavily-compressed."""

KERNELS = ("hc_pre", "rmsnorm", "qkv_proj_rope", "kv_cache_write", "compressor", "idx_compressor",
           "indexer_query", "indexer_score", "indexer_topk", "sparse_attn", "o_proj", "hc_post")
"""Rows of the `times` tensor of layer_step (decode::Kernel order)."""

_PRESETS = {
    "flash": dict(hidden=4096, n_heads=64, q_lora=1024, o_lora=1024, o_groups=8, idx_n_heads=64,
                  idx_topk=512, n_layers=43),
    "pro": dict(hidden=7168, n_heads=128, q_lora=1536, o_lora=1024, o_groups=16, idx_n_heads=64,
                idx_topk=1024, n_layers=61),
}
_KEYS = ("hidden", "n_heads", "q_lora", "o_lora", "o_groups", "idx_n_heads", "idx_topk",
         "max_seq_len", "page", "c4_state_page", "c128_state_page", "window")


class Config:
    """A model configuration: a preset ("flash", "pro") with optional overrides of its widths and
    deployment constants. `str(cfg)` is the `config` string every op takes."""

    def __init__(self, preset="flash", **overrides):
        if isinstance(preset, Config):
            overrides = {**preset.overrides, **overrides}
            preset = preset.preset
        if ":" in preset:
            preset, items = preset.split(":", 1)
            parsed = dict(kv.split("=") for kv in items.split(",") if kv)
            overrides = {**{k: int(v) for k, v in parsed.items()}, **overrides}
        if preset not in _PRESETS:
            raise ValueError(f"tiledecode.Config: preset '{preset}' unknown; allowed flash, pro")
        for k in overrides:
            if k not in _KEYS:
                raise ValueError(f"tiledecode.Config: key '{k}' unknown; allowed {', '.join(_KEYS)}")
        self.preset = preset
        self.overrides = dict(overrides)
        v = dict(_PRESETS[preset], max_seq_len=16384, page=128, c4_state_page=4,
                 c128_state_page=8, window=128)
        v.update(overrides)
        self.__dict__.update(v)
        self.head_dim, self.rope_dim, self.idx_head_dim, self.rms_eps = 512, 64, 128, 1e-6

    def __str__(self):
        if not self.overrides:
            return self.preset
        return self.preset + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))

    def __repr__(self):
        return f"tiledecode.Config('{self}')"

    @property
    def score_len(self):  # ratio-4 rows per request
        return self.max_seq_len // 4

    @property
    def hca_capacity(self):  # ratio-128 rows per request
        return self.max_seq_len // 128

    @property
    def o_group_in(self):
        return self.n_heads // self.o_groups * self.head_dim

    def layer_kind(self, layer):
        """Kind of main layer `layer` in the preset's schedule (spec §1.1)."""
        if self.preset == "pro":
            return HCA if (layer < 2 or layer % 2 == 1) else CSA
        if layer < 2:
            return SWA
        return CSA if layer % 2 == 0 else HCA

    def narrow(self):
        """The narrow flash of the C++ layer tests: every paging constant of flash, the dense
        widths cut to the smallest values every kernel accepts (hidden 512, 8 heads, q_lora 256,
        o_lora 128, 2 output groups, 16 indexer heads)."""
        return Config(self, hidden=512, n_heads=8, q_lora=256, o_lora=128, o_groups=2,
                      idx_n_heads=16)


def _cfg(config):
    return config if isinstance(config, Config) else Config(config)


def _cdiv(a, b):
    return (a + b - 1) // b


# ---- shapes --------------------------------------------------------------------------------------

def weight_shapes(kind, config="flash"):
    """{name: (shape, dtype)} of one layer's weights (spec §2 layouts; Weights' dict keys)."""
    c = _cfg(config)
    D, H, HD, QL = c.hidden, c.n_heads, c.head_dim, c.q_lora
    bf, f32, i8 = torch.bfloat16, torch.float32, torch.int8
    s = {
        "hc_fn": ((24, 4 * D), f32), "hc_scale": ((3,), f32), "hc_base": ((24,), f32),
        "attn_norm": ((D,), bf), "wq_a": ((D, QL), bf), "gamma_cq": ((QL,), bf),
        "wq_b": ((QL, H * HD), i8), "wq_b_scale": ((H * HD,), f32), "wkv": ((D, HD), bf),
        "gamma_ckv": ((HD,), bf), "attn_sink": ((H,), f32),
        "wo_a": ((c.o_groups, c.o_lora, c.o_group_in), bf),
        "wo_b": ((D, c.o_groups * c.o_lora), i8), "wo_b_scale": ((D,), f32),
    }
    if kind == SWA:
        return s
    R, out = (4, 2 * HD) if kind == CSA else (128, HD)
    s.update({"cmp_wkv": ((out, D), bf), "cmp_wgate": ((out, D), bf), "cmp_ape": ((R, out), f32),
              "cmp_norm_w": ((HD,), bf)})
    if kind == HCA:
        return s
    IH, ID = c.idx_n_heads, c.idx_head_dim
    s.update({"idx_wq_b": ((QL, IH * ID), i8), "idx_wq_b_scale": ((IH * ID,), f32),
              "weights_proj": ((D, IH), bf), "hadamard": ((ID, ID), bf),
              "inner_wkv": ((2 * ID, D), bf), "inner_wgate": ((2 * ID, D), bf),
              "inner_ape": ((4, 2 * ID), f32), "inner_norm_w": ((ID,), bf)})
    return s


def pools_for_batch(batch):
    """Pool page counts [ori, cmp, idx, hca_state, csa_state, csa_inner_state]: the spec's
    deployment (§1.3) scaled by ceil(B / 4) (paged::PoolSizes::for_batch)."""
    f = max(1, (batch + 3) // 4)
    return [128 * f, 32 * f, 64 * f, 64 * f, 64 * f + 1, 64 * f + 1]


def cache_shapes(kind, pools, config="flash"):
    """{name: (shape, dtype)} of one layer's pools as rows (blocks * page rows), base layout."""
    c = _cfg(config)
    ori, cmp_, idx, hca_s, csa_s, inner_s = pools[:6]
    s = {"kv_cache": ((ori * c.page, c.head_dim), torch.bfloat16)}
    if kind == SWA:
        return s
    s["cmp_kv"] = ((cmp_ * c.page, c.head_dim), torch.bfloat16)
    if kind == HCA:
        s["state"] = ((hca_s * c.c128_state_page, 2 * c.head_dim), torch.float32)
        return s
    s["state"] = ((csa_s * c.c4_state_page, 4 * c.head_dim), torch.float32)
    s["inner_state"] = ((inner_s * c.c4_state_page, 4 * c.idx_head_dim), torch.float32)
    s["idx_kv_cache"] = ((idx * c.page, c.idx_head_dim), torch.int8)
    s["idx_kv_scale"] = ((idx * c.page,), torch.float32)
    return s


def alloc_caches(kind, pools, config="flash"):
    """Zero-filled pools of one layer ({name: tensor}, see cache_shapes)."""
    return {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in
            cache_shapes(kind, pools, config).items()}


def fixture_tables(batch, pools, config="flash", permuted=False):
    """The spec's fixture block tables (§3.2): table[b, c] = (phys(c) * B + b) mod P, INT32,
    widths covering cfg.max_seq_len. An engine passes its own block tables instead."""
    c = _cfg(config)

    def table(cols, P):
        col = torch.arange(cols, dtype=torch.int64) % P
        if permuted:
            col = (col * 7 + 3) % P
        b = torch.arange(batch, dtype=torch.int64)[:, None]
        return ((col[None, :] * batch + b) % P).to(torch.int32)

    ori, cmp_, idx, hca_s, csa_s, inner_s = pools[:6]
    cmp_cols = _cdiv(c.score_len, c.page)
    return {
        "block_table": table(_cdiv(c.max_seq_len, c.page), ori),
        "cmp_block_table": table(cmp_cols, cmp_),
        "idx_block_table": table(2 * cmp_cols, idx),
        "hca_state_table": table(_cdiv(c.max_seq_len, c.c128_state_page), hca_s),
        "csa_state_table": table(_cdiv(c.max_seq_len, c.c4_state_page), csa_s),
        "csa_inner_state_table": table(_cdiv(c.max_seq_len, c.c4_state_page), inner_s),
    }


TABLE_NAMES = ("block_table", "cmp_block_table", "idx_block_table", "hca_state_table",
               "csa_state_table", "csa_inner_state_table")
"""The block tables of StepMetadata.build, in the op's argument order."""
CACHE_NAMES = ("kv_cache", "cmp_kv", "state", "idx_kv_cache", "idx_kv_scale", "inner_state")
"""A layer's pools, in layer_step's argument order (a family uses a prefix-free subset)."""


# ---- holders --------------------------------------------------------------------------------------

class StepMetadata:
    """The metadata bundle of one decode step (paged::StepMetadata, spec §3.7): sized once,
    built once per step from the start positions and the engine's block tables, read by every
    layer. `tensors()` returns zero-copy views of what the last build wrote (position_ids,
    kv_seq_lens, the seven slot mappings, window_indices / window_lens)."""

    def __init__(self, max_batch, max_seq=2, config="flash"):
        self.config = _cfg(config)
        self.obj = torch.classes.tiledecode.StepMetadata(max_batch, max_seq, str(self.config))

    def build(self, starts, seq, commit_tokens, tables, pools, layout=0, hca_cmp_block_table=None,
              csa_cmp_block_table=None, block_counts=None):
        """starts INT32 [B]; seq S; commit_tokens (-1 = all S, 1 = MTP); tables {name: INT32
        [B, cols]} (block_table, cmp_block_table, idx_block_table, hca_state_table,
        csa_state_table, csa_inner_state_table); pools: page counts (6, or 8 for prefix
        caching)."""
        ops.build_metadata(self.obj, starts, seq, commit_tokens,
                           *[tables[k] for k in TABLE_NAMES], list(pools), layout,
                           hca_cmp_block_table, csa_cmp_block_table, block_counts)
        return self

    def built(self):
        return self.obj.built()

    def check_disjoint_rows(self):
        """Raises RuntimeError if two tokens of the built step write the same row of one pool
        (an allocator's non-injective tables, addendum §3.5); the fixture tables may."""
        self.obj.check_disjoint_rows()

    def tensors(self):
        return dict(self.obj.tensors().items())


class Workspace:
    """The layer step's scratch (decode::Workspace), sized once for max_batch x max_seq token
    rows and this process's thread count; after a step it holds the last layer's intermediates
    (`tensors(batch, seq)`: zero-copy views)."""

    def __init__(self, max_batch, max_seq=2, config="flash"):
        self.config = _cfg(config)
        self.obj = torch.classes.tiledecode.Workspace(max_batch, max_seq, str(self.config))

    def bytes(self):
        return self.obj.bytes()

    def tensors(self, batch, seq):
        return dict(self.obj.tensors(batch, seq).items())


class Weights:
    """One layer's weights: the caller's tensors (kept, not copied: see weight_shapes for names,
    shapes and dtypes) plus what the CPU step makes once at load time: the packed copies (the
    indexer query weights of CSA layers; wq_b for the AVX-VNNI / AVX-512 tiers) and the rounding
    checks' weight norms (wq_a's and wkv's columns, wo_a's rows: the q-latent, kv and o-proj
    checks, always on, as ops.qkv_wq_a_norms, ops.qkv_wkv_norms and
    ops.output_projection_row_norms make them). compressor_check=True also turns on the
    compressors' rounding check (opt-in: it costs about 4-7 % of a compressor on AMD Zen 3;
    docs/compressors.md), the row norms of ops.compressor_row_norms. Re-create it if the weight
    values change in place."""

    def __init__(self, kind, tensors, config="flash", compressor_check=False):
        self.kind = kind
        self.config = _cfg(config)
        self.obj = torch.classes.tiledecode.LayerWeights(kind, dict(tensors), str(self.config))
        if compressor_check:
            self.obj.enable_compressor_rounding_check()

    @property
    def compressor_check(self):
        return self.obj.compressor_rounding_check()


def rope_table(kind, length=None, config="flash"):
    """BF16 (cos, sin) [length, 64] of a layer kind's RoPE profile (SWA: base 10000; CSA / HCA:
    160000 with YaRN), rows = positions; length defaults to cfg.max_seq_len."""
    c = _cfg(config)
    return ops.rope_table(kind, c.max_seq_len if length is None else length, str(c))


def layer_step(x_out, x_hc, weights, caches, md, rope, ws, indexer_rope=0, times=None):
    """One attention layer of the decode step (decode::layer_step): x_out [T, 4, D] FP32 written
    from x_hc [T, 4, D]; caches {name: tensor} (kv_cache, and per family cmp_kv, state,
    idx_kv_cache, idx_kv_scale, inner_state) updated in place; rope = (cos, sin) of the layer's
    profile; times: optional FP64 [2, 12] accumulating seconds / calls per kernel (KERNELS).
    All or nothing: on a bad argument it raises and has written nothing."""
    ops.layer_step(x_out, x_hc, weights.obj, *[caches.get(k) for k in CACHE_NAMES], md.obj, rope[0],
                   rope[1], ws.obj, indexer_rope, times)


def set_num_threads(n):
    """n > 0: tiledecode runs on its own pool of n threads; 0 (default): on torch's intra-op
    threads (torch.get_num_threads())."""
    ops.set_num_threads(n)


def get_num_threads():
    return ops.get_num_threads()


def set_isa(name=""):
    """Force a CPU tier (scalar, avx2, avx2_vnni, avx512; must be supported); "" = detect."""
    ops.set_isa(name)


def get_isa():
    return ops.get_isa()
