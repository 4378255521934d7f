"""Bad inputs of every class — dtype, device, contiguity / strides, shape / rank, value — raise
ValueError (the binding's checks) or RuntimeError (the library's, naming the argument), and
nothing is written."""
import pytest
import torch

import tiledecode as td

ops = td.ops


def _attention_args(L):
    c = L.cfg
    m = L.meta
    o = torch.full((c.o_groups * L.T, c.o_group_in), 3.0, dtype=torch.bfloat16)
    args = dict(o_packed=o, q=L.v["q"], kv_cache=L.caches["kv_cache"], cmp_kv=L.caches["cmp_kv"],
                window_indices=m["window_indices"], window_lens=m["window_lens"],
                topk_idxs=L.v["topk_idxs"], cmp_block_table=L.tables["cmp_block_table"],
                positions=m["position_ids"], kv_seq_lens=m["kv_seq_lens"], seq=L.S,
                attn_sink=L.w["attn_sink"], rope_cos=L.rope[0], rope_sin=L.rope[1], kind=L.kind,
                config=str(c))
    return args


def _run_attention(a):
    ops.sparse_attention(a["o_packed"], a["q"], a["kv_cache"], a["cmp_kv"], a["window_indices"],
                         a["window_lens"], a["topk_idxs"], a["cmp_block_table"], a["positions"],
                         a["kv_seq_lens"], a["seq"], a["attn_sink"], a["rope_cos"],
                         a["rope_sin"], a["kind"], a["config"])


BAD = [
    # (what, argument, transform of the good tensor, expected exception, message pattern)
    ("dtype", "q", lambda t: t.float(), ValueError, r"'q' has dtype Float; allowed BFloat16"),
    ("dtype", "window_indices", lambda t: t.long(), ValueError, "window_indices"),
    ("dtype", "o_packed", lambda t: t.half(), ValueError, "o_packed"),
    ("device", "q", lambda t: t.to("meta"), ValueError, r"'q' is on device 'meta'"),
    ("device", "kv_cache", lambda t: torch.empty_like(t, device="meta"), ValueError,
     "kv_cache.*CPU tensors only"),
    ("rank", "attn_sink", lambda t: t[None], ValueError, "attn_sink' has 2 dimensions"),
    ("stride", "q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), RuntimeError,
     r"q\.stride\(2\)"),
    ("stride", "kv_cache", lambda t: torch.cat([t, t], 1)[:, ::2], RuntimeError,
     r"kv_cache\.stride\(1\)"),
    ("shape", "q", lambda t: t[:, :, :256], RuntimeError, r"q\.extent\(2\)"),
    ("shape", "window_lens", lambda t: t[:-1], RuntimeError, "window_lens"),
    ("value", "attn_sink", lambda t: torch.full_like(t, float("nan")), RuntimeError,
     r"attn_sink\[0\]"),
    ("value", "positions", lambda t: t + 10 ** 6, RuntimeError, "position"),
]


