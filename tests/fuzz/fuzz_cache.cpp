// Fuzz target: paged cache write and gathers (paged/cache.hpp) with arbitrary slot mappings,
// window index lists, logical row lists, block-table rows, pool shapes and row strides.
// Invariants: a call either throws tiledecode::Error having written nothing (pool, dst and
// valid flags byte-identical), or produces exactly what a plain model predicts; it throws iff
// the model says some index is out of range; nothing outside the views is written — the pool
// view has padding between rows and canaries around the allocation, both must stay intact;
// gather_windows gives identical bytes for 1 and 3 threads.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "tiledecode/paged/cache.hpp"

namespace td = tiledecode;
namespace tp = tiledecode::paged;
using td::index_t;

namespace {

using tdfuzz::g_verbose;  // TDFUZZ_DUMP=1 prints every error message
using tdfuzz::kFill;
using tdfuzz::threw_error;

template <class I>
I slot_value(FuzzedDataProvider& in, index_t rows) {
  switch (in.ConsumeIntegralInRange(0, 9)) {
    case 0:
      return I(-1);
    case 1:
      return I(-2);
    case 2:
      return static_cast<I>(rows);
    case 3:
      return in.ConsumeIntegral<I>();
    default:
      return static_cast<I>(in.ConsumeIntegralInRange<index_t>(-1, std::max<index_t>(0, rows - 1)));
  }
}

// A pool of `rows` x `width` elements whose rows are `stride >= width` apart; the gap after each
// row and the canaries around the allocation must never be written.
template <class E>
struct Pool {
  index_t rows, width, stride;
  tdfuzz::Guarded<E> mem;
  Pool(index_t r, index_t w, index_t pad)
      : rows(r), width(w), stride(w + pad), mem(std::size_t(r * (w + pad)), 0xC3) {
    // Distinct contents so a wrong source row is visible.
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < width; ++j) {
        const std::uint32_t v = std::uint32_t(i * 131 + j * 7 + 1);
        std::memcpy(&mem[std::size_t(i * stride + j)], &v, std::min(sizeof(E), sizeof(v)));
      }
  }
  td::View<E, 2> view() { return td::View<E, 2>(mem.data(), {rows, width}, {stride, 1}); }
  const E* row(index_t i) { return mem.data() + i * stride; }
  bool gaps_intact() {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(mem.data());
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = width * index_t(sizeof(E)); j < stride * index_t(sizeof(E)); ++j)
        if (p[i * stride * index_t(sizeof(E)) + j] != 0xC3) return false;
    return true;
  }
};

template <class E>
bool row_equals(const E* a, const E* b, index_t width) {
  if (width == 0) return true;  // memcmp on a null pointer is undefined even for 0 bytes
  return std::memcmp(a, b, std::size_t(width) * sizeof(E)) == 0;
}
template <class E>
bool row_is_zero(const E* a, index_t width) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(a);
  return std::all_of(p, p + width * index_t(sizeof(E)), [](unsigned char c) { return c == 0; });
}

template <class E>
void fuzz_write(FuzzedDataProvider& in, index_t pool_rows, index_t width, index_t pad) {
  Pool<E> pool(pool_rows, width, pad);
  const index_t t_rows = in.ConsumeIntegralInRange<index_t>(0, 12);
  const index_t n_slots = in.ConsumeProbability<float>() < 0.05f ? t_rows + 1 : t_rows;
  const index_t src_width = in.ConsumeProbability<float>() < 0.05f ? width + 1 : width;
  std::vector<E> src(std::size_t(t_rows * src_width));
  for (std::size_t i = 0; i < src.size(); ++i) {
    const std::uint32_t v = std::uint32_t(0x9E3779B9u * (i + 1));
    std::memcpy(&src[i], &v, std::min(sizeof(E), sizeof(v)));
  }
  std::vector<std::int64_t> slots(static_cast<std::size_t>(n_slots));
  for (auto& s : slots) s = slot_value<std::int64_t>(in, pool_rows);
  const auto before = pool.mem.snapshot();
  const bool threw = threw_error([&] {
    tp::write_cache<E>(pool.view(), td::ConstView<E, 2>(src.data(), {t_rows, src_width}),
                       td::ConstView<std::int64_t, 1>(slots.data(), {n_slots}));
  });
  bool valid = n_slots == t_rows && src_width == width;
  for (auto s : slots) valid = valid && s >= -1 && s < pool_rows;
  TDFUZZ_CHECK(threw == !valid, threw);
  TDFUZZ_CHECK(pool.mem.canaries_intact() && pool.gaps_intact());
  if (threw) {
    TDFUZZ_CHECK(pool.mem.same_as(before));
    return;
  }
  // Model: in token order, the last writer of a slot wins; other rows keep their contents.
  std::vector<index_t> last(std::size_t(pool_rows), -1);
  for (index_t t = 0; t < t_rows; ++t)
    if (slots[t] >= 0) last[std::size_t(slots[t])] = t;
  Pool<E> ref(pool_rows, width, pad);
  for (index_t r = 0; r < pool_rows; ++r) {
    const E* want = last[r] >= 0 ? src.data() + last[r] * width : ref.row(r);
    TDFUZZ_CHECK(row_equals(pool.row(r), want, width), r, last[r]);
  }
}

