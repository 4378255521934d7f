#pragma once
// The a2a3 implementations of the vocabulary ops several programs share, as sequences of the
// vector core's typed instructions (machine.hpp): Q8 of a row, the RMS scale of a row, and the
// interleaved RoPE rotation with the head-invariant rotation rows (spec §8.6 item 3 / §7.4
// `qr_rope`: out[j] = x[j] * cos[j >> 1] + x[j ^ 1] * sign[j] * sin[j >> 1]).

#include <string_view>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::a2a3 {

// Per-row RMS scales: r (one value per row of x) = 1 / sqrt(Σ_c x(row, c)² / n + eps) over the
// rows of x (rows, n); sq (rows, n) is scratch.
inline void rms_scale(VectorCore& v, Sub<float> r, Sub<float> x, Sub<float> sq, float eps) {
  v.vmul(sq, x, x, "square");
  v.vrow_sum(r, sq, "sum_sq");
  v.vmuls(r, r, 1.0f / float(x.cols), "mean");
  v.vadds(r, r, eps, "eps");
  v.vsqrt(r, r, "sqrt");
  v.vsdiv(r, 1.0f, r, "rsqrt");
}

// Q8 of every row of x (rows, n) (spec §2; bit-identical to core quantize_q8 for NaN-free rows):
// q (rows, n) INT8, sq (one per row) = 127 / max(max|x|, 1e-4), dq (one per row) = 1 / sq; ab
// (rows, n) is scratch.
inline void quantize_rows(VectorCore& v, Sub<float> x, Sub<float> ab, Sub<std::int8_t> q,
                          Sub<float> sq, Sub<float> dq) {
  v.vabs(ab, x, "abs");
  v.vrow_max(sq, ab, "amax");
  v.vmaxs(sq, sq, 1e-4f, "amax_floor");
  v.vsdiv(sq, 127.0f, sq, "q_scale");
  v.vsdiv(dq, 1.0f, sq, "dq_scale");
  v.vmul_rows(ab, x, sq, "mul_scale");
  v.vmins(ab, ab, 127.0f, "clamp_hi");
  v.vmaxs(ab, ab, -127.0f, "clamp_lo");
  v.vcast(q, ab, "cast_i8");
}

// The rotation rows of one position from the BF16 table (rope_cs): rot (2, 64) = interleaved cos
// (cos[j >> 1]) and the sign-folded sin (sign[j] * sin[j >> 1]): sign = (-1, +1) for the forward
// rotation, (+1, -1) for the inverse. half (2, 32) FP32 and bf (2, 32) BF16 are scratch; the table
// row's first 32 columns are read.
inline void rope_rows(VectorCore& v, Tile<float> rot, Tile<float> half, Tile<bf16> bf,
                      const RopeTableView& table, index_t pos, bool inverse) {
  v.copy_in(bf, 0, ConstView<bf16, 2>(table.cos_row(pos), {1, 32}), "cos_in");
  v.copy_in(bf, 1, ConstView<bf16, 2>(table.sin_row(pos), {1, 32}), "sin_in");
  v.vcast(Sub<float>(half), Sub<bf16>(bf), "cast_f32");
  v.vdup_pairs(Sub<float>(rot), Sub<float>(half), "interleave");
  v.vsign_pairs(rows_of(rot, 1, 1), rows_of(rot, 1, 1), inverse ? 1.0f : -1.0f,
                inverse ? -1.0f : 1.0f, "fold_sign");
}

// x (rows, 64) <- x * cos + swap_pairs(x) * sin_folded, with rot (2, 64) from rope_rows; tmp
// (rows, 64) is scratch.
inline void rope_rotate(VectorCore& v, Sub<float> x, Sub<float> tmp, Tile<float> rot) {
  v.vswap_pairs(tmp, x, "rope_swap");
  v.vmul_cols(x, x, rows_of(rot, 0, 1), "rope_cos");
  v.vmul_cols(tmp, tmp, rows_of(rot, 1, 1), "rope_sin");
  v.vadd(x, x, tmp, "rope_add");
}

}  // namespace tiledecode::a2a3
