// Core types: bf16 rounding, Q8, views, buffers, errors, parallel_for, config presets.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/tiledecode.hpp"

namespace td = tiledecode;

namespace {

float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

TEST(Bf16, RoundsToNearestEvenHandComputed) {
  // 1.0 exactly representable.
  EXPECT_EQ(td::bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly halfway between 0x3f80 and 0x3f81 → ties to even (0x3f80).
  EXPECT_EQ(td::bf16(from_bits(0x3f808000u)).bits, 0x3f80);
  // 0x3f818000 is halfway between 0x3f81 and 0x3f82 → ties to even (0x3f82).
  EXPECT_EQ(td::bf16(from_bits(0x3f818000u)).bits, 0x3f82);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(td::bf16(from_bits(0x3f808001u)).bits, 0x3f81);
  EXPECT_EQ(td::bf16(from_bits(0x3f807fffu)).bits, 0x3f80);
  // Negative numbers round symmetrically.
  EXPECT_EQ(td::bf16(from_bits(0xbf818000u)).bits, 0xbf82);
  // 3.14159265 = 0x40490fdb → 0x4049 (0x0fdb < 0x8000).
  EXPECT_EQ(td::bf16(3.14159265f).bits, 0x4049);
  // Largest finite float rounds up to +Inf; values below the rounding edge stay finite.
  EXPECT_EQ(td::bf16(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(td::bf16(from_bits(0x7f7f7fffu)).bits, 0x7f7f);
  // Subnormals round like normals.
  EXPECT_EQ(td::bf16(from_bits(0x00018000u)).bits, 0x0002);
}

TEST(Bf16, PreservesSpecials) {
  EXPECT_EQ(td::bf16(INFINITY).bits, 0x7f80);
  EXPECT_EQ(td::bf16(-INFINITY).bits, 0xff80);
  EXPECT_EQ(td::bf16(0.0f).bits, 0x0000);
  EXPECT_EQ(td::bf16(-0.0f).bits, 0x8000);
  // A NaN whose payload sits only in the low bits must stay NaN (not become Inf).
  const float nan_low = from_bits(0x7f800001u);
  EXPECT_TRUE(std::isnan(td::bf16(nan_low).to_float()));
  EXPECT_TRUE(std::isnan(td::bf16(std::numeric_limits<float>::quiet_NaN()).to_float()));
  EXPECT_TRUE(std::signbit(td::bf16(-std::numeric_limits<float>::quiet_NaN()).to_float()));
}

TEST(Bf16, WideningIsExactAndRoundTrips) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = td::bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = h.to_float();
    EXPECT_EQ(std::bit_cast<std::uint32_t>(f), b << 16);
    if (!std::isnan(f)) {
      ASSERT_EQ(td::bf16(f).bits, b);
    }
  }
}

TEST(Q8, HandComputedCases) {
  // amax = 2 → sq = 63.5; x*sq: 1 → 63.5 → 64 (half to even), -2 → -127, 0.5 → 31.75 → 32,
  // 0.0236220472 → 1.5 ± → rint.
  std::vector<float> x = {1.0f, -2.0f, 0.5f, 0.0f};
  std::vector<std::int8_t> q(4);
  const float dq = td::quantize_q8(q, x);
  EXPECT_EQ(q[0], 64);
  EXPECT_EQ(q[1], -127);
  EXPECT_EQ(q[2], 32);
  EXPECT_EQ(q[3], 0);
  EXPECT_EQ(dq, 1.0f / (127.0f / 2.0f));
  // Half to even on exact halves: amax 127 → sq 1: 2.5 → 2, 3.5 → 4, -2.5 → -2.
  std::vector<float> y = {2.5f, 3.5f, -2.5f, 127.0f};
  std::vector<std::int8_t> qy(4);
  EXPECT_EQ(td::quantize_q8(qy, y), 1.0f);
  EXPECT_EQ(qy[0], 2);
  EXPECT_EQ(qy[1], 4);
  EXPECT_EQ(qy[2], -2);
  EXPECT_EQ(qy[3], 127);
}

TEST(Q8, AmaxFloorForZeroRow) {
  std::vector<float> x(8, 0.0f);
  x[3] = 1e-6f;
  std::vector<std::int8_t> q(8);
  const float dq = td::quantize_q8(q, x);
  EXPECT_EQ(dq, 1.0f / (127.0f / 1e-4f));
  EXPECT_EQ(q[3], 1);  // 1e-6 * 1.27e6 = 1.27 → 1
}

TEST(Q8, RandomRowsMatchFormulaAndStayInRange) {
  tdtest::Rng rng(7);
  for (int r = 0; r < 100; ++r) {
    std::vector<float> x(128);
    rng.fill_normal(x, 3.0f);
    std::vector<std::int8_t> q(128);
    const float dq = td::quantize_q8(q, x);
    float amax = 1e-4f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const float sq = 127.0f / amax;
    EXPECT_EQ(dq, 1.0f / sq);
    for (int i = 0; i < 128; ++i) {
      EXPECT_EQ(q[i], static_cast<std::int8_t>(std::nearbyint(x[i] * sq)));
      EXPECT_LE(std::abs(int(q[i])), 127);
    }
  }
}

// The AVX2 quantiser (o-proj activations, q-latent, indexer queries) against core quantize_q8,
// bit for bit: random rows of several lengths, rows below the amax floor, rows whose products
// land on .5 ties (round half to even), and rows with a NaN (amax ignores it; its own q is
// unspecified, so only the other entries are compared).
TEST(Q8, Avx2MatchesScalarBitForBit) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx2)) GTEST_SKIP() << "no AVX2";
#if TILEDECODE_X86
  tdtest::Rng rng(8);
  for (int n : {32, 40, 128, 1024}) {
    for (int r = 0; r < 40; ++r) {
      std::vector<float> x(std::size_t(n), 0.0f);
      if (r % 4 == 0) {
        rng.fill_normal(x, 1e-6f);  // amax below the 1e-4 floor
      } else if (r % 4 == 1) {
        // amax = 127 → sq = 1: every x_i + 0.5 is a tie for nearbyint.
        for (int i = 0; i < n; ++i)
          x[std::size_t(i)] = float(i % 254 - 127) + (i % 3 ? 0.5f : 0.0f);
        x[0] = 127.0f;
      } else {
        rng.fill_normal(x, r % 4 == 2 ? 3.0f : 1e3f);
      }
      const bool with_nan = r % 5 == 4;
      if (with_nan) x[std::size_t(n / 2)] = std::numeric_limits<float>::quiet_NaN();
      const auto len = static_cast<std::size_t>(n);
      std::vector<std::int8_t> q_ref(len), q(len);
      const float dq_ref = td::quantize_q8(q_ref, x);
      // Through the dispatcher: 40 is not a multiple of 32 and takes the scalar path.
      const float dq = td::cpu::quantize_q8_row(td::cpu::Isa::avx2, q.data(), x.data(), n);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(dq), std::bit_cast<std::uint32_t>(dq_ref));
      for (int i = 0; i < n; ++i) {
        if (with_nan && i == n / 2) continue;
        ASSERT_EQ(q[std::size_t(i)], q_ref[std::size_t(i)]) << i;
      }
    }
  }
