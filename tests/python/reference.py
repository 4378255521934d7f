"""The spec's math restated in plain PyTorch (dsv4_flash_decode.md §3-§8), float64 wherever the C++
golden computes in double; BF16 / FP32 roundings only where the spec places them. Independent of
the library: nothing here calls tiledecode. Shapes: T = B * S token rows, t = b * S + s."""
import math

import torch

F64 = torch.float64
NEG_BIG = -3.4028234663852886e38  # FP32_NEG_INF
MASK_NEG = -1e20


def bf16(x):
    """Round to BF16 (RNE) and back to float64."""
    return x.to(torch.float32).to(torch.bfloat16).to(F64)


def f32(x):
    return x.to(torch.float32).to(F64)


def q8(x):
    """Per-row INT8 quantiser Q8 (spec §2), on the last dimension: codes (float64) and the
    dequant scale 1 / (127 / amax)."""
    amax = torch.clamp(x.abs().amax(-1, keepdim=True), min=1e-4)
    sq = 127.0 / amax
    return torch.round(x * sq).clamp(-127, 127), (1.0 / sq).squeeze(-1)


def rmsnorm_rows(x, w=None, eps=1e-6):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope_fwd(x, cos, sin, pos):
    """Interleaved forward rotation of the last 64 dims of x [..., n, 64] at positions pos [...]:
    pair i = dims (2i, 2i+1), table column i (BF16 values)."""
    c = cos[pos.long(), :32].to(F64)
    s = sin[pos.long(), :32].to(F64)
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    e, o = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = e * c - o * s
    out[..., 1::2] = e * s + o * c
    return out


def rope_inv(x, cos, sin, pos):
    c = cos[pos.long(), :32].to(F64)
    s = sin[pos.long(), :32].to(F64)
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    e, o = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = e * c + o * s
    out[..., 1::2] = o * c - e * s
    return out


# ---- §3 metadata ---------------------------------------------------------------------------------

def metadata(starts, S, commit, tables, cfg):
    """position_ids, kv_seq_lens and the base-layout slot mappings / window lists (§3.1-§3.6)."""
    B = starts.shape[0]
    pos = (starts[:, None].long() + torch.arange(S)[None, :]).reshape(-1)
    b_of = torch.arange(B).repeat_interleave(S)
    s_of = torch.arange(S).repeat(B)
    committed = S if commit < 0 else commit
    out = {"position_ids": pos.to(torch.int32),
           "kv_seq_lens": (starts.long() + committed).to(torch.int32)}

    def paged(table, page, p):
        blk, r = p // page, p % page
        ok = blk < table.shape[1]
        e = torch.where(ok, table[b_of, blk.clamp(max=table.shape[1] - 1)].long(),
                        torch.full_like(p, -1))
        return torch.where(e >= 0, e * page + r, torch.full_like(p, -1))

    def compressed(table, R):
        c = pos // R
        slot = paged(table, cfg.page, c)
        boundary = (pos + 1) % R == 0
        slot = torch.where(boundary, slot, torch.full_like(slot, -1))
        return torch.where(s_of < committed, slot, torch.full_like(slot, -1))

    out["ori_slot_mapping"] = paged(tables["block_table"], cfg.page, pos)
    out["hca_cmp_slot_mapping"] = compressed(tables["cmp_block_table"], 128)
    out["csa_cmp_slot_mapping"] = compressed(tables["cmp_block_table"], 4)
    out["csa_idx_slot_mapping"] = compressed(tables["idx_block_table"], 4)
    out["hca_state_slot_mapping"] = paged(tables["hca_state_table"], cfg.c128_state_page, pos)
    out["csa_state_slot_mapping"] = paged(tables["csa_state_table"], cfg.c4_state_page, pos)
    out["csa_inner_state_slot_mapping"] = paged(tables["csa_inner_state_table"],
                                                cfg.c4_state_page, pos)
    W = cfg.window
    w0 = torch.clamp(pos - W + 1, min=0)
    lens = pos - w0 + 1
    k = torch.arange(W)[None, :]
    p = w0[:, None] + k
    tb = tables["block_table"].long()
    blk = p // cfg.page
    ok = (k < lens[:, None]) & (blk < tb.shape[1])
    e = tb[b_of[:, None].expand_as(p), blk.clamp(max=tb.shape[1] - 1)]
    idx = torch.where(ok & (e >= 0), e * cfg.page + p % cfg.page, torch.full_like(p, -1))
    out["window_indices"] = idx.to(torch.int32)
    out["window_lens"] = lens.to(torch.int32)
    return out


