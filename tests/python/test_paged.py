"""Metadata build, paged cache write / gather (spec §3) against the plain-PyTorch restatement;
zero-copy: the caller's pools are written in place, only the rows the slot mapping names."""
import pytest
import torch

import reference as ref
import tiledecode as td

ops = td.ops


@pytest.mark.parametrize("starts", [(8192, 127, 31, 8192), (8192, 127, 128, 255), (8192, 0, 2, 3)])
@pytest.mark.parametrize("commit", [-1, 1])
def test_metadata_matches_spec(starts, commit):
    cfg = td.Config("flash")
    B, S = len(starts), 2
    pools = td.pools_for_batch(B)
    tables = td.fixture_tables(B, pools, cfg)
    md = td.StepMetadata(B, S, cfg)
    st = torch.tensor(starts, dtype=torch.int32)
    md.build(st, S, commit, tables, pools)
    got = md.tensors()
    want = ref.metadata(st, S, commit, tables, cfg)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k
        assert got[k].dtype == (torch.int64 if "slot" in k else torch.int32), k


def test_metadata_worked_example():
    # spec §3.9: request 3 at start 3 closes compressed row 0 at s = 0: slots 384.
    cfg = td.Config("flash")
    pools = td.pools_for_batch(4)
    md = td.StepMetadata(4, 2, cfg)
    md.build(torch.tensor([8192, 127, 31, 3], dtype=torch.int32), 2, -1,
             td.fixture_tables(4, pools, cfg), pools)
    m = md.tensors()
    assert m["ori_slot_mapping"][:2].tolist() == [0, 1]
    assert m["csa_cmp_slot_mapping"][6].item() == 384
    assert m["csa_idx_slot_mapping"][6].item() == 384
    assert m["csa_state_slot_mapping"][6:8].tolist() == [15, 28]
    assert m["kv_seq_lens"][3].item() == 5


def test_metadata_tensors_are_views_of_the_bundle():
    cfg = td.Config("flash")
    pools = td.pools_for_batch(2)
    tables = td.fixture_tables(2, pools, cfg)
    md = td.StepMetadata(2, 2, cfg)
    md.build(torch.tensor([10, 20], dtype=torch.int32), 2, 1, tables, pools)
    pos = md.tensors()["position_ids"]
    ptr = pos.data_ptr()
    md.build(torch.tensor([11, 21], dtype=torch.int32), 2, 1, tables, pools)
    assert pos.data_ptr() == ptr and pos.tolist() == [11, 12, 21, 22]  # rebuilt in place


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 512), (torch.int8, 128),
                                         (torch.float32, 2048), (torch.float32, 1)])
def test_write_cache_in_place_only_named_rows(dtype, width):
    g = torch.Generator().manual_seed(1)
    pool = (torch.randn(64, width, generator=g) * 10).to(dtype)
    before = pool.clone()
    rows = (torch.randn(5, width, generator=g) * 10).to(dtype)
    slots = torch.tensor([3, -1, 17, 63, -1], dtype=torch.int64)
    ptr = pool.data_ptr()
    ops.write_cache(pool, rows, slots)
    assert pool.data_ptr() == ptr
    changed = (pool != before).reshape(64, -1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {3, 17, 63}
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(pool[s], rows[t])
    untouched = [r for r in range(64) if r not in (3, 17, 63)]
    assert torch.equal(pool[untouched], before[untouched])


def test_write_cache_engine_layout_and_scale_pool():
    # [blocks, page, 1, W] pools as an engine allocates them, and [blocks, page, 1, 1] scales.
    pool = torch.zeros(4, 128, 1, 512, dtype=torch.bfloat16)
    scale = torch.zeros(4, 128, 1, 1)
    rows = torch.ones(2, 512, dtype=torch.bfloat16)
    ops.write_cache(pool, rows, torch.tensor([130, -1]))
    ops.write_cache(scale, torch.tensor([[2.5], [7.0]]), torch.tensor([5, 511]))
    assert pool[1, 2, 0].eq(1).all() and pool.sum().item() == 512
    assert scale[0, 5, 0, 0].item() == 2.5 and scale[3, 127, 0, 0].item() == 7.0


def test_write_cache_strided_pool():
    # A pool that is a column slice of a wider buffer (row stride != width): written in place.
    base = torch.zeros(16, 1024, dtype=torch.bfloat16)
    pool = base[:, :512]
    ops.write_cache(pool, torch.full((1, 512), 3.0, dtype=torch.bfloat16), torch.tensor([2]))
    assert base[2, :512].eq(3).all() and base[2, 512:].eq(0).all() and base.sum() == 3 * 512


def test_write_cache_rejects_and_writes_nothing():
    pool = torch.zeros(8, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\]"):
        ops.write_cache(pool, torch.ones(2, 4, dtype=torch.bfloat16), torch.tensor([3, 8]))
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\]"):
        ops.write_cache(pool, torch.ones(1, 4, dtype=torch.bfloat16), torch.tensor([-2]))
    assert pool.eq(0).all()


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_gather_rows(idx_dtype):
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(32, 512, generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 31, 0], dtype=idx_dtype)
    dst = torch.full((4, 512), 9.0, dtype=torch.bfloat16)
    valid = torch.full((4,), 7, dtype=torch.uint8)
    ops.gather_rows(dst, valid, pool, slots)
    assert valid.tolist() == [1, 0, 1, 1]
    assert torch.equal(dst[0], pool[5]) and dst[1].eq(0).all() and torch.equal(dst[2], pool[31])


