"""The whole layer step from Python: a 50-step MTP decode loop of an SWA + CSA + HCA stack through
the Python API, equal bit for bit to the C++ layer step run by a plain C++ loop
(torch.ops.tiledecode._cpp_decode_loop: decode::layer_step called directly, its own StepMetadata and
Workspace); zero-copy pools; all or nothing on error; the GIL released; threads."""
import threading
import time

import pytest
import torch

import tiledecode as td
from tiledecode import synthetic as syn

ops = td.ops
STEPS = 50


def _stack(cfg, B, seed=11):
    pools = td.pools_for_batch(B)
    layers = []
    for i, kind in enumerate((td.SWA, td.CSA, td.HCA)):
        w = syn.weights(kind, cfg, layer=i, seed=seed)
        layers.append(dict(kind=kind, W=td.Weights(kind, w, cfg),
                           caches=syn.caches(kind, pools, cfg, layer=i, seed=seed),
                           rope=td.rope_table(kind, config=cfg)))
    return pools, layers


def test_decode_loop_equals_cpp_layer_step():
    cfg = td.Config("flash").narrow()
    B, S = 2, 2
    pools, layers = _stack(cfg, B)
    tables = td.fixture_tables(B, pools, cfg)
    initial = [{k: v.clone() for k, v in L["caches"].items()} for L in layers]
    md = td.StepMetadata(B, S, cfg)
    ws = td.Workspace(B, S, cfg)
    # start 8190 crosses ratio-4 boundaries, 120 crosses the ratio-128 one at position 127
    starts = torch.tensor([8190, 120], dtype=torch.int32)
    T = B * S
    ins = torch.empty(len(layers), STEPS, T, 4, cfg.hidden)
    outs = torch.empty_like(ins)
    all_starts = torch.empty(STEPS, B, dtype=torch.int32)
    for step in range(STEPS):
        all_starts[step] = starts
        md.build(starts, S, 1, tables, pools)  # once per step, shared by every layer
        x = syn.x_hc(T, cfg, step=step)
        for li, L in enumerate(layers):
            ins[li, step] = x
            y = torch.empty_like(x)
            td.layer_step(y, x, L["W"], L["caches"], md, L["rope"], ws)
            outs[li, step] = y
            x = y
        starts = starts + 1  # commit_tokens = 1
    for li, L in enumerate(layers):
        c = {k: v.clone() for k, v in initial[li].items()}
        cpp_out = torch.empty_like(ins[li])
        ops._cpp_decode_loop(cpp_out, ins[li], L["W"].obj, c["kv_cache"], c.get("cmp_kv"),
                             c.get("state"), c.get("idx_kv_cache"), c.get("idx_kv_scale"),
                             c.get("inner_state"), all_starts, S, 1,
                             *[tables[k] for k in td.TABLE_NAMES], pools, *L["rope"])
        assert torch.equal(cpp_out, outs[li]), f"layer {li}: x_out differs"
        for k, v in c.items():
            assert torch.equal(v, L["caches"][k]), f"layer {li}: {k} differs"
        assert torch.isfinite(outs[li]).all()


def test_layer_step_writes_only_the_named_rows(csa):
    L = csa
    for k, v in L.caches.items():
        assert v.data_ptr() != L.before[k].data_ptr()
    m = L.meta
    named = {"kv_cache": m["ori_slot_mapping"], "cmp_kv": m["csa_cmp_slot_mapping"],
             "state": m["csa_state_slot_mapping"], "idx_kv_cache": m["csa_idx_slot_mapping"],
             "inner_state": m["csa_inner_state_slot_mapping"]}
    for k, slots in named.items():
        rows = (L.caches[k] != L.before[k]).reshape(L.caches[k].shape[0], -1).any(1)
        changed = set(rows.nonzero().flatten().tolist())
        assert changed <= {s for s in slots.tolist() if s >= 0}, k
        assert changed, k


def test_layer_step_in_place_and_times():
    cfg = td.Config("flash").narrow()
    B, S = 2, 2
    pools = td.pools_for_batch(B)
    c = syn.caches(td.HCA, pools, cfg)
    ptrs = {k: v.data_ptr() for k, v in c.items()}
    W = td.Weights(td.HCA, syn.weights(td.HCA, cfg), cfg)
    md = td.StepMetadata(B, S, cfg).build(torch.tensor([300, 4000], dtype=torch.int32), S, 1,
                                          td.fixture_tables(B, pools, cfg), pools)
    ws = td.Workspace(B, S, cfg)
    x = syn.x_hc(B * S, cfg)
    y = torch.empty_like(x)
    times = torch.zeros(2, len(td.KERNELS), dtype=torch.float64)
    rope = td.rope_table(td.HCA, config=cfg)
    for _ in range(3):
        td.layer_step(y, x, W, c, md, rope, ws, times=times)
    assert {k: v.data_ptr() for k, v in c.items()} == ptrs
    calls = dict(zip(td.KERNELS, times[1].tolist()))
    assert calls["compressor"] == 3 and calls["indexer_score"] == 0 and calls["sparse_attn"] == 3
    assert (times[0] >= 0).all() and times[0].sum() > 0