#endif
}

TEST(View, RowMajorIndexingSliceRow) {
  std::vector<int> v(2 * 3 * 4);
  std::iota(v.begin(), v.end(), 0);
  td::View<int, 3> t(v.data(), {2, 3, 4});
  EXPECT_EQ(t(1, 2, 3), 23);
  EXPECT_EQ(t.row(1)(0, 1), 13);
  auto s = t.slice(1, 1, 3);
  EXPECT_EQ(s.extent(1), 2);
  EXPECT_EQ(s(0, 0, 0), 4);
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_TRUE(t.is_contiguous());
  auto r = t.reshape<2>({6, 4});
  EXPECT_EQ(r(5, 3), 23);
  EXPECT_THROW((void)s.reshape<1>({8}), td::Error);
  td::View<const int, 3> c = t;
  EXPECT_EQ(c(0, 0, 1), 1);
}

TEST(View, AtChecksBounds) {
  std::vector<float> v(6);
  td::View<float, 2> t(v.data(), {2, 3});
  EXPECT_NO_THROW(t.at(1, 2));
  EXPECT_THROW(t.at(2, 0), td::Error);
  EXPECT_THROW(t.at(0, -1), td::Error);
  try {
    t.at(0, 3);
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dimension 1"), std::string::npos);
  }
}

