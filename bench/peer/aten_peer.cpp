// The ATen peer (see aten_peer.hpp). The only translation unit of peer_compare that includes
// Torch headers (they are slow to compile: keep everything ATen-side here).
//
// What the peer does, per kernel (FP32 compute throughout; BF16/INT8 storage as in the spec):
//   indexer      gather the visible INT8 key rows of every request with index_select, convert
//                to FP32, bmm with the FP32 view of the INT8 queries, scale by the query
//                scale, relu_, weighted head-sum as a second bmm, key scale, NEG_BIG tail,
//                at::topk.
//   attention    index_select the window rows (and the compressed rows through the block
//                table), convert to FP32, bmm Q·Kᵀ, additive mask, one softmax over all
//                columns with the sink appended as an extra logit (= sink in the denominator
//                only), bmm P·V, inverse RoPE on the last 64 dims, BF16 packed store.
//   o-proj       per-group bmm with wo_a, per (token, group) Q8 in tensor ops, bmm with wo_b
//                holding integer values in FP32 (exact: |sum| < 2^24), per-group dequant,
//                sum over groups, channel scale, BF16.
//   compressors  two matmuls (x·Wkvᵀ, x·Wgateᵀ) + ape, index_copy_ of the state rows,
//                index_select of the window's state rows, softmax over the window per
//                channel, weighted sum, RMSNorm, RoPE, index_copy_ into the cache (inner:
//                Hadamard matmul and Q8 first).
// Weights: `fp32_copy` converts BF16/INT8 weights to FP32 once at load; `dequant` converts
// them inside every step.

#include "peer/aten_peer.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>
#include <dlfcn.h>

#include <climits>
#include <cstdlib>
#include <string>