def test_layer_step_all_or_nothing(csa):
    L = csa
    caches = {k: v.clone() for k, v in L.caches.items()}
    y = torch.full_like(L.x_out, 5.0)
    small = dict(caches, kv_cache=caches["kv_cache"][:128])  # fewer rows than md's pools
    with pytest.raises(RuntimeError, match=r"caches\.kv_cache"):
        td.layer_step(y, L.x_hc, L.W, small, L.md, L.rope, L.ws)
    with pytest.raises(RuntimeError, match="x_out"):
        td.layer_step(y[:, :, :-1], L.x_hc, L.W, caches, L.md, L.rope, L.ws)
    with pytest.raises(RuntimeError, match="x_out"):
        td.layer_step(L.x_hc, L.x_hc, L.W, caches, L.md, L.rope, L.ws)  # aliasing
    no_idx = dict(caches)
    del no_idx["idx_kv_cache"]
    with pytest.raises(RuntimeError, match="idx_kv_cache"):
        td.layer_step(y, L.x_hc, L.W, no_idx, L.md, L.rope, L.ws)
    assert y.eq(5.0).all()
    for k, v in caches.items():
        assert torch.equal(v, L.caches[k]), k


def test_holders_must_share_the_config(csa):
    L = csa
    other = td.Workspace(2, 2, td.Config("flash"))
    with pytest.raises(ValueError, match="ws"):
        td.layer_step(torch.empty_like(L.x_out), L.x_hc, L.W, L.caches, L.md, L.rope, other)


def test_weights_validated_at_load():
    cfg = td.Config("flash").narrow()
    w = syn.weights(td.CSA, cfg)
    bad = dict(w, wq_b=w["wq_b"].to(torch.int32))
    with pytest.raises(ValueError, match="wq_b"):
        td.Weights(td.CSA, bad, cfg)
    missing = dict(w)
    del missing["hadamard"]
    with pytest.raises(ValueError, match="hadamard"):
        td.Weights(td.CSA, missing, cfg)
    with pytest.raises(ValueError, match="cmp_wkv"):
        td.Weights(td.SWA, w, cfg)  # not a weight of SWA layers
    with pytest.raises(RuntimeError, match="idx_wq_b"):
        td.Weights(td.CSA, dict(w, idx_wq_b=w["idx_wq_b"][:, :-1]), cfg)


def test_gil_is_released_while_a_kernel_runs():
    # A Python thread keeps counting while one long op (20 layer steps in C++) runs.
    cfg = td.Config("flash").narrow()
    B, S, steps = 2, 2, 20
    pools = td.pools_for_batch(B)
    kind = td.CSA
    W = td.Weights(kind, syn.weights(kind, cfg), cfg)
    c = syn.caches(kind, pools, cfg)
    tables = td.fixture_tables(B, pools, cfg)
    x = syn.x_hc(B * S, cfg).expand(steps, -1, -1, -1).contiguous()
    y = torch.empty_like(x)
    starts = (torch.tensor([8000, 100], dtype=torch.int32) + torch.arange(steps, dtype=torch.int32)[
        :, None]).contiguous()
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.02)
    c0 = count[0]
    t0 = time.perf_counter()
    ops._cpp_decode_loop(y, x, W.obj, c["kv_cache"], c["cmp_kv"], c["state"], c["idx_kv_cache"],
                         c["idx_kv_scale"], c["inner_state"], starts, S, 1,
                         *[tables[k] for k in td.TABLE_NAMES], pools, *td.rope_table(kind, config=cfg))
    dt = time.perf_counter() - t0
    c1 = count[0]
    stop[0] = True
    th.join()
    assert c1 - c0 > 100, f"the counting thread advanced {c1 - c0} times in {dt * 1e3:.1f} ms"


def test_threads_follow_torch_and_do_not_change_results(hca):
    L = hca
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert td.get_num_threads() == 2
        torch.set_num_threads(1)
        assert td.get_num_threads() == 1
        results = []
        for n in (1, 3):
            td.set_num_threads(n)
            assert td.get_num_threads() == n
            c = {k: v.clone() for k, v in L.before.items()}
            y = torch.empty_like(L.x_hc)
            ws = td.Workspace(L.B, L.S, L.cfg)
            td.layer_step(y, L.x_hc, L.W, c, L.md, L.rope, ws)
            results.append((y, c))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][0], L.x_out)
        for k in L.before:
            assert torch.equal(results[0][1][k], results[1][1][k]), k
    finally:
        td.set_num_threads(0)
        torch.set_num_threads(old)
    assert td.get_num_threads() == old


def test_engine_pool_layout_is_the_same_memory(csa):
    # The engine's [blocks, page, 1, W] pools (and [blocks, page, 1, 1] scales) are the rows the
    # library reads: the same step on 4-D views of copies of the pools gives the same bits.
    L = csa
    c = L.cfg
    flat = {k: v.clone() for k, v in L.before.items()}
    paged = {}
    for k, v in flat.items():
        page = c.page if k in ("kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale") else \
            c.c4_state_page
        w = v.shape[1] if v.dim() == 2 else 1
        paged[k] = v.view(v.shape[0] // page, page, 1, w)
    y = torch.empty_like(L.x_hc)
    td.layer_step(y, L.x_hc, L.W, paged, L.md, L.rope, L.ws)
    assert torch.equal(y, L.x_out)
    for k in flat:
        assert paged[k].data_ptr() == flat[k].data_ptr()
        assert torch.equal(flat[k], L.caches[k]), k


def test_indexer_rope_reference_option(csa):
    # LayerOptions.indexer_rope: 0 = absolute (pos_t), 1 = reference (start_b for both tokens).
    L = csa
    c = {k: v.clone() for k, v in L.before.items()}
    y = torch.empty_like(L.x_hc)
    ws = td.Workspace(L.B, L.S, L.cfg)
    td.layer_step(y, L.x_hc, L.W, c, L.md, L.rope, ws, indexer_rope=1)
    want = L.starts.repeat_interleave(L.S)
    assert torch.equal(ws.tensors(L.B, L.S)["idx_rope_pos"], want)
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="indexer_rope"):
        td.layer_step(y, L.x_hc, L.W, c, L.md, L.rope, ws, indexer_rope=2)