TEST(Buffer, AlignedZeroedCopyMove) {
  td::Buffer<float> b(37);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 64, 0u);
  for (float x : b) EXPECT_EQ(x, 0.0f);
  b[5] = 2.0f;
  td::Buffer<float> c = b;
  EXPECT_EQ(c[5], 2.0f);
  td::Buffer<float> d = std::move(c);
  EXPECT_EQ(d[5], 2.0f);
  EXPECT_EQ(c.data(), nullptr);
  EXPECT_THROW((void)b.view<2>({6, 6}), td::Error);
  td::Tensor<td::bf16, 2> t({3, 4});
  EXPECT_EQ(t.view().extent(1), 4);
}

TEST(Buffer, LargeBuffersStartOnAHugePageAndSurviveCopyAndMove) {
  // >= 2 MiB: 2 MiB aligned (transparent huge pages requested on Linux); smaller: 64 B aligned.
  const std::size_t big = (std::size_t(2) << 20) / sizeof(float) + 5;
  td::Buffer<float> b(big);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % (std::size_t(2) << 20), 0u);
  for (std::size_t i = 0; i < big; i += 4097) EXPECT_EQ(b[i], 0.0f);
  b[big - 1] = 3.0f;
  td::Buffer<float> c = b;
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(c.data()) % (std::size_t(2) << 20), 0u);
  EXPECT_EQ(c[big - 1], 3.0f);
  td::Buffer<float> d = std::move(c);
  EXPECT_EQ(d[big - 1], 3.0f);
  d = td::Buffer<float>(7);  // frees the huge-page-aligned block with its own alignment
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(d.data()) % 64, 0u);
}

TEST(Error, MessageNamesArgumentValueAndRange) {
  try {
    td::check_range<std::int64_t>("write_rows", "slot_mapping[3]", 999, -1, 512);
    FAIL();
  } catch (const td::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("write_rows"), std::string::npos);
    EXPECT_NE(m.find("slot_mapping[3]"), std::string::npos);
    EXPECT_NE(m.find("999"), std::string::npos);
    EXPECT_NE(m.find("[-1, 512)"), std::string::npos);
  }
}

TEST(Parallel, EveryIndexOnceAnyThreadCount) {
  for (std::size_t threads : {1u, 2u, 3u, 7u}) {
    td::ThreadPool pool(threads);
    EXPECT_EQ(pool.concurrency(), threads);
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<std::atomic<int>> hits(1000);
      td::parallel_for(pool, 0, 1000, 7, [&](std::int64_t i) { hits[i].fetch_add(1); });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    }
  }
}

TEST(Parallel, ExceptionPropagatesAndPoolStaysUsable) {
  td::ThreadPool pool(3);
  EXPECT_THROW(td::parallel_for(pool, 0, 100, 1,
                                [&](std::int64_t i) {
                                  if (i == 42) throw td::Error("boom");
                                }),
               td::Error);
  std::atomic<int> n{0};
  td::parallel_for(pool, 0, 100, 1, [&](std::int64_t) { n++; });
  EXPECT_EQ(n.load(), 100);
}