namespace tdpeer {
namespace {

using AT = at::Tensor;

template <class T>
constexpr at::ScalarType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return at::kFloat;
  if constexpr (std::is_same_v<T, bf16>) return at::kBFloat16;
  if constexpr (std::is_same_v<T, std::int8_t>) return at::kChar;
  if constexpr (std::is_same_v<T, std::int32_t>) return at::kInt;
  if constexpr (std::is_same_v<T, std::int64_t>) return at::kLong;
}

// Wraps a tiledecode tensor without copying (the case outlives the peer kernel).
template <class T, std::size_t R>
AT wrap(const tiledecode::Tensor<T, R>& t) {
  std::vector<int64_t> sizes(t.shape().begin(), t.shape().end());
  return at::from_blob(const_cast<T*>(t.data()), sizes, at::TensorOptions().dtype(dtype_of<T>()));
}

std::vector<float> to_vec(const AT& t) {
  const AT f = t.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

constexpr double kNegBig = -3.4028234663852886e38;

// Interleaved inverse (sign -1) or forward (sign +1) RoPE of x [..., 64] with cos/sin [N, 32]
// broadcast over the middle dims (FP32).
AT rope64(const AT& x, const AT& c, const AT& s, bool forward) {
  auto sh = x.sizes().vec();
  sh.back() = 32;
  sh.push_back(2);
  const AT r = x.reshape(sh);
  const AT e = r.select(-1, 0), o = r.select(-1, 1);
  AT re, ro;
  if (forward) {
    re = e * c - o * s;
    ro = e * s + o * c;
  } else {
    re = e * c + o * s;
    ro = o * c - e * s;
  }
  return at::stack({re, ro}, -1).reshape(x.sizes());
}

}  // namespace

void peer_set_threads(int aten_threads, int blas_threads) {
  static int cur_aten = -1, cur_blas = -1;
  if (aten_threads != cur_aten) at::set_num_threads(aten_threads);
  cur_aten = aten_threads;
  if (blas_threads == cur_blas) return;
  cur_blas = blas_threads;
  // ATen does not forward its thread count to OpenBLAS's own pthread pool.
  using SetFn = void (*)(int);
  if (auto f = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(blas_threads);
}

std::string peer_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

std::string peer_blas_info() {
  std::string s;
  using StrFn = char* (*)();
  auto cfg = reinterpret_cast<StrFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  auto core = reinterpret_cast<StrFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  s += cfg ? std::string(cfg()) : std::string("not OpenBLAS (no openblas_get_config)");
  if (core) s += "; core " + std::string(core());
  // Which library ATen's sgemm_ calls actually land in (Debian selects libblas.so.3 through
  // update-alternatives).
  if (void* sym = dlsym(RTLD_DEFAULT, "sgemm_")) {
    Dl_info info{};
    if (dladdr(sym, &info) && info.dli_fname) {
      s += "; sgemm_ from " + std::string(info.dli_fname);
      if (char* real = realpath(info.dli_fname, nullptr)) {
        s += " -> " + std::string(real);
        std::free(real);
      }
    }
  }
  return s;
}

PeerKernel make_peer_indexer(const Weights& w, Case& cs) {
  const auto& cfg = w.cfg;
  const int64_t T = cs.tokens(), B = cs.batch, S = cs.seq, IH = cfg.idx_n_heads;
  const int64_t ID = cfg.idx_head_dim, L = cfg.score_len(), K = cfg.idx_topk;
  const AT q_i8 = wrap(cs.q_i8), q_sc = wrap(cs.q_sc), wts = wrap(cs.w);
  const AT idx_kv = wrap(cs.idx_kv), idx_sc = wrap(cs.idx_sc);
  const AT table = wrap(cs.idx_table).to(at::kLong);
  const AT pos = wrap(cs.positions).to(at::kLong), lens = wrap(cs.kv_seq_lens).to(at::kLong);
  const AT b_of_t = at::arange(T, at::kLong).div(S, "floor");
  auto score = std::make_shared<AT>(at::empty({T, L}, at::kFloat));
  auto topk = std::make_shared<AT>(at::empty({T, K}, at::kInt));
  PeerKernel k;
  k.run = [=] {
    const AT vis = at::minimum(at::minimum(lens.index_select(0, b_of_t).div(4, "floor"),
                                               (pos + 1).div(4, "floor")),
                                   at::full({T}, L, at::kLong));
    const int64_t vmax = vis.max().item<int64_t>();
    score->fill_(kNegBig);
    topk->fill_(-1);
    if (vmax == 0) return;
    const AT j = at::arange(vmax, at::kLong);
    const AT rows = table.index_select(1, j.div(128, "floor")) * 128 + j.remainder(128);
    const AT keys = idx_kv.index_select(0, rows.reshape(-1)).view({B, vmax, ID}).to(at::kFloat);
    const AT q = q_i8.view({B, S * IH, ID}).to(at::kFloat);
    AT dots = at::bmm(q, keys.transpose(1, 2));  // (B, S*64, vmax)
    dots.mul_(q_sc.view({B, S * IH, 1})).relu_();
    AT sc = at::bmm(wts.view({B * S, 1, IH}), dots.view({B * S, IH, vmax})).view({B, S, vmax});
    sc.mul_(idx_sc.index_select(0, rows.reshape(-1)).view({B, 1, vmax}));
    sc = sc.view({T, vmax});
    sc.masked_fill_(j.unsqueeze(0) >= vis.unsqueeze(1), kNegBig);
    score->narrow(1, 0, vmax).copy_(sc);
    const int64_t kk = std::min(K, vmax);
    auto [vals, idx] = at::topk(sc, kk, 1, true, true);
    idx.masked_fill_(idx >= vis.unsqueeze(1), -1);
    topk->narrow(1, 0, kk).copy_(idx);
  };
  k.output = [score] { return to_vec(*score); };
  return k;
}

PeerKernel make_peer_attention(const Weights& w, Case& cs, int ratio) {
  const auto& cfg = w.cfg;
  const int64_t T = cs.tokens(), S = cs.seq, H = cfg.n_heads, HD = cfg.head_dim;
  const int64_t G = cfg.o_groups, WIN = cfg.window, NOPE = cfg.nope_dim();
  const AT q = wrap(cs.q), ori = wrap(cs.ori_kv), cmp = wrap(cs.cmp_kv);
  const AT win = wrap(cs.win_idx).to(at::kLong), topk = wrap(cs.topk).to(at::kLong);
  const AT cmp_table = wrap(cs.cmp_table).to(at::kLong);
  const AT pos = wrap(cs.positions).to(at::kLong), lens = wrap(cs.kv_seq_lens).to(at::kLong);
  const AT sink = wrap(w.sink);
  const auto& rope = ratio == 0 ? w.rope_swa : w.rope_csa;
  const AT cos_t = wrap(rope.cos).narrow(1, 0, 32).to(at::kFloat);
  const AT sin_t = wrap(rope.sin).narrow(1, 0, 32).to(at::kFloat);
  const AT b_of_t = at::arange(T, at::kLong).div(S, "floor");
  const double scale = cfg.softmax_scale();
  const int64_t hca_cap = cfg.hca_capacity(), table_rows = cmp_table.size(1) * cfg.page;
  auto out = std::make_shared<AT>(at::empty({G * T, cfg.o_group_in()}, at::kBFloat16));
  PeerKernel k;
  k.run = [=] {
    const AT wvalid = win >= 0;
    AT kv = ori.index_select(0, win.clamp_min(0).view(-1)).view({T, WIN, HD});
    AT valid = wvalid;
    if (ratio != 0) {
      AT raw, cvalid;
      if (ratio == 4) {
        raw = topk;
        cvalid = (raw >= 0) & (raw < (pos + 1).div(4, "floor").unsqueeze(1)) & (raw < table_rows);
      } else {
        raw = at::arange(hca_cap, at::kLong).unsqueeze(0).expand({T, hca_cap});
        const AT n = at::minimum(at::minimum((pos + 1).div(128, "floor"),
                                                 lens.index_select(0, b_of_t).div(128, "floor")),
                                     at::full({T}, hca_cap, at::kLong));
        cvalid = raw < n.unsqueeze(1);
      }
      const AT rc = at::where(cvalid, raw, at::zeros({}, at::kLong));
      const AT slot =
          cmp_table.index_select(0, b_of_t).gather(1, rc.div(128, "floor")) * 128 + rc.remainder(128);
      const AT kc = cmp.index_select(0, slot.view(-1)).view({T, raw.size(1), HD});
      kv = at::cat({kv, kc}, 1);
      valid = at::cat({wvalid, cvalid}, 1);
    }
    const int64_t C = kv.size(1);
    const AT kf = kv.to(at::kFloat);                     // (T, C, 512)
    AT s = at::bmm(q.to(at::kFloat), kf.transpose(1, 2));  // (T, H, C)
    s.mul_(scale).masked_fill_(valid.logical_not().unsqueeze(1), -1e20);
    // The sink is one more logit that takes softmax mass but has no value row.
    s = at::cat({s, sink.view({1, H, 1}).expand({T, H, 1})}, 2);
    const AT p = at::softmax(s, 2).narrow(2, 0, C);
    AT o = at::bmm(p, kf);  // (T, H, 512)
    const AT c = cos_t.index_select(0, pos).unsqueeze(1), sn = sin_t.index_select(0, pos).unsqueeze(1);
    const AT r = rope64(o.narrow(2, NOPE, HD - NOPE), c, sn, false);
    o = at::cat({o.narrow(2, 0, NOPE), r}, 2).to(at::kBFloat16);
    out->view({G, T, H / G * HD}).copy_(o.view({T, G, H / G * HD}).transpose(0, 1));
  };
  k.output = [out] { return to_vec(*out); };
  return k;
}

PeerKernel make_peer_oproj(const Weights& w, Case& cs, WeightMode mode) {
  const auto& cfg = w.cfg;
  const int64_t T = cs.tokens(), G = cfg.o_groups, OL = cfg.o_lora, D = cfg.hidden;
  const AT x = wrap(cs.o_packed).view({G, T, cfg.o_group_in()});
  const AT wa_raw = wrap(w.wo_a), wb_raw = wrap(w.wo_b), wb_scale = wrap(w.wo_b_scale);
  // (G, O_LORA, D) view of wo_b [D, G*O_LORA]: group g's K-slice, transposed for bmm.
  AT wa_f, wb_f;
  if (mode == WeightMode::fp32_copy) {
    wa_f = wa_raw.to(at::kFloat);
    wb_f = wb_raw.to(at::kFloat).view({D, G, OL}).permute({1, 2, 0}).contiguous();
  }
  auto out = std::make_shared<AT>(at::empty({T, D}, at::kBFloat16));
  PeerKernel k;
  k.run = [=] {
    const AT wa = mode == WeightMode::fp32_copy ? wa_f : wa_raw.to(at::kFloat);
    const AT wb =
        mode == WeightMode::fp32_copy ? wb_f : wb_raw.to(at::kFloat).view({D, G, OL}).permute({1, 2, 0});
    const AT r = at::bmm(x.to(at::kFloat), wa.transpose(1, 2));  // (G, T, O_LORA)
    const AT amax = r.abs().amax(2, true).clamp_min(1e-4);
    const AT sq = 127.0 / amax;
    const AT aq = (r * sq).round().clamp(-127, 127);  // integer values in FP32
    const AT p = at::bmm(aq, wb);                       // (G, T, D), exact integers
    out->copy_(((p * sq.reciprocal()).sum(0) * wb_scale).to(at::kBFloat16));
  };
  k.output = [out] { return to_vec(*out); };
  return k;
}

PeerKernel make_peer_compressor(const Weights& w, Case& cs, int which, WeightMode mode) {
  const auto& cfg = w.cfg;
  const CompressorWeights& cw = which == 4 ? w.c4 : (which == 128 ? w.c128 : w.inner);
  StatePool& sp = which == 4 ? cs.s4 : (which == 128 ? cs.s128 : cs.sinner);
  const int64_t S = cs.seq, R = cw.ratio, HD = cw.head_dim, OUT = cw.out_dim;
  const int64_t SB = sp.page;
  const bool overlap = R == 4;
  const int64_t L = overlap ? 2 * R : R;  // window rows read per boundary
  const AT x_n = wrap(cs.x_n), ape = wrap(cw.ape), norm_w = wrap(cw.norm_w).to(at::kFloat);
  const AT wkv_raw = wrap(cw.wkv), wg_raw = wrap(cw.wgate);
  AT wkv_f, wg_f;
  if (mode == WeightMode::fp32_copy) {
    wkv_f = wkv_raw.to(at::kFloat);
    wg_f = wg_raw.to(at::kFloat);
  }
  AT states = wrap(sp.rows);
  const AT st_table = wrap(sp.table).to(at::kLong), st_slots = wrap(sp.slots);
  const AT cmp_slots = wrap(which == 4 ? cs.c4_cmp_slots : (which == 128 ? cs.c128_cmp_slots : cs.idx_slots));
  const AT pos = wrap(cs.positions).to(at::kLong);
  const AT cos_t = wrap(w.rope_csa.cos).narrow(1, 0, 32).to(at::kFloat);
  const AT sin_t = wrap(w.rope_csa.sin).narrow(1, 0, 32).to(at::kFloat);
  const AT had = wrap(w.hadamard).to(at::kFloat);
  AT cmp = wrap(cs.cmp_kv), idx_kv = wrap(cs.idx_kv), idx_sc = wrap(cs.idx_sc);
  const double eps = cfg.rms_eps;
  PeerKernel k;
  k.run = [=]() mutable {
    const AT x = x_n.to(at::kFloat);
    const AT wkv = mode == WeightMode::fp32_copy ? wkv_f : wkv_raw.to(at::kFloat);
    const AT wg = mode == WeightMode::fp32_copy ? wg_f : wg_raw.to(at::kFloat);
    const AT kv = at::mm(x, wkv.t());
    const AT g = at::mm(x, wg.t()) + ape.index_select(0, pos.remainder(R));
    const AT rows = at::cat({kv, g}, 1);  // (T, 2*OUT)
    const AT wsel = at::nonzero(st_slots >= 0).squeeze(1);
    states.index_copy_(0, st_slots.index_select(0, wsel), rows.index_select(0, wsel));
    const AT bsel = at::nonzero(cmp_slots >= 0).squeeze(1);
    const int64_t nb = bsel.size(0);
    if (nb == 0) return;
    const AT bt = bsel.div(S, "floor");
    const AT c = pos.index_select(0, bsel).div(R, "floor");
    const AT p = (c * R - (overlap ? R : 0)).unsqueeze(1) + at::arange(L, at::kLong);
    const AT pvalid = p >= 0;
    const AT pc = p.clamp_min(0);
    const AT blk = st_table.index_select(0, bt).gather(1, pc.div(SB, "floor"));
    const AT win = states.index_select(0, (blk * SB + pc.remainder(SB)).view(-1)).view({nb, L, 2 * OUT});
    AT ckv, cg;
    if (overlap) {  // previous window's front halves, current window's back halves
      ckv = at::cat({win.narrow(1, 0, R).narrow(2, 0, HD), win.narrow(1, R, R).narrow(2, HD, HD)}, 1);
      cg = at::cat({win.narrow(1, 0, R).narrow(2, OUT, HD), win.narrow(1, R, R).narrow(2, OUT + HD, HD)}, 1);
    } else {
      ckv = win.narrow(2, 0, HD);
      cg = win.narrow(2, OUT, HD).clone();
    }
    cg.masked_fill_(pvalid.logical_not().unsqueeze(2), -INFINITY);
    const AT pooled = (at::softmax(cg, 1) * ckv).sum(1);  // (nb, HD)
    AT y = pooled * at::rsqrt(pooled.pow(2).mean(1, true) + eps) * norm_w;
    const AT cp = c * R;
    const AT r = rope64(y.narrow(1, HD - 64, 64), cos_t.index_select(0, cp), sin_t.index_select(0, cp), true);
    y = at::cat({y.narrow(1, 0, HD - 64), r}, 1);
    const AT dst = cmp_slots.index_select(0, bsel);
    if (which != 0) {
      cmp.index_copy_(0, dst, y.to(at::kBFloat16));
    } else {
      const AT z = at::mm(y.to(at::kBFloat16).to(at::kFloat), had).to(at::kBFloat16).to(at::kFloat);
      const AT sq = 127.0 / z.abs().amax(1, true).clamp_min(1e-4);
      idx_kv.index_copy_(0, dst, (z * sq).round().clamp(-127, 127).to(at::kChar));
      idx_sc.index_copy_(0, dst, sq.reciprocal().view(-1));
    }
  };
  k.output = [=] {
    const AT bsel = at::nonzero(cmp_slots >= 0).squeeze(1);
    const AT dst = cmp_slots.index_select(0, bsel);
    if (which != 0) return to_vec(cmp.index_select(0, dst));
    return to_vec(idx_kv.index_select(0, dst).to(at::kFloat) * idx_sc.index_select(0, dst).unsqueeze(1));
  };
  return k;
}

}  // namespace tdpeer