# ---- §4 front end ----------------------------------------------------------------------------------

def hc_pre(x_hc, fn, scale, base, rms_eps=1e-6, eps=1e-6, iters=20):
    x = x_hc.to(F64)
    T = x.shape[0]
    flat = x.reshape(T, -1)
    r = 1.0 / torch.sqrt((flat * flat).mean(-1) + rms_eps)
    mix = (flat @ fn.to(F64).T) * r[:, None]
    sc, bs = scale.to(F64), base.to(F64)
    pre = torch.sigmoid(mix[:, :4] * sc[0] + bs[:4]) + eps
    post = 2.0 * torch.sigmoid(mix[:, 4:8] * sc[1] + bs[4:8])
    c = (mix[:, 8:] * sc[2] + bs[8:]).reshape(T, 4, 4)  # [t, i, o]
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdim=True) + eps)
        c = c / (c.sum(1, keepdim=True) + eps)
    x_mixed = (pre[:, :, None] * x).sum(1)
    return bf16(x_mixed), post, c


def rmsnorm(x, w, eps=1e-6):
    return bf16(rmsnorm_rows(x.to(F64), w.to(F64), eps))


def hc_post(attn_out, x_hc, post, comb):
    a = attn_out.to(F64)
    return a[:, None, :] * post.to(F64)[:, :, None] + torch.einsum(
        "tik,tio->tok", x_hc.to(F64), comb.to(F64))


def qkv_projection(x_n, w, cos, sin, pos, cfg):
    """q [T, H, 512], kv [T, 512] (BF16 values), qr codes, qr_scale (spec §4 step 3)."""
    x = x_n.to(F64)
    T = x.shape[0]
    cq = rmsnorm_rows(x @ w["wq_a"].to(F64), w["gamma_cq"].to(F64), cfg.rms_eps)
    qr, qr_scale = q8(cq)
    qf = (qr @ w["wq_b"].to(F64)) * qr_scale[:, None] * w["wq_b_scale"].to(F64)
    qf = rmsnorm_rows(qf.reshape(T, cfg.n_heads, cfg.head_dim), None, cfg.rms_eps)
    nope = cfg.head_dim - cfg.rope_dim
    q = torch.cat([qf[..., :nope], rope_fwd(qf[..., nope:], cos, sin, pos)], -1)
    kvf = rmsnorm_rows(x @ w["wkv"].to(F64), w["gamma_ckv"].to(F64), cfg.rms_eps)
    kv = torch.cat([kvf[..., :nope], rope_fwd(kvf[..., nope:].unsqueeze(1), cos, sin, pos)[:, 0]],
                   -1)
    return bf16(q), bf16(kv), qr, qr_scale


# ---- §6 compressors ---------------------------------------------------------------------------------

