#pragma once
// Hardware facts of the Ascend a2a3 class (Atlas A2 = Ascend 910B, Atlas A3 = Ascend 910C: one
// die of the 910C is a 910B-class die; the model describes one die, the unit a kernel launches on).
//
// Every constant of the cost model lives here, each with its public source. Nothing in this file
// is fitted to a measured kernel latency. Where public sources disagree the documented value is
// taken and the range noted; where no vendor figure exists the value is marked ESTIMATE with the
// reasoning and the plausible range, so a reader can see what the prediction rests on.
//
// Sources
//  [S1] Huawei CANN "Ascend C operator development guide" (hiascend.com, CANN 7.0/8.0), chapters
//       "Hardware architecture / separated architecture (AIC:AIV = 1:2) of Atlas A2 training
//       products", "Memory hierarchy", and the `platform_ascendc::PlatformAscendC` API
//       (GetCoreNumAic / GetCoreNumAiv / GetCoreMemSize).
//  [S2] CANN SoC description files shipped with the toolkit, `data/platform_config/
//       Ascend910B2.ini` ([SoCInfo] ai_core_cnt / cube_core_cnt / vector_core_cnt, l2_size,
//       [AICoreSpec] cube_freq, l0_a_size, l0_b_size, l0_c_size, l1_size, ub_size, ubblock_size).
//  [S3] H. Liao, J. Tu, J. Xia, X. Zhou, "DaVinci: A Scalable Architecture for Neural Network
//       Computing", Hot Chips 31 (2019); H. Liao et al., "Ascend: a Scalable and Unified
//       Architecture for Ubiquitous Deep Neural Network Computing", HPCA 2021.
//  [S4] Huawei Atlas 800T A2 / Atlas 300T A2 product data sheets and public 910B/910C spec
//       summaries (HBM capacity and bandwidth, FP16/INT8 peak).
//  [S5] CANN "Ascend C best practices: data movement" (hiascend.com): 512-byte aligned GM
//       addresses and copies of >= 16 KiB per DataCopy to approach peak bandwidth; small copies are
//       bound by instruction issue and latency.
//  [S6] CANN "Ascend C API reference": CrossCoreSetFlag / CrossCoreWaitFlag (AIC<->AIV sync via
//       the FFTS flag hardware), Sort32 / MrgSort (32-element sort, 4-way merge of sorted
//       (score, index) lists), DataCopy 32-byte block granularity in UB.

#include <cstdint>

namespace tiledecode::a2a3 {

inline constexpr std::int64_t kKiB = 1024;
inline constexpr std::int64_t kMiB = 1024 * 1024;

struct ArchFacts {
  // --- cores -------------------------------------------------------------------------------
  // 910B2/910B1: 24 AI cores; in the separated architecture each is 1 cube core (AIC) plus 2
  // vector cores (AIV) -> 24 AIC + 48 AIV [S1][S2]. Range: 910B3/B4 have 20 AIC + 40 AIV.
  int cube_cores = 24;
  int vector_per_cube = 2;
  constexpr int vector_cores() const { return cube_cores * vector_per_cube; }

  // AI-core clock. [S2] cube_freq = 1800 MHz for 910B2; cross-check: 4096 FP16 MAC/cycle x 2 x 24
  // cores x 1.8 GHz = 354 TFLOPS, inside the 313-376 TFLOPS FP16 range quoted for 910B SKUs [S4].
  double clock_hz = 1.8e9;

  // --- local memories (bytes, per core) [S1][S2] ---------------------------------------------
  std::int64_t l1_bytes = 512 * kKiB;   // per cube core
  std::int64_t l0a_bytes = 64 * kKiB;   // per cube core
  std::int64_t l0b_bytes = 64 * kKiB;   // per cube core
  std::int64_t l0c_bytes = 128 * kKiB;  // per cube core (INT32/FP32 accumulators)
  std::int64_t ub_bytes = 192 * kKiB;   // per vector core (910A had 256 KiB; A2 has 192 KiB)
  // UB is addressed in 32-byte blocks: every UB buffer and every DataCopy length is a multiple of
  // 32 bytes [S1][S6]. The model rounds each UB/L1 buffer up to this and checks alignment.
  std::int64_t local_align = 32;

  // --- GM / L2 ---------------------------------------------------------------------------------
  // HBM2e 64 GB at ~1.6 TB/s per 910B die [S4]; published range 1.2-1.8 TB/s across SKUs
  // (910C: 2 dies, ~3.2 TB/s in total, i.e. the same per die).
  double hbm_bytes_per_s = 1.6e12;
  // L2 (shared by all cores of the die): l2_size = 201326592 = 192 MiB [S2].
  std::int64_t l2_bytes = 192 * kMiB;
  // ESTIMATE: no vendor L2 bandwidth figure is public; on-die SRAM caches of this class deliver a
  // few times HBM. Taken as 2.5x HBM = 4 TB/s (plausible 3-6 TB/s). Used only for the
  // cube->vector ring workspace, which stays L2-resident (a few 32 KiB slots re-written in place).
  double l2_bytes_per_s = 4.0e12;
  // ESTIMATE: bytes/cycle one core's DMA engine (MTE2 / MTE3 / FIXPIPE) moves from/to GM when it
  // is the only requester. 128 B/cycle = 230 GB/s at 1.8 GHz; 24 cores x 230 GB/s > HBM, so with
  // all cores busy the HBM share, not the port, limits (the model takes the lower of the two).
  double gm_port_bytes_per_cycle = 128.0;

