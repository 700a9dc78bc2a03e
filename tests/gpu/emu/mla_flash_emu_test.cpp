// The fused MLA prefill attention (runtime/cuda/mla_flash.cuh) on the host emulator (emu_prelude.h:
// a block's 128 threads as fibers, the PTX through host stand-ins) against a plain causal attention
// over a cached prefix (fp32 inputs as the kernel sees them, double sums, unrounded softmax). Checks
// the kernel's logic without a GPU: fragment layouts, the causal bound, the online softmax, the
// two-stage pipeline (copies landing as late or as early as a device may land them), zero fill past
// the bound (NaN rows follow the last head), NaN in the values' padding columns (the keys' are zero, as
// the expansion writes them), the output's rows and rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "runtime/cuda/mla_flash.cuh"

namespace plow::cuda {
namespace {

struct FlashCase {
  const char* name;
  int heads, qk, dv, context, tokens;
  bool f16;
};

// One sequence's buffers in the layouts of mla_flash.h: q rows of stride heads·qk + 5 (NaN past
// heads·qk), keys [heads][visible][ld_k] (zero past qk), values [heads][visible][ld_v] (NaN past dv;
// ld rounded up to 8), each followed by a NaN row.
struct FlashInputs {
  std::vector<float> q;
  std::vector<uint16_t> keys, values;
  int64_t q_stride = 0;
  int ld_k = 0, ld_v = 0;
};

uint16_t to_bits(float v, bool f16) { return f16 ? f32_to_f16(v) : f32_to_bf16(v); }
float from_bits(uint16_t b, bool f16) { return f16 ? f16_to_f32(b) : bf16_to_f32(b); }

FlashInputs make_inputs(const FlashCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const uint16_t nan_bits = c.f16 ? 0x7e00 : 0x7fc0;
  const int visible = c.context + c.tokens;
  FlashInputs in;
  in.q_stride = static_cast<int64_t>(c.heads) * c.qk + 5;
  in.ld_k = (c.qk + 7) / 8 * 8;
  in.ld_v = (c.dv + 7) / 8 * 8;
  in.q.assign(static_cast<size_t>(c.tokens * in.q_stride), std::numeric_limits<float>::quiet_NaN());
  // q scaled by 4 (scores of a few units): a peaked softmax, so a wrong bound or a lost tile shows.
  for (int t = 0; t < c.tokens; ++t) {
    for (int i = 0; i < c.heads * c.qk; ++i) in.q[static_cast<size_t>(t * in.q_stride + i)] = from_bits(to_bits(4.0f * normal(rng), c.f16), c.f16);
  }
  const auto fill = [&](std::vector<uint16_t>& v, int ld, int used, uint16_t pad) {
    v.assign(static_cast<size_t>((static_cast<int64_t>(c.heads) * visible + 1) * ld), nan_bits);
    for (int64_t r = 0; r < static_cast<int64_t>(c.heads) * visible; ++r) {
      for (int i = 0; i < ld; ++i) v[static_cast<size_t>(r * ld + i)] = i < used ? to_bits(normal(rng), c.f16) : pad;
    }
  };
  fill(in.keys, in.ld_k, c.qk, 0);
  fill(in.values, in.ld_v, c.dv, nan_bits);
  return in;
}

// out[t][h·dv + i]: softmax over positions ≤ context + t of q·k·qk^(−1/2), times v; double sums.
std::vector<double> reference(const FlashCase& c, const FlashInputs& in) {
  const int visible = c.context + c.tokens;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.qk));
  std::vector<double> out(static_cast<size_t>(c.tokens * c.heads * c.dv));
  std::vector<double> s(static_cast<size_t>(visible));
  for (int h = 0; h < c.heads; ++h) {
    for (int t = 0; t < c.tokens; ++t) {
      const int n = c.context + t + 1;
      double top = -INFINITY;
      for (int tau = 0; tau < n; ++tau) {
        double dot = 0;
        const uint16_t* k = in.keys.data() + (static_cast<int64_t>(h) * visible + tau) * in.ld_k;
        for (int i = 0; i < c.qk; ++i) dot += static_cast<double>(in.q[static_cast<size_t>(t * in.q_stride + h * c.qk + i)]) * from_bits(k[i], c.f16);
        s[static_cast<size_t>(tau)] = dot * scale;
        top = std::max(top, dot * scale);
      }
      double total = 0;
      for (int tau = 0; tau < n; ++tau) total += std::exp(s[static_cast<size_t>(tau)] - top);
      for (int i = 0; i < c.dv; ++i) {
        double acc = 0;
        for (int tau = 0; tau < n; ++tau) {
          acc += std::exp(s[static_cast<size_t>(tau)] - top) / total * from_bits(in.values[static_cast<size_t>((static_cast<int64_t>(h) * visible + tau) * in.ld_v + i)], c.f16);
        }
        out[static_cast<size_t>((t * c.heads + h) * c.dv + i)] = acc;
      }
    }
  }
  return out;
}