// Runs f; if it has not returned after `seconds`, the process exits with a message (a deadlock
// must fail the test, not hang it).
void within_seconds(int seconds, const std::function<void()>& f) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lk(m);
    if (!cv.wait_for(lk, std::chrono::seconds(seconds), [&] { return done; })) {
      std::fprintf(stderr, "DEADLOCK: a nested ThreadPool::run did not return within %d s\n",
                   seconds);
      std::_Exit(3);
    }
  });
  auto finish = [&] {
    {
      std::lock_guard lk(m);
      done = true;
    }
    cv.notify_all();
    watchdog.join();
  };
  try {
    f();
  } catch (...) {
    finish();
    throw;
  }
  finish();
}

// A run() from inside a task of the same pool (on a worker or on the calling thread) runs inline
// on that thread instead of waiting for the pool it occupies (which deadlocked).
TEST(Parallel, NestedRunOnTheSamePoolRunsInlineInsteadOfDeadlocking) {
  for (std::size_t threads : {2u, 3u}) {
    td::ThreadPool pool(threads);
    within_seconds(60, [&] {
      for (int rep = 0; rep < 20; ++rep) {
        std::vector<std::atomic<int>> hits(8 * 100);
        std::atomic<int> other_thread{0}, not_inside{0};
        EXPECT_FALSE(pool.inside_task());
        td::parallel_for(pool, 0, 8, 1, [&](std::int64_t i) {
          if (!pool.inside_task()) not_inside++;
          const auto id = std::this_thread::get_id();
          td::parallel_for(pool, 0, 100, 7, [&](std::int64_t j) {
            if (std::this_thread::get_id() != id) other_thread++;
            hits[std::size_t(i * 100 + j)]++;
            td::parallel_for(pool, 0, 3, 1, [&](std::int64_t) {
              if (std::this_thread::get_id() != id) other_thread++;
            });
          });
          if (!pool.inside_task()) not_inside++;  // the marker survives the nested runs
        });
        EXPECT_FALSE(pool.inside_task());
        for (auto& h : hits) ASSERT_EQ(h.load(), 1);
        EXPECT_EQ(other_thread.load(), 0) << "nested tasks must run on their caller's thread";
        EXPECT_EQ(not_inside.load(), 0);
      }
    });
    // Still a working pool.
    std::atomic<int> n{0};
    td::parallel_for(pool, 0, 1000, 3, [&](std::int64_t) { n++; });
    EXPECT_EQ(n.load(), 1000);
  }
}

TEST(Parallel, NestedRunKeepsTheExecutorContractOnExceptions) {
  td::ThreadPool pool(2);
  within_seconds(60, [&] {
    std::atomic<int> inner{0};
    EXPECT_THROW(td::parallel_for(pool, 0, 4, 1,
                                  [&](std::int64_t) {
                                    td::parallel_for(pool, 0, 50, 1, [&](std::int64_t j) {
                                      inner++;
                                      if (j == 3) throw td::Error("inner boom");
                                    });
                                  }),
                 td::Error);
    EXPECT_EQ(inner.load(), 4 * 50) << "every nested task runs once, the first error after all";
  });
  std::atomic<int> n{0};
  td::parallel_for(pool, 0, 100, 1, [&](std::int64_t) { n++; });
  EXPECT_EQ(n.load(), 100);
}

// A kernel given the pool, called from inside the pool's own tasks: same bytes as a direct call.
TEST(Parallel, KernelCalledFromATaskOfItsOwnPoolRunsInline) {
  td::ThreadPool pool(2);
  const td::cpu::Context ctx = td::cpu::make_context(&pool);
  const td::index_t T = 64, D = 512;
  td::Tensor<td::bf16, 2> x({T, D}), ref({T, D}), nested({T, D});
  td::Tensor<td::bf16, 1> w({D});
  std::uint32_t s = 7;
  auto next = [&] {
    s = s * 1664525u + 1013904223u;
    return float(s >> 8) / float(1 << 24) - 0.5f;
  };
  for (auto& v : x.flat()) v = td::bf16(next() * 4.0f);
  for (auto& v : w.flat()) v = td::bf16(1.0f + next());
  td::kernels::rmsnorm(ctx, ref.view(), x.view(), w.view(), 1e-6f);
  within_seconds(60, [&] {
    td::parallel_for(pool, 0, 4, 1, [&](std::int64_t i) {
      const td::index_t r0 = i * 16;
      td::kernels::rmsnorm(ctx, nested.view().slice(0, r0, r0 + 16), x.view().slice(0, r0, r0 + 16),
                           w.view(), 1e-6f);
    });
  });
  EXPECT_EQ(0, std::memcmp(ref.data(), nested.data(), ref.size() * sizeof(td::bf16)));
}