  // --- compute -------------------------------------------------------------------------------
  // Cube: one 16x16x16 FP16/BF16 fractal MAC per cycle = 4096 MAC/cycle; INT8 doubles the K depth
  // (16x32x16) = 8192 MAC/cycle [S3]; consistent with 910B's ~2x INT8 TOPS vs FP16 TFLOPS [S4].
  double cube_bf16_macs_per_cycle = 4096.0;
  double cube_int8_macs_per_cycle = 8192.0;
  // Vector unit: 2048-bit SIMD = 256 bytes per cycle (64 FP32 / 128 FP16 lanes) [S3].
  double vector_bytes_per_cycle = 256.0;
  // ESTIMATE: fixed cycles per vector instruction (issue + pipeline fill of a repeat sequence).
  // Not published; ~10-20 cycles is what a short in-order SIMD pipeline costs.
  double vector_op_overhead_cycles = 16.0;
  // ESTIMATE: transcendental (exp) throughput is a fraction of plain FP32 ops; taken 1/4
  // (special-function units usually run at 1/4-1/8 of the ALU rate).
  double vector_exp_cost_factor = 4.0;
  // Sort32: one 32-element (score, index) group per repeat; MrgSort: 4-way merge. ESTIMATE of
  // cycles per element: sort 1 cycle/element (a 32-element bitonic network per ~32 cycles),
  // merge 0.5 cycle/element per 4-way pass [S6 gives the instructions, not their rates].
  double sort32_cycles_per_element = 1.0;
  double merge_cycles_per_element = 0.5;
  // ESTIMATE: scalar unit, 1 simple op per cycle; a scalar GM read (metadata fetch) costs one DMA
  // latency (below).
  double scalar_cycles_per_op = 1.0;

  // --- on-chip moves ---------------------------------------------------------------------------
  // ESTIMATE: MTE1 L1 -> L0A/L0B at 256 B/cycle (the cube consumes 16x16 BF16 of A and of B =
  // 1 KiB per cycle at full rate; L0 reuse makes 256 B/cycle sufficient, a common design point).
  double mte1_bytes_per_cycle = 256.0;
  // ESTIMATE: FIXPIPE L0C -> GM/ring at 128 B/cycle (same class as the GM port).
  double fixpipe_bytes_per_cycle = 128.0;

  // --- overheads that dominate kernels of this size --------------------------------------------
  // ESTIMATE: per-DMA-instruction issue cost on an MTE pipe (descriptor build + address
  // translation), cycles. Sparse row gathers (one 1 KiB row per DataCopy) are bound by this,
  // not by bandwidth [S5]. Plausible 20-60 cycles.
  double dma_issue_cycles = 32.0;
  // ESTIMATE: GM round-trip latency of a DMA, cycles (~0.5 us, typical HBM + NoC latency). It
  // delays the data's readiness but does not occupy the pipe (DMAs are pipelined).
  double dma_latency_cycles = 900.0;
  // Minimum efficient burst [S5]: a transfer shorter than this costs as much pipe time as this
  // many bytes (GM is read in 512-byte aligned bursts).
  std::int64_t min_burst_bytes = 512;
  // ESTIMATE: AIC<->AIV cross-core flag (CrossCoreSetFlag -> CrossCoreWaitFlag) latency,
  // cycles [S6 documents the mechanism; no latency is published]. ~0.2 us; plausible 0.1-1 us.
  double cross_core_sync_cycles = 400.0;
  // ESTIMATE: intra-core set_flag/wait_flag between two pipes, cycles.
  double pipe_sync_cycles = 8.0;
  // ESTIMATE: kernel (scope) launch/dispatch overhead on the device task scheduler, microseconds:
  // the gap between the end of one kernel and the start of the next in a captured task stream.
  // No vendor figure; public profiler traces of CANN task streams show a few us. 3 us, plausible
  // 2-10 us (the upper end for host-launched, non-captured kernels).
  double launch_overhead_us = 3.0;

  constexpr double cycles_to_us(double cycles) const { return cycles / clock_hz * 1e6; }
};

// The facts of the modelled chip (910B2-class die).
inline constexpr ArchFacts kArch{};

static_assert(kArch.vector_cores() == 48);
static_assert(kArch.ub_bytes == 196608);

}  // namespace tiledecode::a2a3