template <class E, class I>
void fuzz_gather_rows(FuzzedDataProvider& in, index_t pool_rows, index_t width, index_t pad) {
  Pool<E> pool(pool_rows, width, pad);
  const index_t n = in.ConsumeIntegralInRange<index_t>(0, 16);
  const index_t dst_n = in.ConsumeProbability<float>() < 0.05f ? n + 1 : n;
  std::vector<I> slots(static_cast<std::size_t>(n));
  for (auto& s : slots) s = slot_value<I>(in, pool_rows);
  tdfuzz::Guarded<E> dst(std::size_t(dst_n * width), kFill);
  tdfuzz::Guarded<std::uint8_t> valid(std::size_t(n), kFill);
  const auto pool_before = pool.mem.snapshot();
  const bool threw = threw_error([&] {
    tp::gather_rows<E>(td::View<E, 2>(dst.data(), {dst_n, width}),
                       td::View<std::uint8_t, 1>(valid.data(), {n}), pool.view(),
                       td::ConstView<I, 1>(slots.data(), {n}));
  });
  bool ok = dst_n == n;
  for (auto s : slots) ok = ok && s >= -1 && index_t(s) < pool_rows;
  TDFUZZ_CHECK(threw == !ok, threw);
  TDFUZZ_CHECK(pool.mem.same_as(pool_before));  // the pool is only read
  TDFUZZ_CHECK(dst.canaries_intact() && valid.canaries_intact());
  if (threw) {
    TDFUZZ_CHECK(dst.body_is(kFill) && valid.body_is(kFill));
    return;
  }
  for (index_t i = 0; i < n; ++i) {
    const E* d = dst.data() + i * width;
    if (slots[i] < 0) {
      TDFUZZ_CHECK(valid[i] == 0 && row_is_zero(d, width), i);
    } else {
      TDFUZZ_CHECK(valid[i] == 1 && row_equals(d, pool.row(slots[i]), width), i, slots[i]);
    }
  }
}

template <class E>
void fuzz_gather_windows(FuzzedDataProvider& in, index_t pool_rows, index_t width, index_t pad) {
  static td::ThreadPool pool3(3);
  Pool<E> pool(pool_rows, width, pad);
  const index_t T = in.ConsumeIntegralInRange<index_t>(0, 9),
                K = in.ConsumeIntegralInRange<index_t>(0, 9);
  const index_t dst_k = in.ConsumeProbability<float>() < 0.05f ? K + 1 : K;
  std::vector<std::int32_t> idx(std::size_t(T * K));
  for (auto& s : idx) s = slot_value<std::int32_t>(in, pool_rows);
  bool ok = dst_k == K;
  for (auto s : idx) ok = ok && s >= -1 && s < pool_rows;
  std::vector<unsigned char> first_dst, first_valid;
  for (int threads : {1, 3}) {
    tdfuzz::Guarded<E> dst(std::size_t(T * dst_k * width), kFill);
    tdfuzz::Guarded<std::uint8_t> valid(std::size_t(T * K), kFill);
    td::cpu::Context ctx{threads == 1 ? nullptr : &pool3, td::cpu::Isa::scalar};
    const bool threw = threw_error([&] {
      tp::gather_windows<E>(td::View<E, 3>(dst.data(), {T, dst_k, width}),
                            td::View<std::uint8_t, 2>(valid.data(), {T, K}), pool.view(),
                            td::ConstView<std::int32_t, 2>(idx.data(), {T, K}), ctx);
    });
    TDFUZZ_CHECK(threw == !ok, threw);
    TDFUZZ_CHECK(dst.canaries_intact() && valid.canaries_intact());
    if (threw) {
      TDFUZZ_CHECK(dst.body_is(kFill) && valid.body_is(kFill));
      continue;
    }
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < K; ++k) {
        const E* d = dst.data() + (t * K + k) * width;
        const std::int32_t s = idx[t * K + k];
        if (s < 0) {
          TDFUZZ_CHECK(valid[t * K + k] == 0 && row_is_zero(d, width), t, k);
        } else {
          TDFUZZ_CHECK(valid[t * K + k] == 1 && row_equals(d, pool.row(s), width), t, k);
        }
      }
    if (threads == 1) {
      first_dst = dst.snapshot();
      first_valid = valid.snapshot();
    } else {
      TDFUZZ_CHECK(dst.same_as(first_dst) && valid.same_as(first_valid));
    }
  }
}