// Nesting across pools: A's task runs pool B (B's workers do the work, B's marker inside B's
// tasks), and A's marker is back when B.run returns.
TEST(Parallel, NestedRunOfAnotherPoolUsesThatPool) {
  td::ThreadPool a(2), b(2);
  within_seconds(60, [&] {
    std::atomic<int> in_b{0}, in_a_inside_b{0}, a_after{0}, n{0};
    td::parallel_for(a, 0, 4, 1, [&](std::int64_t) {
      td::parallel_for(b, 0, 16, 1, [&](std::int64_t) {
        n++;
        in_b += b.inside_task();
        in_a_inside_b += a.inside_task();
      });
      a_after += a.inside_task();
    });
    EXPECT_EQ(n.load(), 64);
    EXPECT_EQ(in_b.load(), 64);
    EXPECT_EQ(in_a_inside_b.load(), 0);
    EXPECT_EQ(a_after.load(), 4);
  });
}

TEST(Parallel, ContextRunsInlineWithoutExecutor) {
  td::cpu::Context ctx{};
  int sum = 0;
  ctx.parallel_for(0, 10, 3, [&](std::int64_t i) { sum += int(i); });
  EXPECT_EQ(sum, 45);
}

TEST(Config, FlashAndProPresets) {
  const auto f = td::flash_config();
  EXPECT_EQ(f.hidden, 4096);
  EXPECT_EQ(f.nope_dim(), 448);
  EXPECT_EQ(f.o_group_in(), 4096);
  EXPECT_EQ(f.score_len(), 4096);
  EXPECT_EQ(f.attn_cols(td::LayerKind::csa), 640);
  EXPECT_EQ(f.attn_cols(td::LayerKind::hca), 256);
  EXPECT_NEAR(f.softmax_scale(), 0.044194173824159, 1e-9);
  EXPECT_NEAR(f.index_weights_scale(), 0.011048543456040, 1e-9);
  EXPECT_EQ(f.layer_kind(0), td::LayerKind::swa);
  EXPECT_EQ(f.layer_kind(2), td::LayerKind::csa);
  EXPECT_EQ(f.layer_kind(3), td::LayerKind::hca);
  const auto p = td::pro_config();
  EXPECT_EQ(p.hidden, 7168);
  EXPECT_EQ(p.n_heads, 128);
  EXPECT_EQ(p.o_groups, 16);
  EXPECT_EQ(p.attn_cols(td::LayerKind::csa), 1152);
  EXPECT_EQ(p.layer_kind(0), td::LayerKind::hca);
  EXPECT_EQ(p.layer_kind(2), td::LayerKind::csa);
  EXPECT_THROW((void)td::config_by_name("mini"), td::Error);
}

