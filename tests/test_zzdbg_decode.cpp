#include <gtest/gtest.h>
#include "common/decode_fixture.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/golden/decode_layer.hpp"
namespace td = tiledecode;
using td::index_t;
template <class A, class B> void report(const char* name, const A* a, const B* b, index_t rows, index_t cols) {
  for (index_t r = 0; r < rows; ++r) {
    double md = 0, mx = 0; int nbad = 0;
    for (index_t c = 0; c < cols; ++c) {
      double x = float(a[r*cols+c]), y = float(b[r*cols+c]);
      md = std::max(md, std::fabs(x-y)); mx = std::max(mx, std::fabs(y));
      if (std::fabs(x-y) > 1e-4 + std::fabs(y)/128) ++nbad;
    }
    printf("%s row %ld maxdiff %g maxabs %g bad %d\n", name, (long)r, md, mx, nbad);
  }
}
TEST(Dbg, X) {
  const auto cfg = td::flash_config();
  const int B = 4, S = 2;
  td::ThreadPool pool(2);
  const auto be = td::decode::Backend::cpu(&pool);
  td::paged::FixtureTables fx(B, cfg);
  tdtest::LayerSetup L(cfg, td::LayerKind::swa, fx.pools, 2, 1234, be.cpu_ctx);
  td::decode::LayerCacheStorage gold = L.caches;
  std::array<std::int32_t,4> starts{8192, 127, 31, 8192};
  const td::paged::StepShape sh{B, S, 1};
  td::paged::StepMetadata md(B, S, cfg);
  md.build(starts, sh, fx.tables(), fx.pools, cfg);
  td::decode::Workspace ws(cfg, B, S, be.concurrency());
  const index_t T = B * S;
  td::Tensor<float, 3> x_hc({T, 4, cfg.hidden}), x_out({T, 4, cfg.hidden}), x_gold({T, 4, cfg.hidden});
  td::decode::synthetic::fill_x_hc(be.cpu_ctx, x_hc.view(), 99, 0);
  const auto w = L.weights.view();
  td::decode::layer_step(be, x_out.view(), x_hc.view(), w, L.caches.view(), md, L.rope.view(), ws, cfg);
  td::golden::LayerTrace tr;
  td::golden::decode_layer(x_gold.view(), x_hc.view(), w, gold.view(), starts, sh, fx.tables(), L.rope.view(), cfg, {}, &tr);
  auto v = ws.views(B, S);
  report("x_mixed", v.x_mixed.data(), tr.x_mixed.data(), T, cfg.hidden);
  report("x_n", v.x_n.data(), tr.x_n.data(), T, cfg.hidden);
  report("qr", v.qr.data(), tr.qr.data(), T, cfg.q_lora);
  report("qr_scale", v.qr_scale.data(), tr.qr_scale.data(), 1, T);
  report("q", v.q.data(), tr.q.data(), T, 64*512);
  report("kv", v.kv.data(), tr.kv.data(), T, 512);
  report("post", v.post.data(), tr.post.data(), T, 4);
  report("comb", v.comb.data(), tr.comb.data(), T, 16);
  report("o_packed", v.o_packed.data(), tr.o_packed.data(), 8*T, 4096);
  report("attn_out", v.attn_out.data(), tr.attn_out.data(), T, 4096);
}
