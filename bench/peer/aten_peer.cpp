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
//                only; one softmax over all columns is the block merge done at once), bmm P·V,
//                inverse RoPE on the last 64 dims, BF16 packed store.
//   o-proj       per-group bmm with wo_a, per (token, group) Q8 in tensor ops, bmm with wo_b
//                holding integer values in FP32 (exact: |sum| < 2^24), per-group dequant,
//                sum over groups, channel scale, BF16.
//   compressors  two matmuls (x·Wkvᵀ, x·Wgateᵀ) + ape, index_copy_ of the state rows,
//                index_select of the window's state rows, softmax over the window per
//                channel, weighted sum, RMSNorm, RoPE, index_copy_ into the cache (inner:
//                Hadamard matmul and Q8 first).
//   CSA layer    hc_pre (one matmul for the 24 mixes, sigmoid gates, 20 Sinkhorn iterations
//                as tensor ops), RMSNorm, q/kv projections (matmul; the INT8 q-latent as
//                FP32 integers), per-head RMSNorm, RoPE, cache write, both compressors, the
//                indexer query path (matmul, RoPE, Hadamard, Q8) and weights, score + top-k,
//                CSA attention, o-proj, hc_post — the kernels above chained.
// Weights: `fp32_copy` converts BF16/INT8 weights to FP32 once at load; `dequant` converts
// them inside every step.

#include "peer/aten_peer.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/version.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>

namespace tdpeer {
namespace {

using AT = at::Tensor;
namespace td = tiledecode;

template <class T>
constexpr at::ScalarType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return at::kFloat;
  if constexpr (std::is_same_v<T, double>) return at::kDouble;
  if constexpr (std::is_same_v<T, bf16>) return at::kBFloat16;
  if constexpr (std::is_same_v<T, std::int8_t>) return at::kChar;
  if constexpr (std::is_same_v<T, std::int32_t>) return at::kInt;
  if constexpr (std::is_same_v<T, std::int64_t>) return at::kLong;
}

// Wraps tiledecode memory without copying (the case outlives the peer kernel).
template <class T, std::size_t R>
AT wrap(const tiledecode::Tensor<T, R>& t) {
  std::vector<int64_t> sizes(t.shape().begin(), t.shape().end());
  return at::from_blob(const_cast<T*>(t.data()), sizes, at::TensorOptions().dtype(dtype_of<T>()));
}
template <class T, std::size_t R>
AT wrap(const td::View<T, R>& v) {
  using U = std::remove_const_t<T>;
  std::vector<int64_t> sizes(v.shape().begin(), v.shape().end());
  std::vector<int64_t> strides(v.strides().begin(), v.strides().end());
  return at::from_blob(const_cast<U*>(v.data()), sizes, strides,
                       at::TensorOptions().dtype(dtype_of<U>()));
}

std::vector<float> to_vec(const AT& t) {
  const AT f = t.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

constexpr double kNegBig = -3.4028234663852886e38;

// FP32 cos/sin [L, 32] of a BF16 RoPE table (columns 32..63 duplicate 0..31).
struct Rope {
  AT cos, sin;
};
Rope make_rope(const td::RopeTable& r) {
  return {wrap(r.cos).narrow(1, 0, 32).to(at::kFloat), wrap(r.sin).narrow(1, 0, 32).to(at::kFloat)};
}

// Interleaved RoPE of x [..., 64], cos/sin broadcastable to [..., 32] (FP32).
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

// Per-row Q8 over the last dim: integer values (FP32) and the dequant scale (keepdim).
std::pair<AT, AT> q8(const AT& x) {
  const AT sq = 127.0 / x.abs().amax(-1, true).clamp_min(1e-4);
  return {(x * sq).round().clamp(-127, 127), sq.reciprocal()};
}

AT rmsnorm(const AT& x, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, true) + eps);
}

// ---- kernel cores (shared by the per-kernel peers and the layer) ---------------------------