def compressor(state, x_n, wkv, wgate, ape, norm_w, pos, state_slots, cmp_slots, state_table,
               cos, sin, R, overlap, head_dim, B, S, state_page, eps=1e-6):
    """One compressor step (§6.1-§6.3). state [rows, 2*OUT] float64 is updated in place (rows
    stored as FP32 values); returns {slot: y} of the emitted rows (float64, before any cache
    rounding) and {b: y} (kv_out)."""
    x = x_n.to(F64)
    kv = x @ wkv.to(F64).T
    g = x @ wgate.to(F64).T + ape.to(F64)[pos.long() % R]
    out_dim = kv.shape[1]
    hd = head_dim
    emitted, kv_out = {}, {}
    table = state_table.long()

    def state_row(b, p):
        blk = p // state_page
        if p < 0 or blk >= table.shape[1] or table[b, blk] < 0:
            return None
        return int(table[b, blk]) * state_page + p % state_page

    for b in range(B):
        for s in range(S):
            t = b * S + s
            if state_slots[t] >= 0:
                state[int(state_slots[t])] = f32(torch.cat([kv[t], g[t]]))
        for s in range(S):
            t = b * S + s
            if cmp_slots[t] < 0:
                continue
            c = int(pos[t]) // R
            cand_kv, cand_sc = [], []
            if overlap:
                for p in range(4 * c - 4, 4 * c) if c > 0 else ():  # previous window: fronts
                    r = state_row(b, p)
                    if r is None:
                        cand_kv.append(torch.zeros(hd, dtype=F64))
                        cand_sc.append(torch.full((hd,), NEG_BIG, dtype=F64))
                    else:
                        cand_kv.append(state[r, :hd])
                        cand_sc.append(state[r, out_dim:out_dim + hd])
                halves = (hd, out_dim + hd)
            else:
                halves = (0, out_dim)
            for p in range(R * c, R * c + R):
                r = state_row(b, p)
                if r is None:
                    cand_kv.append(torch.zeros(hd, dtype=F64))
                    cand_sc.append(torch.full((hd,), NEG_BIG, dtype=F64))
                else:
                    cand_kv.append(state[r, halves[0]:halves[0] + hd])
                    cand_sc.append(state[r, halves[1]:halves[1] + hd])
            K, G = torch.stack(cand_kv), torch.stack(cand_sc)
            pooled = (torch.softmax(G, dim=0) * K).sum(0)
            y = rmsnorm_rows(pooled, norm_w.to(F64), eps)
            y = torch.cat([y[:hd - 64], rope_fwd(y[hd - 64:].unsqueeze(0), cos, sin,
                                                 torch.tensor([c * R]))[0]])
            emitted[int(cmp_slots[t])] = y
            kv_out[b] = y
    return emitted, kv_out


def inner_emit(y, hadamard):
    """The indexer compressor's store (§6.4): Q8(bf16(bf16(y) @ H)) → codes, scale."""
    z = bf16(bf16(y) @ hadamard.to(F64))
    return q8(z)


# ---- §7 indexer -------------------------------------------------------------------------------------

def indexer_query(qr, qr_scale, wq_b, wq_b_scale, hadamard, rope_pos, cos, sin, cfg):
    T = qr.shape[0]
    qi = (qr.to(F64) @ wq_b.to(F64)) * qr_scale.to(F64)[:, None] * wq_b_scale.to(F64)
    qi = qi.reshape(T, cfg.idx_n_heads, cfg.idx_head_dim)
    half = cfg.idx_head_dim - 64
    qi = torch.cat([qi[..., :half], bf16(rope_fwd(qi[..., half:], cos, sin, rope_pos))], -1)
    qh = bf16(qi) @ hadamard.to(F64)
    return q8(qh)


def indexer_weights(x_n, weights_proj, cfg):
    scale = 1.0 / math.sqrt(float(cfg.idx_head_dim) * float(cfg.idx_n_heads))
    return (x_n.to(F64) @ weights_proj.to(F64)) * scale


