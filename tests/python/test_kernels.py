"""Every kernel op against the plain-PyTorch restatement of the spec (reference.py) with the spec's
comparators and tolerances (§10.2, addendum §12; the rules of tests/common/tolerances.hpp), on the
inputs of a real layer step (conftest.Layer); and each op equal, bit for bit, to what the layer
step computed from the same inputs (the op-by-op route is the layer step)."""
import pytest
import torch

import reference as ref
import tiledecode as td
from conftest import assert_close

ops = td.ops
BF16_RULE = (1e-4, 1.0 / 128, 0.0)
# tests/common/tolerances.hpp
HC_GATES = (1e-5, 1e-4, 0.0)
QR = (1.0, 0.0, 0.0)
QR_SCALE = (2.5e-5, 5e-3, 0.0)
CMP_KV = (1e-4, 1.0 / 128, 0.0)
STATE = (1e-3, 1e-3, 0.0)
IDX_CODES = (1.0, 0.0, 0.01)
IDX_SCALE = (1e-4, 1.0 / 128, 0.01)
IDX_Q_I8 = (1.0, 0.0, 0.005)
SCORE = (1e-4, 1.0 / 128, 0.005)
ATTN = (1e-4, 1.0 / 128, 0.005)
HC_POST = (1e-5, 1e-5, 0.0)


@pytest.mark.parametrize("family", ["csa", "csa_flash"])
def test_hc_pre(family, request):
    L = request.getfixturevalue(family)
    x_mixed = torch.empty(L.T, L.cfg.hidden, dtype=torch.bfloat16)
    post = torch.empty(L.T, 4)
    comb = torch.empty(L.T, 4, 4)
    ops.hc_pre(x_mixed, post, comb, L.x_hc, L.w["hc_fn"], L.w["hc_scale"], L.w["hc_base"],
               str(L.cfg))
    xm, p, c = ref.hc_pre(L.x_hc, L.w["hc_fn"], L.w["hc_scale"], L.w["hc_base"])
    assert_close(x_mixed, xm, BF16_RULE)
    assert_close(post, p, HC_GATES)
    assert_close(comb, c, HC_GATES)
    assert torch.equal(x_mixed, L.v["x_mixed"]) and torch.equal(comb, L.v["comb"])


def test_rmsnorm(csa):
    L = csa
    x_n = torch.empty_like(L.v["x_mixed"])
    ops.rmsnorm(x_n, L.v["x_mixed"], L.w["attn_norm"], 1e-6)
    assert_close(x_n, ref.rmsnorm(L.v["x_mixed"], L.w["attn_norm"]), BF16_RULE)
    assert torch.equal(x_n, L.v["x_n"])