// Indexer score + top-k. q: FP32 integer values [B, S*IH, ID]; q_sc [T*IH]; w [T, IH];
// idx_kv INT8 [rows, ID]; idx_sc [rows]; table [B, cols] long; pos [T] long; lens [B] long.
void indexer_core(AT& score, AT& topk, const AT& q, const AT& q_sc, const AT& w, const AT& idx_kv,
                  const AT& idx_sc, const AT& table, const AT& pos, const AT& lens, int64_t S,
                  int64_t L, int64_t K) {
  const int64_t B = q.size(0), IH = w.size(1), ID = q.size(2), T = B * S;
  const AT b_of_t = at::arange(T, at::kLong).div(S, "floor");
  const AT vis = at::minimum(
      at::minimum(lens.index_select(0, b_of_t).div(4, "floor"), (pos + 1).div(4, "floor")),
      at::full({T}, L, at::kLong));
  const int64_t vmax = vis.max().item<int64_t>();
  score.fill_(kNegBig);
  topk.fill_(-1);
  if (vmax == 0) return;
  const AT j = at::arange(vmax, at::kLong);
  const AT rows = (table.index_select(1, j.div(128, "floor")) * 128 + j.remainder(128)).reshape(-1);
  const AT keys = idx_kv.index_select(0, rows).view({B, vmax, ID}).to(at::kFloat);
  AT dots = at::bmm(q, keys.transpose(1, 2));  // (B, S*IH, vmax)
  dots.mul_(q_sc.view({B, S * IH, 1})).relu_();
  AT sc = at::bmm(w.reshape({B * S, 1, IH}), dots.view({B * S, IH, vmax})).view({B, S, vmax});
  sc.mul_(idx_sc.index_select(0, rows).view({B, 1, vmax}));
  sc = sc.view({T, vmax});
  sc.masked_fill_(j.unsqueeze(0) >= vis.unsqueeze(1), kNegBig);
  score.narrow(1, 0, vmax).copy_(sc);
  const int64_t kk = std::min(K, vmax);
  auto [vals, idx] = at::topk(sc, kk, 1, true, true);
  idx.masked_fill_(idx >= vis.unsqueeze(1), -1);
  topk.narrow(1, 0, kk).copy_(idx);
}

// Sparse attention into o_packed [G*T, OIN] BF16. q BF16 [T, H, HD]; ori/cmp BF16 pools;
// win [T, WIN] long; topk [T, >=K] long (CSA); cmp_table [B, cols] long; pos [T]; lens [B].
void attention_core(AT& out, const td::ModelConfig& cfg, int ratio, const AT& q, const AT& ori,
                    const AT& cmp, const AT& win, const AT& topk, const AT& cmp_table,
                    const AT& pos, const AT& lens, int64_t S, const AT& sink, const Rope& rope) {
  const int64_t T = q.size(0), H = cfg.n_heads, HD = cfg.head_dim, G = cfg.o_groups;
  const int64_t WIN = cfg.window, NOPE = cfg.nope_dim();
  const AT wvalid = win >= 0;
  AT kv = ori.index_select(0, win.clamp_min(0).view(-1)).view({T, WIN, HD});
  AT valid = wvalid;
  if (ratio != 0) {
    const int64_t table_rows = cmp_table.size(1) * cfg.page;
    const AT b_of_t = at::arange(T, at::kLong).div(S, "floor");
    AT raw, cvalid;
    if (ratio == 4) {
      raw = topk.narrow(1, 0, cfg.idx_topk);
      cvalid = (raw >= 0) & (raw < (pos + 1).div(4, "floor").unsqueeze(1)) & (raw < table_rows);
    } else {
      // Rows 0..n-1 of each token (addendum §5.2), computed over the step's longest n (one
      // host sync, as the indexer's vmax): with max_seq_len = 2^20 the capacity is 8192 rows,
      // and gathering all of them at a 16k context would charge the peer 64x the work.
      const int64_t cap = cfg.hca_capacity();
      const AT n = at::minimum(
          at::minimum((pos + 1).div(128, "floor"), lens.index_select(0, b_of_t).div(128, "floor")),
          at::full({T}, cap, at::kLong));
      const int64_t nmax = n.max().item<int64_t>();
      raw = at::arange(nmax, at::kLong).unsqueeze(0).expand({T, nmax});
      cvalid = raw < n.unsqueeze(1);
    }
    const AT rc = at::where(cvalid, raw, at::zeros({}, at::kLong));
    const AT slot =
        cmp_table.index_select(0, b_of_t).gather(1, rc.div(128, "floor")) * 128 + rc.remainder(128);
    kv = at::cat({kv, cmp.index_select(0, slot.view(-1)).view({T, raw.size(1), HD})}, 1);
    valid = at::cat({wvalid, cvalid}, 1);
  }
  const int64_t C = kv.size(1);
  const AT kf = kv.to(at::kFloat);                       // (T, C, 512)
  AT s = at::bmm(q.to(at::kFloat), kf.transpose(1, 2));  // (T, H, C)
  s.mul_(cfg.softmax_scale()).masked_fill_(valid.logical_not().unsqueeze(1), -1e20);
  // The sink is one more logit that takes softmax mass but has no value row.
  s = at::cat({s, sink.view({1, H, 1}).expand({T, H, 1})}, 2);
  const AT p = at::softmax(s, 2).narrow(2, 0, C);
  AT o = at::bmm(p, kf);  // (T, H, 512)
  const AT c = rope.cos.index_select(0, pos).unsqueeze(1),
           sn = rope.sin.index_select(0, pos).unsqueeze(1);
  o = at::cat({o.narrow(2, 0, NOPE), rope64(o.narrow(2, NOPE, HD - NOPE), c, sn, false)}, 2)
          .to(at::kBFloat16);
  out.view({G, T, H / G * HD}).copy_(o.view({T, G, H / G * HD}).transpose(0, 1));
}