def test_gather_windows_matches_metadata(swa):
    T, W = swa.T, swa.cfg.window
    dst = torch.empty(T, W, 512, dtype=torch.bfloat16)
    valid = torch.empty(T, W, dtype=torch.uint8)
    idx = swa.meta["window_indices"]
    ops.gather_windows(dst, valid, swa.caches["kv_cache"], idx)
    want_valid = (idx >= 0).to(torch.uint8)
    assert torch.equal(valid, want_valid)
    rows = swa.caches["kv_cache"][idx.clamp(min=0).long()]
    rows[idx < 0] = 0
    assert torch.equal(dst, rows)


def test_build_metadata_rejects_and_keeps_previous():
    cfg = td.Config("flash")
    pools = td.pools_for_batch(2)
    tables = td.fixture_tables(2, pools, cfg)
    md = td.StepMetadata(2, 2, cfg)
    md.build(torch.tensor([10, 20], dtype=torch.int32), 2, 1, tables, pools)
    before = {k: v.clone() for k, v in md.tensors().items()}
    with pytest.raises(RuntimeError, match="start"):
        md.build(torch.tensor([10, cfg.max_seq_len], dtype=torch.int32), 2, 1, tables, pools)
    bad = dict(tables)
    bad["block_table"] = tables["block_table"].clone()
    bad["block_table"][0, 0] = 10 ** 6
    with pytest.raises(RuntimeError, match="block_table"):
        md.build(torch.tensor([10, 20], dtype=torch.int32), 2, 1, bad, pools)
    for k, v in md.tensors().items():
        assert torch.equal(v, before[k]), k


def test_gather_logical_rows():
    # rows through one request's block-table row (spec §8.1 compressed rows): -1, an unmapped
    # page and a page past the table give a zero row, valid 0.
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(4 * 128, 512, generator=g).to(torch.bfloat16)
    table_row = torch.tensor([2, -1, 0], dtype=torch.int32)
    rows = torch.tensor([5, 130, 300, -1, 1000], dtype=torch.int32)
    dst = torch.full((5, 512), 1.0, dtype=torch.bfloat16)
    valid = torch.zeros(5, dtype=torch.uint8)
    ops.gather_logical_rows(dst, valid, pool, table_row, rows, 128)
    assert valid.tolist() == [1, 0, 1, 0, 0]
    assert torch.equal(dst[0], pool[2 * 128 + 5]) and torch.equal(dst[2], pool[0 * 128 + 44])
    assert dst[[1, 3, 4]].eq(0).all()
    before = dst.clone()
    with pytest.raises(RuntimeError, match=r"table_row\[0\]"):
        ops.gather_logical_rows(dst, valid, pool, torch.tensor([9, 0, 0], dtype=torch.int32),
                                rows, 128)
    assert torch.equal(dst, before)


def test_check_disjoint_rows():
    cfg = td.Config("flash")
    B = 2
    pools = td.pools_for_batch(B)
    md = td.StepMetadata(B, 2, cfg)
    md.build(torch.tensor([8319, 127], dtype=torch.int32), 2, 1, td.fixture_tables(B, pools, cfg),
             pools)
    # the fixture's CSA state pool (65 pages, coprime to B) aliases the two requests
    with pytest.raises(RuntimeError, match=r"csa_state_slot_mapping\[.*not injective"):
        md.check_disjoint_rows()