template <class E>
void fuzz_gather_logical(FuzzedDataProvider& in, index_t blocks, index_t page, index_t width,
                         index_t pad) {
  const index_t extra = in.ConsumeProbability<float>() < 0.05f ? 1 : 0;  // rows % page != 0
  const index_t pool_rows = blocks * page + extra;
  Pool<E> pool(pool_rows, width, pad);
  static constexpr index_t kPages[] = {1, 4, 7, 0};
  const index_t call_page =
      in.ConsumeProbability<float>() < 0.05f ? in.PickValueInArray(kPages) : page;
  const index_t cols = in.ConsumeIntegralInRange<index_t>(0, 8);
  std::vector<std::int32_t> table(static_cast<std::size_t>(cols));
  for (auto& e : table) e = slot_value<std::int32_t>(in, blocks);
  const index_t n = in.ConsumeIntegralInRange<index_t>(0, 16);
  std::vector<std::int32_t> rows(static_cast<std::size_t>(n));
  for (auto& r : rows) r = slot_value<std::int32_t>(in, (cols + 1) * std::max<index_t>(1, page));
  tdfuzz::Guarded<E> dst(std::size_t(n * width), kFill);
  tdfuzz::Guarded<std::uint8_t> valid(std::size_t(n), kFill);
  const bool threw = threw_error([&] {
    tp::gather_logical_rows<E>(td::View<E, 2>(dst.data(), {n, width}),
                               td::View<std::uint8_t, 1>(valid.data(), {n}), pool.view(),
                               td::ConstView<std::int32_t, 1>(table.data(), {cols}),
                               td::ConstView<std::int32_t, 1>(rows.data(), {n}), call_page);
  });
  // Model: physical row of each logical row, -1 invalid, -2 error.
  bool ok = call_page >= 1 && pool_rows % call_page == 0;
  std::vector<index_t> phys(std::size_t(n), -1);
  if (ok) {
    const index_t nblk = pool_rows / call_page;
    for (index_t i = 0; i < n; ++i) {
      const index_t r = rows[i];
      if (r < -1) ok = false;
      if (r < 0 || r / call_page >= cols) continue;
      const index_t blk = table[r / call_page];
      if (blk < -1 || blk >= nblk) ok = false;
      if (blk >= 0) phys[i] = blk * call_page + r % call_page;
    }
  }
  TDFUZZ_CHECK(threw == !ok, threw);
  TDFUZZ_CHECK(dst.canaries_intact() && valid.canaries_intact() && pool.gaps_intact());
  if (threw) {
    TDFUZZ_CHECK(dst.body_is(kFill) && valid.body_is(kFill));
    return;
  }
  for (index_t i = 0; i < n; ++i) {
    const E* d = dst.data() + i * width;
    if (phys[i] < 0) {
      TDFUZZ_CHECK(valid[i] == 0 && row_is_zero(d, width), i);
    } else {
      TDFUZZ_CHECK(valid[i] == 1 && row_equals(d, pool.row(phys[i]), width), i, phys[i]);
    }
  }
}

template <class E>
void fuzz_all(FuzzedDataProvider& in) {
  static constexpr index_t kPages[] = {1, 4, 7};
  const index_t page = in.PickValueInArray(kPages);
  const index_t blocks = in.ConsumeIntegralInRange<index_t>(0, 6);
  const index_t width = in.ConsumeIntegralInRange<index_t>(0, 40);
  const index_t pad = in.ConsumeIntegralInRange<index_t>(0, 3);
  const index_t pool_rows = blocks * page;
  switch (in.ConsumeIntegralInRange(0, 4)) {
    case 0:
      return fuzz_write<E>(in, pool_rows, width, pad);
    case 1:
      return fuzz_gather_rows<E, std::int32_t>(in, pool_rows, width, pad);
    case 2:
      return fuzz_gather_rows<E, std::int64_t>(in, pool_rows, width, pad);
    case 3:
      return fuzz_gather_windows<E>(in, pool_rows, width, pad);
    default:
      return fuzz_gather_logical<E>(in, blocks, page, width, pad);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_verbose = std::getenv("TDFUZZ_DUMP") != nullptr;
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange(0, 2)) {
    case 0:
      fuzz_all<std::uint16_t>(in);
      break;  // BF16 rows
    case 1:
      fuzz_all<std::int8_t>(in);
      break;  // INT8 index rows
    default:
      fuzz_all<float>(in);
      break;  // FP32 state rows / scales
  }
  return 0;
}