// Output projection: x [G, T, OIN] (BF16 or FP32), wa FP32 [G, OL, OIN], wb FP32 [G, OL, D]
// (integer values), scale [D] → out BF16 [T, D].
void oproj_core(AT& out, const AT& x, const AT& wa, const AT& wb, const AT& scale) {
  const AT r = at::bmm(x.to(at::kFloat), wa.transpose(1, 2));  // (G, T, OL)
  auto [aq, dq] = q8(r);
  const AT p = at::bmm(aq, wb);  // (G, T, D), exact integers
  out.copy_(((p * dq).sum(0) * scale).to(at::kBFloat16));
}

// FP32 weights of one compressor (copies or per-step conversions).
struct CompW {
  AT wkv, wg, ape, norm_w;  // (OUT, D), (OUT, D), (R, OUT), (HD) FP32
  int64_t R, HD, OUT;
};

// Compressor step up to the emitted rows: projections, state write, pooling, RMSNorm, RoPE.
// Returns (destination slots, y [nb, HD]); nb may be 0.
std::pair<AT, AT> compressor_core(const CompW& w, const AT& x, const AT& pos, int64_t S, AT& states,
                                  const AT& st_table, const AT& st_slots, int64_t SB,
                                  const AT& cmp_slots, const Rope& rope, double eps) {
  const int64_t R = w.R, HD = w.HD, OUT = w.OUT;
  const bool overlap = OUT == 2 * HD;
  const int64_t L = overlap ? 2 * R : R;
  const AT kv = at::mm(x, w.wkv.t());
  const AT g = at::mm(x, w.wg.t()) + w.ape.index_select(0, pos.remainder(R));
  const AT rows = at::cat({kv, g}, 1);  // (T, 2*OUT)
  const AT wsel = at::nonzero(st_slots >= 0).squeeze(1);
  states.index_copy_(0, st_slots.index_select(0, wsel), rows.index_select(0, wsel));
  const AT bsel = at::nonzero(cmp_slots >= 0).squeeze(1);
  const int64_t nb = bsel.size(0);
  if (nb == 0) return {AT(), AT()};
  const AT c = pos.index_select(0, bsel).div(R, "floor");
  const AT p = (c * R - (overlap ? R : 0)).unsqueeze(1) + at::arange(L, at::kLong);
  const AT pvalid = p >= 0;
  const AT pc = p.clamp_min(0);
  const AT blk = st_table.index_select(0, bsel.div(S, "floor")).gather(1, pc.div(SB, "floor"));
  const AT win =
      states.index_select(0, (blk * SB + pc.remainder(SB)).view(-1)).view({nb, L, 2 * OUT});
  AT ckv, cg;
  if (overlap) {  // previous window's front halves, current window's back halves
    ckv = at::cat({win.narrow(1, 0, R).narrow(2, 0, HD), win.narrow(1, R, R).narrow(2, HD, HD)}, 1);
    cg = at::cat(
        {win.narrow(1, 0, R).narrow(2, OUT, HD), win.narrow(1, R, R).narrow(2, OUT + HD, HD)}, 1);
  } else {
    ckv = win.narrow(2, 0, HD);
    cg = win.narrow(2, OUT, HD).clone();
  }
  cg.masked_fill_(pvalid.logical_not().unsqueeze(2), -INFINITY);
  const AT pooled = (at::softmax(cg, 1) * ckv).sum(1);  // (nb, HD)
  AT y = rmsnorm(pooled, eps) * w.norm_w;
  const AT cp = c * R;
  y = at::cat(
      {y.narrow(1, 0, HD - 64), rope64(y.narrow(1, HD - 64, 64), rope.cos.index_select(0, cp),
                                       rope.sin.index_select(0, cp), true)},
      1);
  return {cmp_slots.index_select(0, bsel), y};
}