// Every block of the sequence, one after another, with NaN-filled shared memory; the output rows of
// width heads·dv + 3 start as NaN.
template <int QK, int DV, bool kF16>
std::vector<float> run_blocks(const MlaFlashArgs& args) {
  static EmuBlock block;  // 128 MiB of fiber stacks: once
  std::vector<float> out(static_cast<size_t>(args.tokens * args.width), std::numeric_limits<float>::quiet_NaN());
  MlaFlashArgs a = args;
  a.out = out.data();
  std::vector<unsigned char> smem(static_cast<size_t>(MlaFlashLayout<QK, DV>::kBytes) + 16);
  unsigned char* aligned = smem.data() + (16 - reinterpret_cast<uintptr_t>(smem.data()) % 16) % 16;
  for (int h = 0; h < a.heads; ++h) {
    for (int tile = 0; tile < (a.tokens + kMlaFlashRows - 1) / kMlaFlashRows; ++tile) {
      std::memset(smem.data(), 0xff, smem.size());  // NaN in bf16 and f16
      block.run([&] { mla_flash_block<QK, DV, kF16>(a, tile, h, static_cast<int>(threadIdx.x), aligned); }, kMlaFlashThreads);
      for (int t = 0; t < kMlaFlashThreads; ++t) EXPECT_TRUE(emu_cp.pending[t].empty()) << "copies never waited for";
    }
  }
  return out;
}

template <bool kF16>
std::vector<float> run_case(const FlashCase& c, const MlaFlashArgs& args) {
  if (c.qk <= kMlaFlashSmallDim && c.dv <= kMlaFlashSmallDim) return run_blocks<kMlaFlashSmallDim, kMlaFlashSmallDim, kF16>(args);
  return run_blocks<kMlaFlashQk, kMlaFlashDv, kF16>(args);
}

// Per case, copies landing late and early, the output unrounded and rounded: every output cell written
// and finite, the 3 columns past heads·dv untouched; unrounded within 2⁻⁸·max|v| (bf16; 2⁻¹¹ f16: the
// rounding of P, relative 2⁻⁹ / 2⁻¹² a weight, bounds it; mla_flash.cuh) of the reference; rounded ones
// exact in the element type and within one more ulp.
TEST(MlaFlashEmu, MatchesPlainAttention) {
  const std::vector<FlashCase> cases = {
      {"48B head (192/128), prefix 70 + 37 rows", 2, 192, 128, 70, 37, false},
      {"48B head, first chunk of 130 rows (3 query tiles)", 1, 192, 128, 0, 130, false},
      {"48B head, f16, prefix 200 + 65 rows", 1, 192, 128, 200, 65, true},
      {"odd dims 20/11, 3 heads, prefix 5 + 77 rows", 3, 20, 11, 5, 77, false},
      {"tiny fixture 24/16, prefix of one whole tile + 64 rows", 2, 24, 16, 64, 64, false},
      {"odd dims 40/24, f16, prefix 129 + 3 rows", 2, 40, 24, 129, 3, true},
      {"136/72 in the 192/128 kernel, prefix 33 + 50 rows", 1, 136, 72, 33, 50, false},
  };
  for (const FlashCase& c : cases) {
    const FlashInputs in = make_inputs(c, 1234);
    const std::vector<double> want = reference(c, in);
    double v_max = 0, o_max = 0;
    for (int64_t r = 0; r < static_cast<int64_t>(c.heads) * (c.context + c.tokens); ++r) {
      for (int i = 0; i < c.dv; ++i) v_max = std::max(v_max, static_cast<double>(std::fabs(from_bits(in.values[static_cast<size_t>(r * in.ld_v + i)], c.f16))));
    }
    for (double v : want) o_max = std::max(o_max, std::fabs(v));
    const double ulp = c.f16 ? 0x1p-10 : 0x1p-7;
    const double bound = (c.f16 ? 0x1p-11 : 0x1p-8) * v_max;
    for (bool eager : {false, true}) {
      for (bool round : {false, true}) {
        const std::string at = std::string(c.name) + (eager ? ", copies land early" : ", copies land late") + (round ? ", rounded" : "");
        MlaFlashArgs args;
        args.q = in.q.data();
        args.keys = in.keys.data();
        args.values = in.values.data();
        args.q_stride = in.q_stride;
        args.width = static_cast<int64_t>(c.heads) * c.dv + 3;
        args.ld_k = in.ld_k;
        args.ld_v = in.ld_v;
        args.tokens = c.tokens;
        args.context = c.context;
        args.heads = c.heads;
        args.qk = c.qk;
        args.dv = c.dv;
        args.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.qk)) / std::log(2.0));
        args.act = c.f16 ? kAF16 : kABF16;
        args.round_out = round;
        emu_cp.eager = eager;
        const std::vector<float> have = c.f16 ? run_case<true>(c, args) : run_case<false>(c, args);
        double worst = 0;
        for (int t = 0; t < c.tokens; ++t) {
          for (int64_t col = 0; col < args.width; ++col) {
            const float v = have[static_cast<size_t>(t * args.width + col)];
            if (col >= static_cast<int64_t>(c.heads) * c.dv) {
              ASSERT_TRUE(std::isnan(v)) << at << ": row " << t << " column " << col << " past the heads was written";
              continue;
            }
            ASSERT_TRUE(std::isfinite(v)) << at << ": row " << t << " column " << col;
            const double err = std::fabs(v - want[static_cast<size_t>(t * c.heads * c.dv + col)]);
            worst = std::max(worst, err);
            if (round) {
              ASSERT_EQ(v, from_bits(to_bits(v, c.f16), c.f16)) << at << ": row " << t << " column " << col << " not rounded";
              ASSERT_LE(err, bound + ulp * std::fabs(v)) << at << ": row " << t << " column " << col;
            } else {
              ASSERT_LE(err, bound) << at << ": row " << t << " column " << col << ": " << v << " want " << want[static_cast<size_t>(t * c.heads * c.dv + col)];
            }
          }
        }
        std::printf("  %s: max error %.3g (%.3g of max|v| %.3g; outputs up to %.3g; bound %.3g)\n", at.c_str(), worst, worst / v_max, v_max, o_max, bound);
      }
    }
  }
  emu_cp.eager = false;
}

}  // namespace
}  // namespace plow::cuda