def visible(pos, kv_lens, S, R, cap):
    b_of = torch.arange(pos.shape[0]) // S
    return torch.minimum(torch.minimum(kv_lens.long()[b_of] // R, (pos.long() + 1) // R),
                         torch.full_like(pos.long(), cap))


def indexer_score(q_i8, q_sc, w, idx_kv, idx_scale, table, pos, kv_lens, S, cfg):
    T = q_i8.shape[0]
    N = cfg.score_len
    vis = visible(pos, kv_lens, S, 4, N)
    j = torch.arange(N)
    score = torch.full((T, N), NEG_BIG, dtype=F64)
    tb = table.long()
    for t in range(T):
        b = t // S
        n = int(vis[t])
        if n == 0:
            continue
        jj = j[:n]
        rows = tb[b, jj // cfg.page] * cfg.page + jj % cfg.page
        k = idx_kv[rows].to(F64)  # [n, 128]
        dots = q_i8[t].to(F64) @ k.T  # [heads, n] exact integers
        s = (w[t].to(F64)[:, None] * torch.relu(q_sc[t].to(F64)[:, None] * dots)).sum(0)
        score[t, :n] = idx_scale[rows].to(F64) * s
    return score, vis


def topk(score, vis, k, offset, width):
    """Deterministic top-k (§7.3): descending score, ascending index on ties, NaN never, -1 pad."""
    T = score.shape[0]
    out = torch.full((T, width), -1, dtype=torch.int32)
    for t in range(T):
        n = int(vis[t])
        if n == 0:
            continue
        row = score[t, :n].clone()
        nan = torch.isnan(row)
        row[nan] = -math.inf
        order = torch.sort(row, descending=True, stable=True).indices
        picked = order[:min(k, n)]
        picked = picked[~nan[picked]]
        out[t, :picked.shape[0]] = (picked + offset).to(torch.int32)
    return out


# ---- §8 attention and output projection ---------------------------------------------------------

def sparse_attention(q, kv_cache, cmp_kv, win_idx, win_lens, topk_idxs, cmp_table, pos, kv_lens,
                     S, sink, cos, sin, kind, cfg):
    """o_packed [O_GROUPS*T, O_GROUP_IN] (BF16 values), spec §8.1-§8.4."""
    T, H, HD = q.shape
    Wn = cfg.window
    rows = []  # per token: [cols] kv row index into the concatenated pool, -1 invalid
    pools = [kv_cache.to(F64), cmp_kv.to(F64) if cmp_kv is not None else None]
    for t in range(T):
        b = t // S
        p = int(pos[t])
        w = win_idx[t].long().clone()
        if kind == 0:
            w[torch.arange(Wn) >= int(win_lens[t])] = -1
        cols = [(0, int(i)) for i in w]
        if kind == 4:
            nvis = (p + 1) // 4
            for i in range(cfg.idx_topk):
                raw = int(topk_idxs[t, i])
                ok = 0 <= raw < nvis and raw // cfg.page < cmp_table.shape[1]
                blk = int(cmp_table[b, raw // cfg.page]) if ok else -1
                cols.append((1, blk * cfg.page + raw % cfg.page) if blk >= 0 else (1, -1))
        elif kind == 128:
            cap = cfg.max_seq_len // 128
            n = min(cap, (p + 1) // 128, int(kv_lens[b]) // 128)
            for raw in range(cap):
                blk = int(cmp_table[b, raw // cfg.page]) if raw < n else -1
                cols.append((1, blk * cfg.page + raw % cfg.page) if blk >= 0 else (1, -1))
        rows.append(cols)
    ncol = len(rows[0])
    nb = (ncol + 127) // 128
    out = torch.zeros(T, H, HD, dtype=F64)
    qd = q.to(F64)
    scale = 1.0 / math.sqrt(HD)
    for t in range(T):
        K = torch.zeros(nb * 128, HD, dtype=F64)
        valid = torch.zeros(nb * 128, dtype=torch.bool)
        for j, (pool, r) in enumerate(rows[t]):
            if r >= 0:
                K[j] = pools[pool][r]
                valid[j] = True
        s = scale * (qd[t] @ K.T)  # [H, cols]
        s = torch.where(valid[None, :], s, torch.full_like(s, MASK_NEG))
        s = s.reshape(H, nb, 128)
        m = s.amax(-1)  # [H, nb]
        e = torch.exp(s - m[..., None]) * valid.reshape(nb, 128)[None].to(F64)
        lsum = e.sum(-1)
        o = torch.einsum("hbj,bjd->hbd", bf16(e), K.reshape(nb, 128, HD))
        M = m.amax(-1)  # [H]
        a = torch.exp(m - M[:, None])
        L = (a * lsum).sum(-1)
        O = (a[..., None] * o).sum(1)
        den = L + torch.exp(sink.to(F64) - M)
        out[t] = O / den[:, None]
    nope = HD - 64
    o = torch.cat([bf16(out[..., :nope]), bf16(rope_inv(out[..., nope:], cos, sin, pos))], -1)
    G = cfg.o_groups
    hpg = H // G
    packed = o.reshape(T, G, hpg * HD).permute(1, 0, 2).reshape(G * T, hpg * HD)
    return packed


def output_projection(o_packed, wo_a, wo_b, wo_b_scale, cfg):
    G, OL = cfg.o_groups, cfg.o_lora
    T = o_packed.shape[0] // G
    op = o_packed.to(F64).reshape(G, T, -1)
    o_r = torch.einsum("gtk,grk->tgr", op, wo_a.to(F64))  # [T, G, OL]
    a_i8, a_dq = q8(o_r)
    wb = wo_b.to(F64).reshape(wo_b.shape[0], G, OL)  # [D, G, OL]
    P = torch.einsum("tgr,ngr->tgn", a_i8, wb)  # exact integers
    y = (a_dq[:, :, None] * P).sum(1) * wo_b_scale.to(F64)[None, :]
    return bf16(y)


# ---- the spec's comparators (§10.1; tests/common/compare.hpp) --------------------------------------

def ratio_allclose(actual, expected, atol, rtol, max_error_ratio=0.005):
    """A point fails if |a - e| > atol + rtol |e|; passes iff the failing fraction is at most
    max_error_ratio and nothing in `actual` is NaN / Inf. Returns (ok, message)."""
    a = actual.to(F64).reshape(-1)
    e = expected.to(F64).reshape(-1)
    if a.shape != e.shape:
        return False, f"size {a.shape} vs {e.shape}"
    if not torch.isfinite(a).all():
        return False, "non-finite actual"
    bad = (a - e).abs() > atol + rtol * e.abs()
    ratio = bad.double().mean().item() if a.numel() else 0.0
    if ratio <= max_error_ratio:
        return True, ""
    i = int(((a - e).abs() * bad).argmax())
    return False, (f"{int(bad.sum())}/{a.numel()} fail (ratio {ratio:.4g} > {max_error_ratio}); "
                   f"worst at {i}: a={a[i].item()}, e={e[i].item()}")


def ratio_reldiff(actual, expected, diff_thd, pct_thd, max_diff_hd=math.inf):
    a = actual.to(F64).reshape(-1)
    e = expected.to(F64).reshape(-1)
    if not torch.isfinite(a).all():
        return False, "non-finite actual"
    d = (a - e).abs()
    den = torch.maximum(torch.maximum(a.abs(), e.abs()),
                        torch.full_like(a, 2.0 ** -14 / diff_thd)) + 1e-9
    rd = torch.where(d < diff_thd, d, d / den)
    bad = rd > diff_thd
    pct = bad.double().mean().item() if a.numel() else 0.0
    worst = rd.max().item() if a.numel() else 0.0
    if pct <= pct_thd and worst < max_diff_hd:
        return True, ""
    return False, f"{int(bad.sum())}/{a.numel()} over {diff_thd} ({pct * 100:.3f}%), worst {worst}"


def topk_pair_compare(actual, expected, score_row):
    """Tie-tolerant top-k comparison of one row: a swap among equal scores passes."""
    for i in range(actual.shape[0]):
        a, e = int(actual[i]), int(expected[i])
        if a == e:
            continue
        if (a < 0) != (e < 0):
            return False, f"position {i}: padding differs ({a} vs {e})"
        if float(score_row[a]) != float(score_row[e]):
            return False, f"position {i}: picked {a} ({float(score_row[a])}) not {e}"
    return True, ""