// Inner-compressor store: Q8(bf16(bf16(y) @ H)) into the index cache.
void store_inner(AT& idx_kv, AT& idx_sc, const AT& dst, const AT& y, const AT& had) {
  const AT z = at::mm(y.to(at::kBFloat16).to(at::kFloat), had).to(at::kBFloat16).to(at::kFloat);
  auto [q, dq] = q8(z);
  idx_kv.index_copy_(0, dst, q.to(at::kChar));
  idx_sc.index_copy_(0, dst, dq.view(-1));
}

CompW comp_weights(const AT& wkv, const AT& wg, const AT& ape, const AT& norm_w, int64_t R,
                   int64_t HD) {
  return {wkv.to(at::kFloat), wg.to(at::kFloat), ape.to(at::kFloat), norm_w.to(at::kFloat), R, HD,
          wkv.size(0)};
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
  if (auto f = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    f(blas_threads);
}

void peer_wake_threads(int aten_threads, int blas_threads) {
  if (blas_threads > 1) {
    static const AT a = at::ones({256, 256}, at::kFloat), b = at::ones({256, 256}, at::kFloat);
    static AT c = at::empty({256, 256}, at::kFloat);
    at::mm_out(c, a, b);
  }
  if (aten_threads > 1) {
    // A barrier with a bound: every chunk waits (at most 2 ms) until all have started.
    std::atomic<int> arrived{0};
    at::parallel_for(0, aten_threads, 1, [&](int64_t b, int64_t e) {
      arrived.fetch_add(int(e - b));
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
      while (arrived.load() < aten_threads && std::chrono::steady_clock::now() < until) {
      }
    });
  }
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

std::string peer_blas_corename() {
  using StrFn = char* (*)();
  auto core = reinterpret_cast<StrFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  return core ? std::string(core()) : std::string();
}

PeerKernel make_peer_sgemm(int64_t batch, int64_t m, int64_t n, int64_t k) {
  // Uniform inputs (the BLAS's speed does not depend on the values; no denormals).
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto a = std::make_shared<AT>(at::rand({batch, m, k}, opts) - 0.5);
  auto b = std::make_shared<AT>(at::rand({batch, n, k}, opts) - 0.5);
  auto c = std::make_shared<AT>();
  if (batch == 1) {
    *a = a->view({m, k});
    *b = b->view({n, k});
  }
  // Transposed views of row-major [.., n, k] operands, as the peer's keys and weights.
  return {
      [a, b, c, batch] { *c = batch == 1 ? at::mm(*a, b->t()) : at::bmm(*a, b->transpose(1, 2)); },
      [c] {
        const AT f = c->reshape(-1);
        return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
      }};
}

PeerKernel make_peer_indexer(const Weights& w, Case& cs) {
  const auto& cfg = w.cfg;
  const int64_t T = cs.tokens(), B = cs.batch, S = cs.seq, IH = cfg.idx_n_heads,
                ID = cfg.idx_head_dim;
  const AT q_i8 = wrap(cs.q_i8), q_sc = wrap(cs.q_sc), wts = wrap(cs.w);
  const AT idx_kv = wrap(cs.idx_kv), idx_sc = wrap(cs.idx_sc);
  const AT table = wrap(cs.idx_table).to(at::kLong);
  const AT pos = wrap(cs.positions).to(at::kLong), lens = wrap(cs.kv_seq_lens).to(at::kLong);
  auto score = std::make_shared<AT>(at::empty({T, cfg.score_len()}, at::kFloat));
  auto topk = std::make_shared<AT>(at::empty({T, cfg.idx_topk}, at::kLong));
  const int64_t L = cfg.score_len(), K = cfg.idx_topk;
  PeerKernel k;
  k.run = [=] {
    indexer_core(*score, *topk, q_i8.view({B, S * IH, ID}).to(at::kFloat), q_sc, wts, idx_kv,
                 idx_sc, table, pos, lens, S, L, K);
  };
  k.output = [score] { return to_vec(*score); };
  return k;
}

PeerKernel make_peer_attention(const Weights& w, Case& cs, int ratio) {
  const auto& cfg = w.cfg;
  const int64_t T = cs.tokens(), S = cs.seq;
  const AT q = wrap(cs.q), ori = wrap(cs.ori_kv), cmp = wrap(cs.cmp_kv);
  const AT win = wrap(cs.win_idx).to(at::kLong), topk = wrap(cs.topk).to(at::kLong);
  const AT cmp_table = wrap(cs.cmp_table).to(at::kLong);
  const AT pos = wrap(cs.positions).to(at::kLong), lens = wrap(cs.kv_seq_lens).to(at::kLong);
  const AT sink = wrap(w.sink);
  const Rope rope = make_rope(ratio == 0 ? w.rope_swa : w.rope_csa);
  auto out = std::make_shared<AT>(at::empty({cfg.o_groups * T, cfg.o_group_in()}, at::kBFloat16));
  PeerKernel k;
  k.run = [=, &cfg] {
    attention_core(*out, cfg, ratio, q, ori, cmp, win, topk, cmp_table, pos, lens, S, sink, rope);
  };
  k.output = [out] { return to_vec(*out); };
  return k;
}

PeerKernel make_peer_oproj(const Weights& w, Case& cs, WeightMode mode) {
  const auto& cfg = w.cfg;
  const int64_t T = cs.tokens(), G = cfg.o_groups, OL = cfg.o_lora, D = cfg.hidden;
  const AT x = wrap(cs.o_packed).view({G, T, cfg.o_group_in()});
  const AT wa_raw = wrap(w.wo_a), wb_raw = wrap(w.wo_b), scale = wrap(w.wo_b_scale);
  // (G, O_LORA, D) view of wo_b [D, G*O_LORA]: group g's K-slice, transposed for bmm.
  AT wa_f, wb_f;
  if (mode == WeightMode::fp32_copy) {
    wa_f = wa_raw.to(at::kFloat);
    wb_f = wb_raw.to(at::kFloat).view({D, G, OL}).permute({1, 2, 0}).contiguous();
  }
  auto out = std::make_shared<AT>(at::empty({T, D}, at::kBFloat16));
  PeerKernel k;
  k.run = [=] {
    if (mode == WeightMode::fp32_copy) {
      oproj_core(*out, x, wa_f, wb_f, scale);
    } else {
      oproj_core(*out, x, wa_raw.to(at::kFloat),
                 wb_raw.to(at::kFloat).view({D, G, OL}).permute({1, 2, 0}), scale);
    }
  };
  k.output = [out] { return to_vec(*out); };
  return k;
}

PeerKernel make_peer_compressor(const Weights& w, Case& cs, int which, WeightMode mode) {
  const auto& cfg = w.cfg;
  const CompressorWeights& cw = which == 4 ? w.c4 : (which == 128 ? w.c128 : w.inner);
  StatePool& sp = which == 4 ? cs.s4 : (which == 128 ? cs.s128 : cs.sinner);
  const int64_t S = cs.seq, SB = sp.page;
  const AT x_n = wrap(cs.x_n);
  const AT wkv_raw = wrap(cw.wkv), wg_raw = wrap(cw.wgate), ape = wrap(cw.ape),
           norm_w = wrap(cw.norm_w);
  CompW cwf;
  if (mode == WeightMode::fp32_copy)
    cwf = comp_weights(wkv_raw, wg_raw, ape, norm_w, cw.ratio, cw.head_dim);
  AT states = wrap(sp.rows);
  const AT st_table = wrap(sp.table).to(at::kLong), st_slots = wrap(sp.slots);
  const AT cmp_slots =
      wrap(which == 4 ? cs.c4_cmp_slots : (which == 128 ? cs.c128_cmp_slots : cs.idx_slots));
  const AT pos = wrap(cs.positions).to(at::kLong);
  const Rope rope = make_rope(w.rope_csa);
  const AT had = wrap(w.hadamard).to(at::kFloat);
  AT cmp = wrap(cs.cmp_kv), idx_kv = wrap(cs.idx_kv), idx_sc = wrap(cs.idx_sc);
  const double eps = cfg.rms_eps;
  PeerKernel k;
  k.run = [=]() mutable {
    const CompW cur = mode == WeightMode::fp32_copy
                          ? cwf
                          : comp_weights(wkv_raw, wg_raw, ape, norm_w, cw.ratio, cw.head_dim);
    auto [dst, y] = compressor_core(cur, x_n.to(at::kFloat), pos, S, states, st_table, st_slots, SB,
                                    cmp_slots, rope, eps);
    if (!dst.defined()) return;
    if (which != 0) {
      cmp.index_copy_(0, dst, y.to(at::kBFloat16));
    } else {
      store_inner(idx_kv, idx_sc, dst, y, had);
    }
  };
  k.output = [=] {
    const AT dst = cmp_slots.index_select(0, at::nonzero(cmp_slots >= 0).squeeze(1));
    if (which != 0) return to_vec(cmp.index_select(0, dst));
    return to_vec(idx_kv.index_select(0, dst).to(at::kFloat) *
                  idx_sc.index_select(0, dst).unsqueeze(1));
  };
  return k;
}

PeerKernel make_peer_layer(const LayerModel& m, LayerCase& lc, WeightMode mode) {
  const td::ModelConfig& cfg = m.cfg;
  const auto& W = m.w;
  const auto& md = lc.md;
  const int64_t B = lc.batch, S = lc.seq, T = B * S, D = cfg.hidden, H = cfg.n_heads;
  const int64_t HD = cfg.head_dim, QL = cfg.q_lora, NOPE = cfg.nope_dim(), G = cfg.o_groups;
  const int64_t IH = cfg.idx_n_heads, ID = cfg.idx_head_dim, OL = cfg.o_lora;
  const double eps = cfg.rms_eps;
  // Weights: FP32 views of what an engine would hold. fp32_copy: converted once here.
  struct LW {
    AT hc_fn, hc_scale, hc_base, attn_norm, wq_a, gamma_cq, wq_b, wq_b_scale, wkv, gamma_ckv;
    AT idx_wq_b, idx_wq_b_scale, weights_proj, had, wo_a, wo_b, wo_b_scale, sink;
    CompW c4, inner;
  };
  const auto convert = [&W]() {
    LW l;
    l.hc_fn = wrap(W.hc_fn);
    l.hc_scale = wrap(W.hc_scale);
    l.hc_base = wrap(W.hc_base);
    l.attn_norm = wrap(W.attn_norm).to(at::kFloat);
    l.wq_a = wrap(W.wq_a).to(at::kFloat);
    l.gamma_cq = wrap(W.gamma_cq).to(at::kFloat);
    l.wq_b = wrap(W.wq_b).to(at::kFloat);
    l.wq_b_scale = wrap(W.wq_b_scale);
    l.wkv = wrap(W.wkv).to(at::kFloat);
    l.gamma_ckv = wrap(W.gamma_ckv).to(at::kFloat);
    l.idx_wq_b = wrap(W.idx_wq_b).to(at::kFloat);
    l.idx_wq_b_scale = wrap(W.idx_wq_b_scale);
    l.weights_proj = wrap(W.weights_proj).to(at::kFloat);
    l.had = wrap(W.hadamard).to(at::kFloat);
    const int64_t Gc = W.wo_a.extent(0), OLc = W.wo_a.extent(1), Dc = W.wo_b.extent(0);
    l.wo_a = wrap(W.wo_a).to(at::kFloat);
    l.wo_b = wrap(W.wo_b).to(at::kFloat).view({Dc, Gc, OLc}).permute({1, 2, 0});
    l.wo_b_scale = wrap(W.wo_b_scale);
    l.sink = wrap(W.attn_sink);
    l.c4 = comp_weights(wrap(W.cmp_wkv), wrap(W.cmp_wgate), wrap(W.cmp_ape), wrap(W.cmp_norm_w), 4,
                        W.cmp_norm_w.extent(0));
    l.inner = comp_weights(wrap(W.inner_wkv), wrap(W.inner_wgate), wrap(W.inner_ape),
                           wrap(W.inner_norm_w), 4, W.inner_norm_w.extent(0));
    return l;
  };
  LW fixed;
  if (mode == WeightMode::fp32_copy) {
    fixed = convert();
    fixed.wo_b = fixed.wo_b.contiguous();
  }
  // Pools and metadata.
  auto& C = lc.caches;
  AT kv_cache = wrap(C.kv_cache), cmp_kv = wrap(C.cmp_kv), state = wrap(C.state);
  AT inner_state = wrap(C.inner_state), idx_kv = wrap(C.idx_kv_cache),
     idx_sc = wrap(C.idx_kv_scale);
  const AT pos = wrap(md.position_ids()).to(at::kLong), lens = wrap(md.kv_seq_lens()).to(at::kLong);
  const AT ori_slots = wrap(md.ori_slot_mapping()), win = wrap(md.window_indices()).to(at::kLong);
  const AT csa_cmp_slots = wrap(md.csa_cmp_slot_mapping()),
           idx_slots = wrap(md.csa_idx_slot_mapping());
  const AT st_slots = wrap(md.csa_state_slot_mapping()),
           inner_slots = wrap(md.csa_inner_state_slot_mapping());
  const auto& tb = md.tables();
  const AT cmp_table = wrap(tb.cmp_block_table).to(at::kLong),
           idx_table = wrap(tb.idx_block_table).to(at::kLong);
  const AT st_table = wrap(tb.csa_state_table).to(at::kLong),
           inner_table = wrap(tb.csa_inner_state_table).to(at::kLong);
  const int64_t SB = cfg.c4_state_page;
  const Rope rope = make_rope(m.rope);
  const AT x_hc = wrap(lc.x_hc);
  auto x_out = std::make_shared<AT>(at::empty({T, 4, D}, at::kFloat));
  auto score = std::make_shared<AT>(at::empty({T, cfg.score_len()}, at::kFloat));
  auto topk = std::make_shared<AT>(at::empty({T, cfg.idx_topk}, at::kLong));
  auto o_packed = std::make_shared<AT>(at::empty({G * T, cfg.o_group_in()}, at::kBFloat16));
  auto attn_out = std::make_shared<AT>(at::empty({T, D}, at::kBFloat16));
  const double iw_scale = cfg.index_weights_scale();
  const int64_t L = cfg.score_len(), K = cfg.idx_topk;
  PeerKernel k;
  k.run = [=, &cfg]() mutable {
    const LW l = mode == WeightMode::fp32_copy ? fixed : convert();
    // hc_pre: RMS-scaled mixes, gates, Sinkhorn-normalised combine, mix-in (double, like the
    // reference; 24 × 4D per token, negligible).
    const AT xd = x_hc.to(at::kDouble);
    const AT flat = xd.view({T, 4 * D});
    const AT mix =
        at::mm(flat, l.hc_fn.to(at::kDouble).t()) * at::rsqrt(flat.pow(2).mean(1, true) + eps);
    const AT sc = l.hc_scale.to(at::kDouble), base = l.hc_base.to(at::kDouble);
    const AT pre = at::sigmoid(mix.narrow(1, 0, 4) * sc[0] + base.narrow(0, 0, 4)) + 1e-6;
    const AT post = 2.0 * at::sigmoid(mix.narrow(1, 4, 4) * sc[1] + base.narrow(0, 4, 4));
    AT comb =
        at::softmax((mix.narrow(1, 8, 16) * sc[2] + base.narrow(0, 8, 16)).view({T, 4, 4}), 2) +
        1e-6;
    for (int it = 0; it < 20; ++it) {
      if (it > 0) comb = comb / (comb.sum(2, true) + 1e-6);
      comb = comb / (comb.sum(1, true) + 1e-6);
    }
    const AT x_mixed =
        (pre.unsqueeze(2) * xd).sum(1).to(at::kFloat).to(at::kBFloat16).to(at::kFloat);
    // RMSNorm → x_n (BF16).
    const AT x_n = (rmsnorm(x_mixed, eps) * l.attn_norm).to(at::kBFloat16).to(at::kFloat);
    // q / kv projections.
    const AT cq = rmsnorm(at::mm(x_n, l.wq_a), eps) * l.gamma_cq;
    auto [qr, qr_scale] = q8(cq);  // (T, QL) integers, (T, 1)
    AT qf = (at::mm(qr, l.wq_b) * qr_scale * l.wq_b_scale).view({T, H, HD});
    qf = rmsnorm(qf, eps);
    const AT cs_ = rope.cos.index_select(0, pos), sn_ = rope.sin.index_select(0, pos);
    const AT q = at::cat({qf.narrow(2, 0, NOPE), rope64(qf.narrow(2, NOPE, HD - NOPE),
                                                        cs_.unsqueeze(1), sn_.unsqueeze(1), true)},
                         2)
                     .to(at::kBFloat16);
    AT kvf = rmsnorm(at::mm(x_n, l.wkv), eps) * l.gamma_ckv;
    const AT kv =
        at::cat({kvf.narrow(1, 0, NOPE), rope64(kvf.narrow(1, NOPE, HD - NOPE), cs_, sn_, true)}, 1)
            .to(at::kBFloat16);
    const AT osel = at::nonzero(ori_slots >= 0).squeeze(1);
    kv_cache.index_copy_(0, ori_slots.index_select(0, osel), kv.index_select(0, osel));
    // Compressors (CSA main → cmp_kv; inner → index cache).
    {
      auto [dst, y] = compressor_core(l.c4, x_n, pos, S, state, st_table, st_slots, SB,
                                      csa_cmp_slots, rope, eps);
      if (dst.defined()) cmp_kv.index_copy_(0, dst, y.to(at::kBFloat16));
    }
    {
      auto [dst, y] = compressor_core(l.inner, x_n, pos, S, inner_state, inner_table, inner_slots,
                                      SB, idx_slots, rope, eps);
      if (dst.defined()) store_inner(idx_kv, idx_sc, dst, y, l.had);
    }
    // Indexer query path and weights (RoPE at pos_t: the library's default rule).
    AT qi = (at::mm(qr, l.idx_wq_b) * qr_scale * l.idx_wq_b_scale).view({T, IH, ID});
    qi = at::cat({qi.narrow(2, 0, ID - 64),
                  rope64(qi.narrow(2, ID - 64, 64), cs_.unsqueeze(1), sn_.unsqueeze(1), true)},
                 2)
             .to(at::kBFloat16)
             .to(at::kFloat);
    auto [qi8, qsc] = q8(at::matmul(qi, l.had));  // (T, IH, ID), (T, IH, 1)
    const AT wts = at::mm(x_n, l.weights_proj) * iw_scale;
    indexer_core(*score, *topk, qi8.view({B, S * IH, ID}), qsc.view(-1), wts, idx_kv, idx_sc,
                 idx_table, pos, lens, S, L, K);
    // Sparse attention, output projection, hc_post.
    attention_core(*o_packed, cfg, 4, q, kv_cache, cmp_kv, win, *topk, cmp_table, pos, lens, S,
                   l.sink, rope);
    oproj_core(*attn_out, o_packed->view({G, T, cfg.o_group_in()}), l.wo_a, l.wo_b, l.wo_b_scale);
    (void)OL;
    (void)QL;
    const AT y = attn_out->to(at::kFloat).unsqueeze(1) * post.to(at::kFloat).unsqueeze(2) +
                 at::bmm(comb.to(at::kFloat).transpose(1, 2), x_hc);
    x_out->copy_(y);
  };
  k.output = [x_out] { return to_vec(*x_out); };
  return k;
}

}  // namespace tdpeer
