#!/usr/bin/env python3
"""decode_step.py: the C++ decode-step example (examples/10_decode_step.cpp) from Python.

Builds the first N layers of the flash (or pro) schedule with synthetic weights (torch draws with
the spec's statistics, tiledecode.synthetic), fills every layer's paged pools with a history of
--context tokens for --batch requests, and runs --steps MTP decode steps (S = --seq tokens per
request, commit_tokens = 1) through torch.ops.tiledecode: the metadata is built once per step from
the engine's block tables and shared by every layer, each layer's x_out feeds the next layer's
x_hc. Prints the per-kernel time table, then how an engine's block tables and slot mappings map
onto the ops.

    PYTHONPATH=build-py/python python3 examples/python/decode_step.py [--layers 4] [--preset flash]
        [--context 8192] [--batch 4] [--steps 16] [--seq 2] [--threads N] [--narrow]
(./scripts/python_demo.sh builds the binding and runs this.)
"""
import argparse
import resource
import sys
import time

import torch

import tiledecode as td
from tiledecode import synthetic as syn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--preset", default="flash", choices=["flash", "pro"])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0,
                    help="tiledecode threads (0: follow torch.get_num_threads())")
    ap.add_argument("--narrow", action="store_true",
                    help="the narrow widths of the C++ layer tests (fast; same paging)")
    ap.add_argument("--seed", type=int, default=20240601)
    o = ap.parse_args()

    cfg = td.Config(o.preset)
    need = o.context + o.steps - 1 + o.seq
    max_seq = cfg.max_seq_len
    while max_seq < need and max_seq < (1 << 20):
        max_seq *= 2
    cfg = td.Config(cfg, max_seq_len=max_seq) if max_seq != cfg.max_seq_len else cfg
    if o.narrow:
        cfg = cfg.narrow()
    if o.threads:
        td.set_num_threads(o.threads)
    B, S, L = o.batch, o.seq, o.layers
    T = B * S
    print(f"DeepSeek-V4-{cfg.preset} attention decode from PyTorch ({cfg}): {L} layers, batch {B} "
          f"x S={S} (MTP, commit 1), context {o.context}, {o.steps} steps, "
          f"{td.get_num_threads()} threads, isa {td.get_isa()}, torch {torch.__version__}")

    # ---- the stack: weights, pools, tables (what an engine owns; tiledecode only views them)
    t0 = time.perf_counter()
    pools = td.pools_for_batch(B)  # pages per pool: [ori, cmp, idx, hca_state, csa_state, inner]
    tables = td.fixture_tables(B, pools, cfg)  # the engine's block tables (spec §3.2 fixture)
    layers = []
    wbytes = cbytes = 0
    for li in range(L):
        kind = cfg.layer_kind(li)
        w = syn.weights(kind, cfg, layer=li, seed=o.seed)
        caches = syn.caches(kind, pools, cfg, layer=li, seed=o.seed)
        wbytes += sum(t.numel() * t.element_size() for t in w.values())
        cbytes += sum(t.numel() * t.element_size() for t in caches.values())
        layers.append(dict(kind=kind, W=td.Weights(kind, w, cfg), caches=caches))
        print(f"\r  building layer {li + 1}/{L}", end="", file=sys.stderr, flush=True)
    print("\r" + " " * 30 + "\r", end="", file=sys.stderr)
    rope = {k: td.rope_table(k, config=cfg) for k in (td.SWA, td.CSA)}  # CSA/HCA share a profile
    md = td.StepMetadata(B, S, cfg)
    ws = td.Workspace(B, S, cfg)
    xa = torch.empty(T, 4, cfg.hidden)
    xb = torch.empty_like(xa)
    print(f"setup: weights {wbytes / 2**20:.0f} MiB, pools {cbytes / 2**20:.0f} MiB, workspace "
          f"{ws.bytes() / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s")

    # ---- decode steps
    starts = torch.full((B,), o.context, dtype=torch.int32)
    times = torch.zeros(2, len(td.KERNELS), dtype=torch.float64)
    md_s = step_s = 0.0
    first_meta = None
    for step in range(o.steps):
        xa.copy_(syn.x_hc(T, cfg, step=step, seed=o.seed))
        st = torch.zeros_like(times)
        t0 = time.perf_counter()
        md.build(starts, S, 1, tables, pools)  # once per step, shared by every layer
        t_md = time.perf_counter() - t0
        x, y = xa, xb
        for layer in layers:
            td.layer_step(y, x, layer["W"], layer["caches"], md,
                          rope[td.SWA if layer["kind"] == td.SWA else td.CSA], ws, times=st)
            x, y = y, x
        dt = time.perf_counter() - t0
        meta = md.tensors()
        if first_meta is None or (first_meta["csa_cmp_slot_mapping"].max() < 0 <=
                                  meta["csa_cmp_slot_mapping"].max()):
            first_meta = {k: v.clone() for k, v in meta.items()}  # a step with a boundary, if any
            first_meta["step"] = step
        if step > 0 or o.steps == 1:
            times += st
            md_s += t_md
            step_s += dt
        if o.steps <= 32:
            print(f"  step {step + 1}/{o.steps}  start {int(starts[0])}  {dt * 1e3:.1f} ms",
                  file=sys.stderr)
        starts += 1  # commit_tokens = 1: one token per request committed per step

    timed = max(1, o.steps - 1)
    print(f"\nper-kernel time per decode step ({L} layers, mean of {timed} steps after the first):")
    print(f"  {'kernel':<20} {'ms/step':>10} {'share':>8} {'calls':>8}")
    total = times[0].sum().item()
    for i, name in enumerate(td.KERNELS):
        if times[1, i] == 0:
            continue
        print(f"  {name:<20} {times[0, i].item() * 1e3 / timed:10.3f} "
              f"{100 * times[0, i].item() / total:7.1f}% {int(times[1, i].item()) // timed:8d}")
    print(f"  {'metadata build':<20} {md_s * 1e3 / timed:10.3f}")
    print(f"  {'step':<20} {step_s * 1e3 / timed:10.3f}   (wall, all layers, Python loop)")
    per_step = step_s / timed
    print(f"throughput: {B / per_step:.1f} committed tokens/s ({B} per step), "
          f"{T / per_step:.1f} token rows/s ({T} per step incl. drafts)")
    print(f"peak memory (ru_maxrss): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} "
          f"MiB")

    # ---- how an engine's paging maps onto the ops (a step that closes a ratio-4 window)
    m = first_meta
    hits = (m["csa_cmp_slot_mapping"] >= 0).nonzero().flatten().tolist()
    t = hits[0] if hits else 0
    b, s = t // S, t % S
    pos = int(m["position_ids"][t])
    blk = pos // cfg.page
    page_id = int(tables["block_table"][b, blk])
    print(f"\nengine paging -> ops (request {b}, token s={s} of step {m['step'] + 1}):")
    print(f"  position {pos}: block_table[0, {pos} // {cfg.page} = {blk}] = page {page_id}; "
          f"ori_slot_mapping[{t}] = {page_id} * {cfg.page} + {pos % cfg.page} = "
          f"{int(m['ori_slot_mapping'][t])}  (the kv_cache row write_cache / layer_step writes; "
          f"-1 = skip)")
    win = m["window_indices"][t]
    print(f"  window_indices[{t}] = kv_cache rows of positions {pos - int(m['window_lens'][t]) + 1}"
          f"..{pos}: [{int(win[0])}, {int(win[1])}, ..., {int(win[-1])}] "
          f"(window_lens {int(m['window_lens'][t])}; gather_windows / sparse_attention read them)")
    r0, r1 = b * S, b * S + S
    for name, R in (("csa_cmp_slot_mapping", 4), ("hca_cmp_slot_mapping", 128)):
        sl = m[name][r0:r1].tolist()
        print(f"  {name}[{r0}:{r1}] = {sl} (positions {pos - s}..{pos - s + S - 1}): a "
              f"compressed row only where (pos + 1) % {R} == 0 and the token is committed, else -1")
    if hits:
        c = pos // 4
        print(f"    compressed row {c} of request {b}: cmp_block_table[{b}, {c} // {cfg.page}] = "
              f"{int(tables['cmp_block_table'][b, c // cfg.page])} -> cmp_kv row "
              f"{int(m['csa_cmp_slot_mapping'][t])} (the compressor op / layer_step writes it)")
    print(f"  csa_state_slot_mapping[{r0}:{r1}] = {m['csa_state_slot_mapping'][r0:r1].tolist()} "
          f"(csa_state_table[{b}, pos // {cfg.c4_state_page}] * {cfg.c4_state_page} + pos % "
          f"{cfg.c4_state_page}: every token)")
    print("  an engine passes its own block tables to StepMetadata.build (or its own slot mappings "
          "to the single-kernel ops); every pool is its own tensor, viewed in place "
          "([blocks, page, 1, W] or [blocks * page, W]).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