@pytest.mark.parametrize("family", ["swa", "csa", "csa_flash"])
def test_qkv_projection(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    q = torch.empty(L.T, c.n_heads, c.head_dim, dtype=torch.bfloat16)
    kv = torch.empty(L.T, c.head_dim, dtype=torch.bfloat16)
    qr = torch.empty(L.T, c.q_lora, dtype=torch.int8)
    qr_scale = torch.empty(L.T)
    pos = L.meta["position_ids"]
    # with the q-latent's and the kv rounding checks (the norms the layer step's Weights makes),
    # with one of them, and without
    wq_a_norm = torch.empty(c.q_lora)
    ops.qkv_wq_a_norms(wq_a_norm, L.w["wq_a"])
    wkv_norm = torch.empty(c.head_dim)
    ops.qkv_wkv_norms(wkv_norm, L.w["wkv"])
    rq, rkv, rqr, rqs = ref.qkv_projection(L.v["x_n"], L.w, *L.rope, pos, c)
    for qn, kn in ((wq_a_norm, wkv_norm), (wq_a_norm, None), (None, None)):
        ops.qkv_projection(q, kv, qr, qr_scale, L.v["x_n"], L.w["wq_a"], L.w["gamma_cq"],
                           L.w["wq_b"], L.w["wq_b_scale"], L.w["wkv"], L.w["gamma_ckv"], *L.rope,
                           pos, str(c), qn, kn)
        assert_close(qr, rqr, QR)
        assert_close(qr_scale, rqs, QR_SCALE)
        assert_close(q, rq, BF16_RULE)
        assert_close(kv, rkv, BF16_RULE)
        if qn is not None:
            for name, t in (("q", q), ("qr", qr), ("qr_scale", qr_scale)):
                assert torch.equal(t, L.v[name]), name
        if kn is not None:
            assert torch.equal(kv, L.v["kv"])


def test_kv_check_reaches_the_layer_step():
    """The Weights' kv rounding check is what the layer step runs: at the first seed from 31 where
    the checked dots (wkv_norm) and the plain FP32 dots give a different kv (31 itself here: one
    value; one seed in about 15 flips one), the step's kv is the checked one."""
    from conftest import Layer
    for seed in range(31, 91):
        L = Layer(td.SWA, seed=seed)
        c = L.cfg
        wkv_norm = torch.empty(c.head_dim)
        ops.qkv_wkv_norms(wkv_norm, L.w["wkv"])
        got = {}
        for kn in (wkv_norm, None):
            q = torch.empty(L.T, c.n_heads, c.head_dim, dtype=torch.bfloat16)
            kv = torch.empty(L.T, c.head_dim, dtype=torch.bfloat16)
            qr = torch.empty(L.T, c.q_lora, dtype=torch.int8)
            qr_scale = torch.empty(L.T)
            ops.qkv_projection(q, kv, qr, qr_scale, L.v["x_n"], L.w["wq_a"], L.w["gamma_cq"],
                               L.w["wq_b"], L.w["wq_b_scale"], L.w["wkv"], L.w["gamma_ckv"],
                               *L.rope, L.meta["position_ids"], str(c), None, kn)
            got[kn is None] = kv
        if not torch.equal(got[False], got[True]):
            assert torch.equal(L.v["kv"], got[False]), seed
            return
    pytest.fail("no seed in [31, 91) where the kv check changes a kv value")


def test_compressor_check_reaches_the_layer_step(csa, csa_checked, hca, hca_checked):
    """td.Weights(compressor_check=True) is what the layer step runs (test_compressor and
    test_indexer_compressor: its pools equal the ops' given row_norms): at these fixtures the
    check repairs state values (seed 7), so its pools differ from the unchecked step's."""
    assert csa_checked.W.compressor_check and not csa.W.compressor_check
    for plain, checked in ((csa, csa_checked), (hca, hca_checked)):
        assert not torch.equal(plain.caches["state"], checked.caches["state"])
    assert not torch.equal(csa.caches["inner_state"], csa_checked.caches["inner_state"])


def row_norms(L, prefix):
    """The compressor rounding check's row norms where L's Weights turned it on, else None."""
    if not L.W.compressor_check:
        return None
    wkv = L.w[prefix + "wkv"]
    n = torch.empty(2 * wkv.shape[0])
    ops.compressor_row_norms(n, wkv, L.w[prefix + "wgate"])
    return n


@pytest.mark.parametrize("family", ["csa", "hca", "csa_flash", "csa_checked", "hca_checked"])
def test_compressor(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    csa = L.kind == td.CSA
    R = 4 if csa else 128
    state = L.before["state"].clone()
    cmp_kv = L.before["cmp_kv"].clone()
    kv_out = torch.zeros(L.B, c.head_dim)
    m = L.meta
    state_slots = m["csa_state_slot_mapping" if csa else "hca_state_slot_mapping"]
    cmp_slots = m["csa_cmp_slot_mapping" if csa else "hca_cmp_slot_mapping"]
    table = L.tables["csa_state_table" if csa else "hca_state_table"]
    ops.compressor(state, cmp_kv, kv_out, L.v["x_n"], L.w["cmp_wkv"], L.w["cmp_wgate"],
                   L.w["cmp_ape"], L.w["cmp_norm_w"], m["position_ids"], state_slots, cmp_slots,
                   table, *L.rope, R, L.S, str(c), row_norms(L, "cmp_"))
    rstate = L.before["state"].to(torch.float64).clone()
    emitted, rkv_out = ref.compressor(
        rstate, L.v["x_n"], L.w["cmp_wkv"], L.w["cmp_wgate"], L.w["cmp_ape"], L.w["cmp_norm_w"],
        m["position_ids"], state_slots, cmp_slots, table, *L.rope, R, csa, c.head_dim, L.B, L.S,
        c.c4_state_page if csa else c.c128_state_page)
    assert len(emitted) == 1  # request 1 closes a window at s = 0 (committed)
    assert_close(state, rstate, STATE)
    for slot, y in emitted.items():
        assert_close(cmp_kv[slot], ref.bf16(y), CMP_KV)
    for b, y in rkv_out.items():
        assert_close(kv_out[b], y, STATE)
    written = {s for s in cmp_slots.tolist() if s >= 0}
    untouched = [r for r in range(cmp_kv.shape[0]) if r not in written]
    assert torch.equal(cmp_kv[untouched], L.before["cmp_kv"][untouched])
    assert torch.equal(state, L.caches["state"]) and torch.equal(cmp_kv, L.caches["cmp_kv"])


@pytest.mark.parametrize("family", ["csa", "csa_checked"])
def test_indexer_compressor(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    m = L.meta
    state = L.before["inner_state"].clone()
    idx = L.before["idx_kv_cache"].clone()
    scale = L.before["idx_kv_scale"].clone()
    ops.indexer_compressor(state, idx, scale, None, L.v["x_n"], L.w["inner_wkv"],
                           L.w["inner_wgate"], L.w["inner_ape"], L.w["inner_norm_w"],
                           L.w["hadamard"], m["position_ids"], m["csa_inner_state_slot_mapping"],
                           m["csa_idx_slot_mapping"], L.tables["csa_inner_state_table"], *L.rope,
                           L.S, 0, str(c), row_norms(L, "inner_"))
    rstate = L.before["inner_state"].to(torch.float64).clone()
    emitted, _ = ref.compressor(
        rstate, L.v["x_n"], L.w["inner_wkv"], L.w["inner_wgate"], L.w["inner_ape"],
        L.w["inner_norm_w"], m["position_ids"], m["csa_inner_state_slot_mapping"],
        m["csa_idx_slot_mapping"], L.tables["csa_inner_state_table"], *L.rope, 4, True,
        c.idx_head_dim, L.B, L.S, c.c4_state_page)
    assert len(emitted) == 1
    assert_close(state, rstate, STATE)
    for slot, y in emitted.items():
        codes, sc = ref.inner_emit(y, L.w["hadamard"])
        assert_close(idx[slot], codes, IDX_CODES)
        assert_close(scale[slot:slot + 1], sc.reshape(1), IDX_SCALE)
    assert torch.equal(idx, L.caches["idx_kv_cache"]) and torch.equal(scale,
                                                                       L.caches["idx_kv_scale"])


@pytest.mark.parametrize("family", ["csa", "csa_flash"])
def test_indexer_query_and_weights(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    q_i8 = torch.empty(L.T, c.idx_n_heads, c.idx_head_dim, dtype=torch.int8)
    q_sc = torch.empty(L.T, c.idx_n_heads)
    rope_pos = L.v["idx_rope_pos"]
    assert torch.equal(rope_pos, L.meta["position_ids"])  # IndexerRope.absolute: pos_t
    ops.indexer_query(q_i8, q_sc, L.v["qr"], L.v["qr_scale"], L.w["idx_wq_b"],
                      L.w["idx_wq_b_scale"], L.w["hadamard"], rope_pos, *L.rope, str(c))
    rq, rs = ref.indexer_query(L.v["qr"], L.v["qr_scale"], L.w["idx_wq_b"], L.w["idx_wq_b_scale"],
                               L.w["hadamard"], rope_pos, *L.rope, c)
    assert_close(q_i8, rq, IDX_Q_I8)
    assert_close(q_sc, rs, QR_SCALE)
    assert torch.equal(q_i8, L.v["idx_q_i8"]) and torch.equal(q_sc, L.v["idx_q_scale"])
    w = torch.empty(L.T, c.idx_n_heads)
    ops.indexer_weights(w, L.v["x_n"], L.w["weights_proj"], str(c))
    assert_close(w, ref.indexer_weights(L.v["x_n"], L.w["weights_proj"], c), BF16_RULE)
    assert torch.equal(w, L.v["idx_weights"])


@pytest.mark.parametrize("family", ["csa", "csa_flash", "csa_pro"])
def test_indexer_score_and_topk(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    m = L.meta
    score = torch.empty(L.T, c.score_len)
    ops.indexer_score(score, L.v["idx_q_i8"], L.v["idx_q_scale"], L.v["idx_weights"],
                      L.caches["idx_kv_cache"], L.caches["idx_kv_scale"],
                      L.tables["idx_block_table"], m["position_ids"], m["kv_seq_lens"], L.S,
                      str(c))
    rscore, vis = ref.indexer_score(L.v["idx_q_i8"], L.v["idx_q_scale"], L.v["idx_weights"],
                                    L.caches["idx_kv_cache"], L.caches["idx_kv_scale"],
                                    L.tables["idx_block_table"], m["position_ids"],
                                    m["kv_seq_lens"], L.S, c)
    assert vis.tolist() == [2048, 2048, 32, 32]
    shown = rscore != ref.NEG_BIG
    assert_close(score[shown], rscore[shown], SCORE)
    assert torch.equal(score[~shown], rscore[~shown].to(torch.float32))  # the tail, exact
    assert torch.equal(score, L.v["score"])
    topk = torch.empty(L.T, c.score_len, dtype=torch.int32)
    ops.indexer_topk(topk, score, m["position_ids"], m["kv_seq_lens"], L.S, c.idx_topk, 0, str(c))
    # exact under the deterministic rule (descending score, ascending index), on the op's scores
    want = ref.topk(score.to(torch.float64), vis, c.idx_topk, 0, c.score_len)
    assert torch.equal(topk, want)
    for t in range(L.T):
        ok, msg = ref.topk_pair_compare(topk[t, :c.idx_topk], want[t, :c.idx_topk], score[t])
        assert ok, msg
    assert torch.equal(topk, L.v["topk_idxs"])
    # offset (the standalone reference test's WIN shift)
    shifted = torch.empty_like(topk)
    ops.indexer_topk(shifted, score, m["position_ids"], m["kv_seq_lens"], L.S, c.idx_topk, 128,
                     str(c))
    assert torch.equal(shifted[topk >= 0], topk[topk >= 0] + 128)
    assert shifted[topk < 0].eq(-1).all()


@pytest.mark.parametrize("family", ["swa", "csa", "hca", "csa_flash", "csa_pro"])
def test_sparse_attention(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    m = L.meta
    kind = L.kind
    o = torch.empty(c.o_groups * L.T, c.o_group_in, dtype=torch.bfloat16)
    cmp_kv = None if kind == td.SWA else L.caches["cmp_kv"]
    topk = L.v["topk_idxs"] if kind == td.CSA else None
    table = None if kind == td.SWA else L.tables["cmp_block_table"]
    sink = L.w["attn_sink"]
    ops.sparse_attention(o, L.v["q"], L.caches["kv_cache"], cmp_kv, m["window_indices"],
                         m["window_lens"], topk, table, m["position_ids"], m["kv_seq_lens"], L.S,
                         sink, *L.rope, kind, str(c))
    want = ref.sparse_attention(L.v["q"], L.caches["kv_cache"], cmp_kv, m["window_indices"],
                                m["window_lens"], topk, table, m["position_ids"],
                                m["kv_seq_lens"], L.S, sink, *L.rope, kind, c)
    assert_close(o, want, ATTN)
    assert torch.equal(o, L.v["o_packed"])


@pytest.mark.parametrize("family", ["hca", "csa_flash"])
def test_output_projection_and_hc_post(family, request):
    L = request.getfixturevalue(family)
    c = L.cfg
    out = torch.empty(L.T, c.hidden, dtype=torch.bfloat16)
    want = ref.output_projection(L.v["o_packed"], L.w["wo_a"], L.w["wo_b"], L.w["wo_b_scale"], c)
    ops.output_projection(out, L.v["o_packed"], L.w["wo_a"], L.w["wo_b"], L.w["wo_b_scale"],
                          str(c))
    assert_close(out, want, ATTN)
    # with the rounding check (the norms the layer step's Weights makes): the step's bits
    wo_a_norm = torch.empty(c.o_groups, c.o_lora)
    ops.output_projection_row_norms(wo_a_norm, L.w["wo_a"])
    ops.output_projection(out, L.v["o_packed"], L.w["wo_a"], L.w["wo_b"], L.w["wo_b_scale"],
                          str(c), wo_a_norm)
    assert_close(out, want, ATTN)
    assert torch.equal(out, L.v["attn_out"])
    y = torch.empty_like(L.x_hc)
    ops.hc_post(y, out, L.x_hc, L.v["post"], L.v["comb"], str(c))
    assert_close(y, ref.hc_post(out, L.x_hc, L.v["post"], L.v["comb"]), HC_POST)
    assert torch.equal(y, L.x_out)