TEST(Isa, DetectAndCheck) {
  namespace cpu = td::cpu;
  EXPECT_EQ(cpu::checked_isa(cpu::Isa::scalar), cpu::Isa::scalar);
  const cpu::Isa best = cpu::cpu_has_avx512()      ? cpu::Isa::avx512
                        : cpu::cpu_has_avx2_vnni() ? cpu::Isa::avx2_vnni
                        : cpu::cpu_has_avx2()      ? cpu::Isa::avx2
                                                   : cpu::Isa::scalar;
  EXPECT_EQ(cpu::detect_isa(), best);
  EXPECT_EQ(cpu::supported_isas().back(), best);
  EXPECT_EQ(cpu::supported_isas().front(), cpu::Isa::scalar);
  if (cpu::cpu_has_avx2_vnni() || cpu::cpu_has_avx512()) {
    EXPECT_TRUE(cpu::cpu_has_avx2());
  }
  for (cpu::Isa isa : {cpu::Isa::avx2, cpu::Isa::avx2_vnni, cpu::Isa::avx512}) {
    if (cpu::cpu_supports(isa)) {
      EXPECT_EQ(cpu::checked_isa(isa), isa);
    } else {
      EXPECT_THROW((void)cpu::checked_isa(isa), td::Error);
    }
    EXPECT_TRUE(cpu::has_avx2(isa));
  }
  EXPECT_FALSE(cpu::has_avx2(cpu::Isa::scalar));
  EXPECT_TRUE(cpu::has_vnni(cpu::Isa::avx2_vnni));
  EXPECT_TRUE(cpu::has_vnni(cpu::Isa::avx512));
  EXPECT_FALSE(cpu::has_vnni(cpu::Isa::avx2));
  EXPECT_FALSE(cpu::has_vnni(cpu::Isa::scalar));
  // Not a tier: rejected by name, whatever the CPU.
  try {
    (void)cpu::checked_isa(cpu::Isa(7));
    FAIL() << "no error";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("7 (not a tier)"), std::string::npos) << e.what();
  }
}

// The BF16 row choice: fma, dpbf16 and exact stand, automatic resolves to this CPU's faster one
// (dpbf16 only on an AMD CPU with the avx512 tier), the names parse back (a command line's
// --bf16-dot), and a value that names no choice is rejected by name before any kernel runs.
TEST(Isa, Bf16DotChoiceResolves) {
  namespace cpu = td::cpu;
  EXPECT_EQ(cpu::resolved_bf16_dot(cpu::Bf16Dot::fma), cpu::Bf16Dot::fma);
  EXPECT_EQ(cpu::resolved_bf16_dot(cpu::Bf16Dot::dpbf16), cpu::Bf16Dot::dpbf16);
  EXPECT_EQ(cpu::resolved_bf16_dot(cpu::Bf16Dot::exact), cpu::Bf16Dot::exact);
  for (auto b :
       {cpu::Bf16Dot::automatic, cpu::Bf16Dot::fma, cpu::Bf16Dot::dpbf16, cpu::Bf16Dot::exact})
    EXPECT_EQ(cpu::bf16_dot_from_string("test", cpu::to_string(b)), b);
  try {
    cpu::bf16_dot_from_string("decode_step --bf16-dot", "double");
    ADD_FAILURE() << "no error";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'bf16_dot' = 'double'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("exact"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cpu::resolved_bf16_dot(cpu::Bf16Dot::automatic),
            cpu::cpu_bf16_dot_fast() ? cpu::Bf16Dot::dpbf16 : cpu::Bf16Dot::fma);
  if (!cpu::cpu_has_avx512()) {
    EXPECT_FALSE(cpu::cpu_bf16_dot_fast());
  }
  EXPECT_EQ(cpu::to_string(cpu::Bf16Dot::dpbf16), "dpbf16");
  const cpu::Context bad{nullptr, cpu::Isa::scalar, cpu::Bf16Dot(9)};
  try {
    cpu::dispatch(bad, [](auto) { ADD_FAILURE() << "ran with a bad choice"; });
    FAIL() << "no error";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'bf16_dot' = 9"), std::string::npos) << e.what();
  }
}

// The AVX-512 tier's CPUID reading agrees with the compiler's feature test where the compiler
// knows every feature (GCC: avx512f, bw, vl, vnni, bf16).
TEST(Isa, Avx512DetectionAgreesWithTheCompiler) {
#if TILEDECODE_X86 && defined(__GNUC__) && !defined(__clang__)
  const bool builtin = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                       __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx2") &&
                       __builtin_cpu_supports("fma");
  EXPECT_EQ(td::cpu::cpu_has_avx512(), builtin);
#else
  GTEST_SKIP() << "needs GCC's __builtin_cpu_supports on x86";
#endif
}

TEST(Isa, NamesRoundTrip) {
  namespace cpu = td::cpu;
  for (cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx2_vnni, cpu::Isa::avx512})
    EXPECT_EQ(cpu::isa_from_string("test", cpu::to_string(isa)), isa);
  EXPECT_EQ(cpu::to_string(cpu::Isa::avx512), "avx512");
  try {
    (void)cpu::isa_from_string("test", "avx512f");
    FAIL() << "no error";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("allowed scalar, avx2, avx2_vnni, avx512"),
              std::string::npos);
  }
}

