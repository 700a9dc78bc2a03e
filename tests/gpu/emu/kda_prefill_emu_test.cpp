// The planned KDA prefill kernels (runtime/cuda/kda_prefill.cuh) on the host emulator (emu_prelude.h: a
// block's threads as fibers, 256 a prep block and 512 a scan block; mma.sync, the scan's wgmma (its B
// operands read through the descriptor and the 128-byte swizzle) and its tensor and bulk copies on mbarriers (the maps' zero fill past the
// last column included) through host stand-ins) against the recurrent delta rule of spec/MODEL.md K5–K6 in double: several sequences in
// one batch, partial chunks, cached states, head dims on and off the 32-column groups, gates from weak
// to K3's strong bounded one (γ to −320 in a chunk) and steeper (diagonal blocks on both of the prep's
// paths). Shared memory starts NaN before every block; outputs start NaN. Checks the kernels' logic
// (fragment layouts, the record, the triangular inverse, the scan's two levels and its copies landing
// as late or as early as a device may land them; the barriers, with the fibers in a random order and
// each warpgroup in turn as late as the barriers let it be) without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "runtime/cuda/kda_prefill.cuh"

namespace plow::cuda {
namespace {

struct KdaEmuCase {
  const char* name;
  int heads, d;
  std::vector<int> tokens;  // per sequence (slot s)
  float gate_low;           // log-decays uniform in (gate_low, 0)
  bool both_diagonal_paths = false;  // the data must send diagonal blocks to both of the prep's paths
};

struct KdaEmuData {
  int heads = 0, d = 0, rows = 0, width = 0;
  std::vector<float> q, k, v, g, beta, state;  // rows × width (beta: rows × heads); state: slots × heads·d·d
};

KdaEmuData make_data(const KdaEmuCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  KdaEmuData x;
  x.heads = c.heads;
  x.d = c.d;
  x.width = c.heads * c.d;
  for (int t : c.tokens) x.rows += t;
  const auto n = static_cast<size_t>(x.rows) * static_cast<size_t>(x.width);
  x.q.resize(n);
  x.k.resize(n);
  x.v.resize(n);
  x.g.resize(n);
  for (size_t i = 0; i < n; ++i) {
    x.q[i] = normal(rng);
    x.k[i] = normal(rng);
    x.v[i] = normal(rng);
    x.g[i] = c.gate_low * unit(rng);
  }
  x.beta.resize(static_cast<size_t>(x.rows * c.heads));
  for (float& b : x.beta) b = unit(rng);
  x.state.resize(c.tokens.size() * static_cast<size_t>(x.width) * static_cast<size_t>(c.d));
  for (float& s : x.state) s = 0.1f * normal(rng);
  return x;
}

// K5–K6 token by token in double: outputs [rows, width], states advanced in place.
std::vector<double> reference(const KdaEmuCase& c, const KdaEmuData& x, std::vector<double>& state) {
  std::vector<double> out(static_cast<size_t>(x.rows * x.width));
  const int d = x.d;
  int row = 0;
  for (size_t s = 0; s < c.tokens.size(); ++s) {
    for (int t = 0; t < c.tokens[s]; ++t, ++row) {
      for (int h = 0; h < x.heads; ++h) {
        double* S = state.data() + (s * static_cast<size_t>(x.heads) + static_cast<size_t>(h)) * static_cast<size_t>(d * d);
        const size_t at = static_cast<size_t>(row * x.width + h * d);
        double sq = 0, sk = 0;
        for (int j = 0; j < d; ++j) {
          sq += double(x.q[at + j]) * x.q[at + j];
          sk += double(x.k[at + j]) * x.k[at + j];
        }
        std::vector<double> qh(static_cast<size_t>(d)), kh(static_cast<size_t>(d));
        for (int j = 0; j < d; ++j) {
          qh[j] = x.q[at + j] / std::sqrt(sq + 1e-6) / std::sqrt(double(d));
          kh[j] = x.k[at + j] / std::sqrt(sk + 1e-6);
        }
        for (int j = 0; j < d; ++j) {
          const double decay = std::exp(double(x.g[at + j]));
          for (int col = 0; col < d; ++col) S[j * d + col] *= decay;
        }
        const double b = x.beta[static_cast<size_t>(row * x.heads + h)];
        for (int col = 0; col < d; ++col) {
          double pred = 0;
          for (int j = 0; j < d; ++j) pred += S[j * d + col] * kh[j];
          const double e = b * (x.v[at + col] - pred);
          for (int j = 0; j < d; ++j) S[j * d + col] += kh[j] * e;
        }
        for (int col = 0; col < d; ++col) {
          double o = 0;
          for (int j = 0; j < d; ++j) o += S[j * d + col] * qh[j];
          out[at + col] = o;
        }
      }
    }
  }
  return out;
}

// The batch's blocks one after another on the emulator, as launch_kda_prep and launch_kda_scan run
// them: every prep block, then every scan block.
std::vector<float> run_blocks(const KdaEmuCase& c, const KdaEmuData& x, std::vector<float>& state, uint64_t schedule_seed, int slow_group) {
  static EmuBlock block;  // fiber stacks: once
  block.schedule_seed = schedule_seed;
  block.slow_group = slow_group;
  std::vector<int32_t> chunk_row0, chunk_len, seq_chunk0, seq_chunks, seq_slot;
  int row = 0;
  for (size_t s = 0; s < c.tokens.size(); ++s) {
    seq_chunk0.push_back(static_cast<int32_t>(chunk_row0.size()));
    const int chunks = (c.tokens[s] + kKdaChunk - 1) / kKdaChunk;
    seq_chunks.push_back(chunks);
    seq_slot.push_back(static_cast<int32_t>(s));
    for (int k = 0; k < chunks; ++k) {
      chunk_row0.push_back(row + k * kKdaChunk);
      chunk_len.push_back(std::min(kKdaChunk, c.tokens[s] - k * kKdaChunk));
    }
    row += c.tokens[s];
  }
  std::vector<float> out(static_cast<size_t>(x.rows * x.width), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> records(chunk_row0.size() * static_cast<size_t>(x.heads) * kKdaRecFloats, std::numeric_limits<float>::quiet_NaN());
  KdaPrefillArgs a;
  a.q = x.q.data();
  a.k = x.k.data();
  a.v = x.v.data();
  a.g = x.g.data();
  a.beta = x.beta.data();
  a.q_stride = a.k_stride = a.v_stride = a.g_stride = x.width;
  a.beta_stride = x.heads;
  a.out = out.data();
  a.out_stride = x.width;
  a.records = records.data();
  a.chunk_row0 = chunk_row0.data();
  a.chunk_len = chunk_len.data();
  a.seq_chunk0 = seq_chunk0.data();
  a.seq_chunks = seq_chunks.data();
  a.seq_slot = seq_slot.data();
  a.state = state.data();
  a.state_slot_floats = static_cast<int64_t>(x.width) * x.d;
  a.chunks = static_cast<int32_t>(chunk_row0.size());
  a.seqs = static_cast<int32_t>(c.tokens.size());
  a.heads = x.heads;
  a.d = x.d;
  a.out_act = kAF32;
  using kda_planned::kKdaPrefillThreads, kda_planned::kKdaScanThreads;
  std::vector<float> smem(static_cast<size_t>(std::max(kda_planned::kKdaPrepBytes, kda_planned::kKdaScanBytes)) / sizeof(float));
  const auto check_copies = [&](const std::string& where) {
    for (int t = 0; t < std::max(kKdaPrefillThreads, kKdaScanThreads); ++t) EXPECT_TRUE(emu_cp.pending[t].empty()) << where << ": copies never waited for";
    EXPECT_TRUE(emu_mbar_idle()) << where << ": bulk copies never waited for";
  };
  for (int item = 0; item < a.chunks * a.heads; ++item) {
    std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
    block.run([&] { kda_planned::kda_prep_block(a, smem.data(), item); }, kKdaPrefillThreads);
    check_copies("prep item " + std::to_string(item));
  }
  // The scan's tensor maps as launch_kda_scan encodes them, read by the emulator's tensor copies.
  const kda_planned::KdaScanMaps maps = kda_planned::kda_scan_maps(a, [](const float* base, int64_t rows, int64_t cols, int box_cols, int box_rows) {
    return TensorMap{reinterpret_cast<const char*>(base), rows, cols, cols, 4, box_cols, box_rows};
  });
  for (int seq = 0; seq < a.seqs; ++seq) {
    for (int h = 0; h < a.heads; ++h) {
      for (int group = 0; group * kda_planned::kKdaScanCols < a.d; ++group) {
        std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
        block.run([&] { kda_planned::kda_scan_block(a, maps, smem.data(), group, h, seq); }, kKdaScanThreads);
        check_copies("scan block " + std::to_string(seq) + "/" + std::to_string(h) + "/" + std::to_string(group));
      }
    }
  }
  return out;
}

// Diagonal 16×16 blocks of (chunk, head, channel half) whose γ falls by more than kDiagMmaSpread in
// some channel (the prep block's SIMT path), and those that do not (its tensor-core path).
std::pair<int, int> steep_and_gentle_blocks(const KdaEmuCase& c, const KdaEmuData& x) {
  int steep = 0, gentle = 0, row0 = 0;
  for (int tokens : c.tokens) {
    for (int start = 0; start < tokens; start += kKdaChunk) {
      const int n = std::min(kKdaChunk, tokens - start);
      for (int h = 0; h < x.heads; ++h) {
        for (int half = 0; half < 2; ++half) {
          for (int first = 0; first < n; first += 16) {
            const float* g = x.g.data() + static_cast<size_t>((row0 + start) * x.width + h * x.d);
            (kda_diag_block_steep(g, x.width, first, n, 64 * half, std::min(64 * half + 64, x.d)) ? steep : gentle) += 1;
          }
        }
      }
    }
    row0 += tokens;
  }
  return {steep, gentle};
}

// Outputs and final states within 2e-5 of their largest magnitude (the chunked form in fp32 with
// 3xTF32 products against the recurrence in double), every output written and finite. Copies land
// as late (at their wait) and as early (at issue) as a device may land them.
TEST(KdaPrefillEmu, MatchesTheRecurrentDeltaRule) {
  const std::vector<KdaEmuCase> cases = {
      {"2 heads of 128, K3-strength gate", 2, 128, {65, 130, 16}, -5.0f},
      {"2 heads of 72, weak gate", 2, 72, {64, 17}, -0.05f},
      {"1 head of 32, Kimi-like gate", 1, 32, {200}, -1.0f},
      {"2 heads of 128, steep gate", 2, 128, {130, 40}, -6.0f, true},
  };
  for (const KdaEmuCase& c : cases) {
    const KdaEmuData x = make_data(c, 7);
    if (c.both_diagonal_paths) {
      const auto [steep, gentle] = steep_and_gentle_blocks(c, x);
      std::printf("  %s: %d diagonal blocks on SIMT, %d on tensor cores\n", c.name, steep, gentle);
      EXPECT_GT(steep, 0);
      EXPECT_GT(gentle, 0);
    }
    // Copies landing at their wait (the latest a device lands them) or at issue (the earliest), fibers
    // in order; then at their wait with a random half of the fibers a pass (warpgroups drifting apart),
    // and with each warpgroup in turn as late as the barriers let it be.
    for (int mode = 0; mode < 7; ++mode) {
      const bool eager = mode == 1;
      const int slow = mode >= 3 ? mode - 3 : -1;
      emu_cp.eager = emu_mbar_eager = eager;
      const std::string where = std::string(c.name) + (mode == 0   ? ", copies at their wait"
                                                       : mode == 1 ? ", copies at issue"
                                                       : mode == 2 ? ", copies at their wait, fibers in random order"
                                                                   : ", copies at their wait, warpgroup " + std::to_string(slow) + " last");
      std::vector<double> want_state(x.state.begin(), x.state.end());
      const std::vector<double> want = reference(c, x, want_state);
      std::vector<float> state = x.state;
      const std::vector<float> have = run_blocks(c, x, state, mode == 2 ? 0x9E3779B97F4A7C15ull : 0, slow);
      double scale = 0, state_scale = 0, worst = 0, worst_state = 0;
      for (double w : want) scale = std::max(scale, std::fabs(w));
      for (double w : want_state) state_scale = std::max(state_scale, std::fabs(w));
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_TRUE(std::isfinite(have[i])) << where << " output " << i;
        worst = std::max(worst, std::fabs(have[i] - want[i]));
      }
      for (size_t i = 0; i < want_state.size(); ++i) worst_state = std::max(worst_state, std::fabs(state[i] - want_state[i]));
      std::printf("  %s: output error %.3g of scale %.3g, state error %.3g of %.3g\n", where.c_str(), worst, scale, worst_state, state_scale);
      EXPECT_LE(worst, 2e-5 * scale) << where;
      EXPECT_LE(worst_state, 2e-5 * state_scale) << where;
    }
  }
  emu_cp.eager = emu_mbar_eager = false;
}

}  // namespace
}  // namespace plow::cuda