@pytest.mark.parametrize("what,arg,bad,exc,pattern", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_sparse_attention_bad_inputs(csa, what, arg, bad, exc, pattern):
    a = _attention_args(csa)
    a[arg] = bad(a[arg])
    with pytest.raises(exc, match=pattern):
        _run_attention(a)
    if arg != "o_packed":
        assert a["o_packed"].eq(3.0).all()  # nothing written


def test_layer_step_bad_inputs(hca):
    L = hca
    y = torch.full_like(L.x_out, 2.0)
    caches = {k: v.clone() for k, v in L.caches.items()}

    def run(**kw):
        args = dict(x_out=y, x_hc=L.x_hc, caches=caches, rope=L.rope)
        args.update(kw)
        td.layer_step(args["x_out"], args["x_hc"], L.W, args["caches"], L.md, args["rope"], L.ws)

    with pytest.raises(ValueError, match="x_hc' has dtype Double"):
        run(x_hc=L.x_hc.double())
    with pytest.raises(ValueError, match="x_hc' is on device 'meta'"):
        run(x_hc=L.x_hc.to("meta"))
    with pytest.raises(ValueError, match="kv_cache' is on device 'meta'"):
        run(caches=dict(caches, kv_cache=torch.empty_like(caches["kv_cache"], device="meta")))
    with pytest.raises(ValueError, match="overlapping"):
        run(x_out=torch.zeros(1, 4, L.cfg.hidden).expand(L.T, -1, -1))
    with pytest.raises(RuntimeError, match=r"x_hc\.stride\(2\)"):
        run(x_hc=L.x_hc.transpose(0, 2).contiguous().transpose(0, 2))
    with pytest.raises(RuntimeError, match=r"x_hc\.extent\(0\)"):
        run(x_hc=L.x_hc[:1])
    with pytest.raises(ValueError, match="rope_cos"):
        run(rope=(L.rope[0].float(), L.rope[1]))
    with pytest.raises(ValueError, match="state"):
        run(caches=dict(caches, state=caches["state"].double()))
    assert y.eq(2.0).all()
    for k, v in caches.items():
        assert torch.equal(v, L.caches[k]), k


def test_kernel_ops_bad_inputs(csa):
    L = csa
    c = L.cfg
    m = L.meta
    # output projection: an INT8 weight as float, a transposed wo_b
    out = torch.full((L.T, c.hidden), 1.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="wo_b' has dtype Float"):
        ops.output_projection(out, L.v["o_packed"], L.w["wo_a"], L.w["wo_b"].float(),
                              L.w["wo_b_scale"], str(c))
    with pytest.raises(RuntimeError, match="wo_b"):
        ops.output_projection(out, L.v["o_packed"], L.w["wo_a"], L.w["wo_b"].t(),
                              L.w["wo_b_scale"], str(c))
    # the rounding check's norms: a NaN, a wrong shape
    norm = torch.empty(c.o_groups, c.o_lora)
    ops.output_projection_row_norms(norm, L.w["wo_a"])
    norm[1, 5] = float("nan")
    with pytest.raises(RuntimeError, match=r"wo_a_norm\[1,5\]"):
        ops.output_projection(out, L.v["o_packed"], L.w["wo_a"], L.w["wo_b"], L.w["wo_b_scale"],
                              str(c), norm)
    with pytest.raises(RuntimeError, match="wo_a_norm"):
        ops.output_projection(out, L.v["o_packed"], L.w["wo_a"], L.w["wo_b"], L.w["wo_b_scale"],
                              str(c), norm[:, 1:])
    assert out.eq(1.0).all()
    # the compressor's rounding-check norms: a NaN, a wrong shape; nothing written
    state = L.before["state"].clone()
    cmp_kv = L.before["cmp_kv"].clone()
    cnorm = torch.empty(2 * L.w["cmp_wkv"].shape[0])
    ops.compressor_row_norms(cnorm, L.w["cmp_wkv"], L.w["cmp_wgate"])
    cnorm[7] = float("nan")
    for bad, what in ((cnorm, r"row_norms\[7\]"), (cnorm[1:], "row_norms")):
        with pytest.raises(RuntimeError, match=what):
            ops.compressor(state, cmp_kv, None, L.v["x_n"], L.w["cmp_wkv"], L.w["cmp_wgate"],
                           L.w["cmp_ape"], L.w["cmp_norm_w"], m["position_ids"],
                           m["csa_state_slot_mapping"], m["csa_cmp_slot_mapping"],
                           L.tables["csa_state_table"], *L.rope, 4, L.S, str(c), bad)
    assert torch.equal(state, L.before["state"]) and torch.equal(cmp_kv, L.before["cmp_kv"])
    # the kv check's norms: a negative one, a wrong shape; nothing written
    knorm = torch.empty(c.head_dim)
    ops.qkv_wkv_norms(knorm, L.w["wkv"])
    knorm[3] = -1.0
    q = torch.full((L.T, c.n_heads, c.head_dim), 5.0, dtype=torch.bfloat16)
    kv = torch.full((L.T, c.head_dim), 5.0, dtype=torch.bfloat16)
    qr = torch.full((L.T, c.q_lora), 5, dtype=torch.int8)
    qr_scale = torch.full((L.T,), 5.0)
    for bad, what in ((knorm, r"'w\.wkv_norm\[3\]' = -1"), (knorm[1:], "wkv_norm")):
        with pytest.raises(RuntimeError, match=what):
            ops.qkv_projection(q, kv, qr, qr_scale, L.v["x_n"], L.w["wq_a"], L.w["gamma_cq"],
                               L.w["wq_b"], L.w["wq_b_scale"], L.w["wkv"], L.w["gamma_ckv"],
                               *L.rope, m["position_ids"], str(c), None, bad)
    assert q.eq(5.0).all() and kv.eq(5.0).all() and qr.eq(5).all() and qr_scale.eq(5.0).all()
    # top-k: k larger than the row
    topk = torch.full((L.T, c.score_len), 7, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="topk"):
        ops.indexer_topk(topk, L.v["score"], m["position_ids"], m["kv_seq_lens"], L.S,
                         c.score_len + 1, 0, str(c))
    assert topk.eq(7).all()
    # score: an index cache on the wrong device, a table entry outside the pool
    score = torch.zeros(L.T, c.score_len)
    with pytest.raises(ValueError, match="idx_kv_cache' is on device 'meta'"):
        ops.indexer_score(score, L.v["idx_q_i8"], L.v["idx_q_scale"], L.v["idx_weights"],
                          L.caches["idx_kv_cache"].to("meta"), L.caches["idx_kv_scale"],
                          L.tables["idx_block_table"], m["position_ids"], m["kv_seq_lens"], L.S,
                          str(c))
    table = L.tables["idx_block_table"].clone()
    table[0, 0] = 10 ** 6
    with pytest.raises(RuntimeError, match="idx_block_table"):
        ops.indexer_score(score, L.v["idx_q_i8"], L.v["idx_q_scale"], L.v["idx_weights"],
                          L.caches["idx_kv_cache"], L.caches["idx_kv_scale"], table,
                          m["position_ids"], m["kv_seq_lens"], L.S, str(c))
    assert score.eq(0).all()
    # compressor: a slot outside the state pool writes nothing
    state = L.before["state"].clone()
    cmp_kv = L.before["cmp_kv"].clone()
    slots = m["csa_state_slot_mapping"].clone()
    slots[-1] = state.shape[0]
    with pytest.raises(RuntimeError, match="state_slot_mapping"):
        ops.compressor(state, cmp_kv, None, L.v["x_n"], L.w["cmp_wkv"], L.w["cmp_wgate"],
                       L.w["cmp_ape"], L.w["cmp_norm_w"], m["position_ids"], slots,
                       m["csa_cmp_slot_mapping"], L.tables["csa_state_table"], *L.rope, 4, L.S,
                       str(c))
    assert torch.equal(state, L.before["state"]) and torch.equal(cmp_kv, L.before["cmp_kv"])
    # hc_pre: wrong output shape; gather: a pool that cannot be seen as rows without a copy
    xm = torch.zeros(L.T, c.hidden + 1, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x_mixed"):
        ops.hc_pre(xm, torch.zeros(L.T, 4), torch.zeros(L.T, 4, 4), L.x_hc, L.w["hc_fn"],
                   L.w["hc_scale"], L.w["hc_base"], str(c))
    pool = torch.zeros(4, 128, 512, dtype=torch.bfloat16).transpose(0, 1)
    with pytest.raises(ValueError, match="cannot be seen as rows without a copy"):
        ops.write_cache(pool, torch.zeros(1, 512, dtype=torch.bfloat16), torch.tensor([0]))


def test_config_errors():
    with pytest.raises(ValueError, match="config"):
        ops.rope_table(0, 16, "flash:hidden=abc")
    with pytest.raises(ValueError, match="unknown"):
        ops.rope_table(0, 16, "flash:bogus=3")
    with pytest.raises(ValueError, match="preset"):
        ops.rope_table(0, 16, "mini")
    with pytest.raises(ValueError, match="kind"):
        ops.rope_table(3, 16, "flash")
