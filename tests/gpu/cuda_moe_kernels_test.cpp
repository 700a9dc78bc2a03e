// The routed-expert kernels of the GEMM path alone (runtime/cuda/moe_gemm.h; label gpu, linked into
// cuda_prefill_tests): the device routing sort against the host's counting sort, and the wgmma expert
// GEMM against an fp64 GEMM per expert. cuda_prefill_test.cpp runs them inside whole MoE layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "runtime/cuda/moe_gemm.h"

namespace plow {
namespace {

// ---- the routed-expert kernels alone (moe_gemm.h) --------------------------------------------------

// The lists of a routing as MoeGemmRunner's host sort writes them (the reference of the device sort):
// perm, inv, the active experts and their first sorted pairs, the counts with the active count after
// them, and the wgmma job list (moe_lists.h: short jobs of ≤ 64 rows, then long ones).
struct HostRouting {
  std::vector<int32_t> perm, inv, active, offsets, counts, job_list;
};

std::vector<int32_t> job_list_of(const std::vector<int32_t>& counts, const std::vector<int32_t>& active, const std::vector<int32_t>& offsets) {
  std::vector<int32_t> short_jobs, long_jobs;
  for (size_t i = 0; i < active.size(); ++i) {
    const int32_t count = counts[static_cast<size_t>(active[i])];
    for (int32_t f = 0; f < count; f += cuda::kMoeWgmmaJobRows) {
      const int32_t n = std::min(cuda::kMoeWgmmaJobRows, count - f);
      std::vector<int32_t>& jobs = n <= 64 ? short_jobs : long_jobs;
      jobs.insert(jobs.end(), {active[i], offsets[i] + f, n});
    }
  }
  std::vector<int32_t> list = {static_cast<int32_t>(short_jobs.size() / 3), static_cast<int32_t>(long_jobs.size() / 3)};
  list.insert(list.end(), short_jobs.begin(), short_jobs.end());
  list.insert(list.end(), long_jobs.begin(), long_jobs.end());
  return list;
}

HostRouting host_routing(const std::vector<float>& routes, int64_t rows, int64_t k, int experts) {
  HostRouting h;
  const int64_t pairs = rows * k;
  std::vector<int32_t> expert_of(static_cast<size_t>(pairs));
  h.counts.assign(static_cast<size_t>(experts) + 1, 0);
  for (int64_t q = 0; q < pairs; ++q) {
    expert_of[static_cast<size_t>(q)] = static_cast<int32_t>(routes[static_cast<size_t>((q / k) * 2 * k + k + q % k)]);
    h.counts[static_cast<size_t>(expert_of[static_cast<size_t>(q)])] += 1;
  }
  std::vector<int32_t> next(static_cast<size_t>(experts));
  int32_t total = 0;
  for (int e = 0; e < experts; ++e) {
    next[static_cast<size_t>(e)] = total;
    if (h.counts[static_cast<size_t>(e)] == 0) continue;
    h.active.push_back(e);
    h.offsets.push_back(total);
    total += h.counts[static_cast<size_t>(e)];
  }
  h.counts[static_cast<size_t>(experts)] = static_cast<int32_t>(h.active.size());
  h.perm.resize(static_cast<size_t>(pairs));
  h.inv.resize(static_cast<size_t>(pairs));
  for (int64_t q = 0; q < pairs; ++q) {
    const int32_t p = next[static_cast<size_t>(expert_of[static_cast<size_t>(q)])]++;
    h.perm[static_cast<size_t>(p)] = static_cast<int32_t>(q);
    h.inv[static_cast<size_t>(q)] = p;
  }
  h.job_list = job_list_of(h.counts, h.active, h.offsets);
  return h;
}

// Top-k rows [rows, 2k]: k weights, then k distinct expert ids; `skew`: every row picks experts 0..k-1.
std::vector<float> random_routes(int64_t rows, int64_t k, int experts, bool skew, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> routes(static_cast<size_t>(rows * 2 * k));
  std::vector<int> ids(static_cast<size_t>(experts));
  for (int64_t t = 0; t < rows; ++t) {
    for (int e = 0; e < experts; ++e) ids[static_cast<size_t>(e)] = e;
    if (!skew) std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t s = 0; s < k; ++s) {
      routes[static_cast<size_t>(t * 2 * k + s)] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      routes[static_cast<size_t>(t * 2 * k + k + s)] = static_cast<float>(ids[static_cast<size_t>(s)]);
    }
  }
  return routes;
}

template <typename T>
std::vector<T> download(const cuda::DeviceBuffer& buffer, size_t count) {
  std::vector<T> host(count);
  cuda::check(cudaMemcpy(host.data(), buffer.ptr, count * sizeof(T), cudaMemcpyDeviceToHost), "test download");
  return host;
}

// launch_moe_sort over `routes` ([rows, 2k] on the host) into fresh device buffers: the lists (perm,
// inv, then min(pairs, experts) active experts and offsets), the job list, the counts, the statistics
// and the error flag.
struct DeviceSortRun {
  int64_t pairs, max_n;
  cuda::DeviceBuffer lists, jobs, counts, stats, error, scratch, temp;
  DeviceSortRun(const std::vector<float>& routes, int64_t rows, int64_t k, int experts)
      : pairs(rows * k),
        max_n(std::min<int64_t>(rows * k, experts)),
        lists(static_cast<size_t>(2 * pairs + 2 * max_n) * sizeof(int32_t), "lists"),
        jobs(static_cast<size_t>(cuda::moe_job_list_ints(experts, pairs)) * sizeof(int32_t), "jobs"),
        counts((static_cast<size_t>(experts) + 1) * sizeof(int32_t), "counts"),
        stats(2 * sizeof(unsigned long long), "stats"),
        error(sizeof(int32_t), "error"),
        scratch(3 * static_cast<size_t>(pairs) * sizeof(int32_t), "keys"),
        temp(std::max<size_t>(cuda::moe_sort_temp_bytes(pairs), 16), "sort storage") {
    const cuda::DeviceBuffer routes_dev = cuda::upload(routes, "routes");
    cuda::MoeSortBuffers b;
    b.keys = scratch.as<int32_t>();
    b.sorted_keys = b.keys + pairs;
    b.values = b.sorted_keys + pairs;
    b.temp = temp.ptr;
    b.temp_bytes = temp.bytes;
    cuda::check(cudaMemset(stats.ptr, 0, stats.bytes), "test");
    cuda::check(cudaMemset(error.ptr, 0, error.bytes), "test");
    cuda::check(cudaMemset(jobs.ptr, 0xFF, jobs.bytes), "test");
    int32_t* l = lists.as<int32_t>();
    cuda::launch_moe_sort(routes_dev.as<float>(), 2 * k, rows, k, experts, b, l, l + pairs, l + 2 * pairs, l + 2 * pairs + max_n, jobs.as<int32_t>(),
                          counts.as<int32_t>(), stats.as<unsigned long long>(), error.as<int32_t>(), nullptr);
    cuda::check(cudaDeviceSynchronize(), "test");
  }
};

// launch_moe_sort writes the host sort's lists exactly (a stable sort: ascending token order within an
// expert) and the same wgmma job list, over small, skewed (an expert of 300 rows: jobs of 128, 128, 44)
// and 48B-sized routings; an id that is no expert of the stack sets kErrRouting.
TEST(CudaMoeKernels, DeviceSortWritesTheHostSortsLists) {
  struct Case {
    int64_t rows, k;
    int experts;
    bool skew;
  };
  for (const Case& c : std::vector<Case>{{1, 1, 4, false}, {33, 2, 7, false}, {300, 3, 8, true}, {2048, 8, 256, false}, {1000, 4, 1000, false}}) {
    const std::string where = "rows " + std::to_string(c.rows) + " top-" + std::to_string(c.k) + " of " + std::to_string(c.experts);
    const std::vector<float> routes = random_routes(c.rows, c.k, c.experts, c.skew, static_cast<uint32_t>(c.rows * c.k));
    const HostRouting want = host_routing(routes, c.rows, c.k, c.experts);
    const DeviceSortRun run(routes, c.rows, c.k, c.experts);
    const int64_t pairs = run.pairs, max_n = run.max_n, n = static_cast<int64_t>(want.active.size());
    const std::vector<int32_t> have = download<int32_t>(run.lists, static_cast<size_t>(2 * pairs + 2 * max_n));
    EXPECT_EQ(std::vector<int32_t>(have.begin(), have.begin() + pairs), want.perm) << where;
    EXPECT_EQ(std::vector<int32_t>(have.begin() + pairs, have.begin() + 2 * pairs), want.inv) << where;
    EXPECT_EQ(std::vector<int32_t>(have.begin() + 2 * pairs, have.begin() + 2 * pairs + n), want.active) << where;
    EXPECT_EQ(std::vector<int32_t>(have.begin() + 2 * pairs + max_n, have.begin() + 2 * pairs + max_n + n), want.offsets) << where;
    EXPECT_EQ(download<int32_t>(run.counts, static_cast<size_t>(c.experts) + 1), want.counts) << where;
    EXPECT_EQ(download<int32_t>(run.jobs, want.job_list.size()), want.job_list) << where;
    EXPECT_EQ(download<int32_t>(run.error, 1)[0], 0) << where;
    EXPECT_EQ(download<unsigned long long>(run.stats, 2), (std::vector<unsigned long long>{1, static_cast<unsigned long long>(n)})) << where;
  }
  for (const float bad : {4.0f, 1.5f, -1.0f}) {
    std::vector<float> routes = random_routes(10, 2, 4, false, 7);
    routes[3 * 4 + 2 + 1] = bad;  // row 3 (4 floats a row: 2 weights, 2 ids), slot 1's id
    const DeviceSortRun run(routes, 10, 2, 4);
    EXPECT_EQ(download<int32_t>(run.error, 1)[0], cuda::kErrRouting) << "expert id " << bad;
  }
}

// launch_moe_wgmma against an fp64 GEMM per expert, both kernels (jobs of ≤ 64 and ≤ 128 rows, an
// expert of 300 rows in three jobs, experts without rows), one and two weight stacks, bf16 and f16,
// rounded outputs and fp32 ones (a tensor-parallel partial sum), widths that are no multiple of a tile
// (K 200: a partial last stage; 130 outputs: a partial weight tile of 2 rows, rows padded to 136), and
// the sorted rows read in place or through b_rows (gate_up's token rows: here the rows stored in
// reverse, b_rows[p] / 3 naming row p's place).
// Bounds: the fp32 accumulation (K·2⁻²⁴·Σ|ab|) plus, for 16-bit outputs, one rounding (2⁻⁸ or 2⁻¹¹ of
// the value). The output buffers start as NaN: every output of a job's rows must be written, and the
// padding columns past gemm_out must stay as they were.
TEST(CudaMoeKernels, WgmmaMatchesAnFp64GemmPerExpert) {
  const std::vector<int32_t> rows_of = {0, 1, 64, 65, 300, 7};
  const int experts = static_cast<int>(rows_of.size());
  int64_t pairs = 0;
  for (int32_t r : rows_of) pairs += r;
  for (const int32_t type : {cuda::kWBF16, cuda::kWF16}) {
    for (const bool f32_out : {false, true}) {
      for (const int sets : {1, 2}) {
        for (const auto& [gemm_in, gemm_out, by_rows] :
             std::vector<std::tuple<int64_t, int64_t, bool>>{{200, 130, false}, {1024, 264, false}, {200, 130, true}, {1024, 264, true}}) {
          const std::string where = std::string(type == cuda::kWBF16 ? "bf16" : "f16") + (f32_out ? " fp32 out" : "") + " sets " + std::to_string(sets) +
                                    " " + std::to_string(gemm_in) + " -> " + std::to_string(gemm_out) + (by_rows ? " through b_rows" : "");
          const auto round = [&](float v) { return type == cuda::kWBF16 ? round_bf16(v) : round_f16(v); };
          const auto bits = [&](float v) { return type == cuda::kWBF16 ? f32_to_bf16(v) : f32_to_f16(v); };
          std::mt19937 rng(static_cast<uint32_t>(gemm_in * 7 + sets));
          std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
          const int64_t ld_in = (gemm_in + 7) / 8 * 8, ld_out = (gemm_out + 7) / 8 * 8;
          std::vector<float> b(static_cast<size_t>(pairs * ld_in), 0.0f), w[2];
          std::vector<uint16_t> b_bits(b.size(), 0), w_bits[2];
          for (int64_t p = 0; p < pairs; ++p) {
            for (int64_t c = 0; c < gemm_in; ++c) {
              b[static_cast<size_t>(p * ld_in + c)] = round(dist(rng));
              b_bits[static_cast<size_t>(p * ld_in + c)] = bits(b[static_cast<size_t>(p * ld_in + c)]);
            }
          }
          std::vector<cuda::DeviceBuffer> w_dev;
          cuda::DeviceWeight dw[2];
          for (int j = 0; j < sets; ++j) {
            w[j].resize(static_cast<size_t>(experts * gemm_out * gemm_in));
            w_bits[j].resize(w[j].size());
            for (size_t i = 0; i < w[j].size(); ++i) w_bits[j][i] = bits(w[j][i] = round(dist(rng)));
            w_dev.push_back(cuda::upload(w_bits[j], "weights"));
            dw[j].data = w_dev.back().as<uint8_t>();
            dw[j].rows = gemm_out;
            dw[j].cols = gemm_in;
            dw[j].part_bytes = gemm_out * gemm_in * 2;
            dw[j].type = type;
            dw[j].parts = experts;
          }
          std::vector<int32_t> counts(rows_of.begin(), rows_of.end()), active, offsets;
          int32_t first = 0;
          for (int e = 0; e < experts; ++e) {
            if (rows_of[static_cast<size_t>(e)] > 0) active.push_back(e), offsets.push_back(first);
            first += rows_of[static_cast<size_t>(e)];
          }
          const std::vector<int32_t> list = job_list_of(counts, active, offsets);
          ASSERT_GT(list[0], 0) << where << ": no short job";
          ASSERT_GT(list[1], 0) << where << ": no long job";
          // Through b_rows: sorted row p stored at row pairs − 1 − p, named by b_rows[p] = 3·(pairs − 1 − p) + p mod 3.
          std::vector<uint16_t> stored = b_bits;
          std::vector<int32_t> b_rows(static_cast<size_t>(pairs));
          for (int64_t p = 0; p < pairs; ++p) {
            b_rows[static_cast<size_t>(p)] = static_cast<int32_t>(3 * (pairs - 1 - p) + p % 3);
            if (by_rows) std::copy_n(b_bits.begin() + p * ld_in, ld_in, stored.begin() + (pairs - 1 - p) * ld_in);
          }
          const cuda::DeviceBuffer b_dev = cuda::upload(stored, "rows"), list_dev = cuda::upload(list, "jobs"), rows_dev = cuda::upload(b_rows, "row map");
          const size_t out_bytes = static_cast<size_t>(pairs * ld_out) * (f32_out ? 4 : 2);
          cuda::DeviceBuffer c0(out_bytes, "c0"), c1(out_bytes, "c1");
          cuda::check(cudaMemset(c0.ptr, 0xFF, out_bytes), "test");  // NaN in every output type
          cuda::check(cudaMemset(c1.ptr, 0xFF, out_bytes), "test");
          ASSERT_TRUE(cuda::launch_moe_wgmma(list_dev.as<int32_t>(), list[0], list[1], dw, sets, gemm_in, gemm_out, b_dev.ptr, ld_in, type,
                                             by_rows ? rows_dev.as<int32_t>() : nullptr, 3, c0.ptr, c1.ptr, ld_out, f32_out ? cuda::kWF32 : type, nullptr))
              << where;
          cuda::check(cudaDeviceSynchronize(), "test");
          for (int j = 0; j < sets; ++j) {
            const cuda::DeviceBuffer& c = j == 0 ? c0 : c1;
            std::vector<float> have(static_cast<size_t>(pairs * ld_out));
            if (f32_out) {
              have = download<float>(c, have.size());
            } else {
              const std::vector<uint16_t> raw = download<uint16_t>(c, have.size());
              for (size_t i = 0; i < raw.size(); ++i) have[i] = type == cuda::kWBF16 ? bf16_to_f32(raw[i]) : f16_to_f32(raw[i]);
            }
            int64_t row = 0;
            for (int e = 0; e < experts; ++e) {
              for (int32_t r = 0; r < rows_of[static_cast<size_t>(e)]; ++r, ++row) {
                for (int64_t o = 0; o < gemm_out; ++o) {
                  double dot = 0, mag = 0;
                  for (int64_t kk = 0; kk < gemm_in; ++kk) {
                    const double ab = static_cast<double>(b[static_cast<size_t>(row * ld_in + kk)]) *
                                      static_cast<double>(w[j][static_cast<size_t>((e * gemm_out + o) * gemm_in + kk)]);
                    dot += ab;
                    mag += std::fabs(ab);
                  }
                  const float got = have[static_cast<size_t>(row * ld_out + o)];
                  const double bound = static_cast<double>(gemm_in) * 0x1p-24 * mag + (f32_out ? 0.0 : (type == cuda::kWBF16 ? 0x1p-8 : 0x1p-11) * std::fabs(dot));
                  ASSERT_FALSE(std::isnan(got)) << where << " stack " << j << " expert " << e << " row " << r << " output " << o << " was not written";
                  ASSERT_LE(std::fabs(static_cast<double>(got) - dot), bound) << where << " stack " << j << " expert " << e << " row " << r << " output " << o;
                }
                for (int64_t o = gemm_out; o < ld_out; ++o) {
                  ASSERT_TRUE(std::isnan(have[static_cast<size_t>(row * ld_out + o)])) << where << " stack " << j << " row " << row << " padding column " << o;
                }
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace plow