// The compressor's request lanes (backend/cpu/lane_crew.hpp): L lanes as tasks of an executor,
// each running stages of tasks on its own lane executor while finished lanes help. Every task runs
// once, a lane sees all of its stage's outputs when the stage returns, on any executor (a pool of
// 1, 2, 3 or 7 threads, the serial one), with stages of 1 to 300 tasks and a heavy lane 0; a stage
// started from inside one of its own tasks runs inline.
TEST(LaneCrew, EveryTaskOnceAndEachStageCompleteWhenItReturns) {
  constexpr int kStages = 3;
  const auto tasks_of = [](int lane, int stage) {
    return lane == 0 ? 300 : 1 + (lane + stage) % 4;
  };
  td::SerialExecutor serial;
  for (std::size_t threads : {0u, 1u, 2u, 3u, 7u}) {
    std::unique_ptr<td::ThreadPool> pool;
    if (threads > 0) pool = std::make_unique<td::ThreadPool>(threads);
    td::Executor& ex = pool ? static_cast<td::Executor&>(*pool) : serial;
    within_seconds(120, [&] {
      for (int lanes = 1; lanes <= td::cpu::LaneCrew::kMaxLanes; ++lanes) {
        for (int rep = 0; rep < 4; ++rep) {
          std::vector<std::vector<std::vector<std::atomic<int>>>> hits(lanes);
          std::vector<std::vector<std::vector<std::int64_t>>> out(lanes);
          for (int l = 0; l < lanes; ++l) {
            hits[l] = std::vector<std::vector<std::atomic<int>>>(kStages);
            out[l].resize(kStages);
            for (int s = 0; s < kStages; ++s) {
              hits[l][s] = std::vector<std::atomic<int>>(tasks_of(l, s));
              out[l][s].assign(tasks_of(l, s), -1);
            }
          }
          std::vector<int> complete(lanes, 0);
          td::cpu::LaneCrew crew{lanes};
          td::parallel_for(ex, 0, lanes, 1, [&](std::int64_t l) {
            crew.start();
            for (int s = 0; s < kStages; ++s) {
              const int n = tasks_of(int(l), s);
              td::parallel_for(*crew.lane(int(l)), 0, n, 1, [&](std::int64_t k) {
                hits[l][s][k].fetch_add(1);
                std::int64_t v = k;  // some work, heavier on lane 0
                for (int r = 0; r < (l == 0 ? 2000 : 10); ++r) v = (v * 1103515245 + 12345) % 65536;
                volatile std::int64_t sink = v;
                (void)sink;
                out[l][s][k] = k + 1000 * (s + 1);
                if (k == 0) {  // a nested stage on the same lane: inline, every index once
                  std::atomic<int> inner{0};
                  td::parallel_for(*crew.lane(int(l)), 0, 5, 1,
                                   [&](std::int64_t) { inner.fetch_add(1); });
                  EXPECT_EQ(inner.load(), 5);
                }
              });
              bool all = true;  // the stage's outputs, read by the lane when it returns
              for (int k = 0; k < n; ++k) all &= out[l][s][k] == k + 1000 * (s + 1);
              complete[l] += all;
            }
            crew.finish_and_help();
          });
          for (int l = 0; l < lanes; ++l) {
            EXPECT_EQ(complete[l], kStages) << "threads " << threads << " lane " << l;
            for (int s = 0; s < kStages; ++s)
              for (auto& h : hits[l][s]) ASSERT_EQ(h.load(), 1) << "threads " << threads;
          }
        }
      }
    });
  }
}

}  // namespace
