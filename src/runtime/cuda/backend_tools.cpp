// CudaBackend for benchmarks and diagnosis: decode steps timed on the device, the per-opcode profile
// (eager launches timed with events, and the megakernel's own wait and run cycles), one op at a time
// with a host timeout.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "graph/op_table.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/backend_impl.h"

namespace plow::cuda {

static_assert(static_cast<int>(Op::kCount) < kProfileSlots - 1, "the per-opcode profile needs a slot per opcode");

int CudaBackend::diagnose_decode_step(int batch, double timeout_ms) {
  Impl& m = *impl_;
  m.use_device();
  Impl::PreparedPlan& prepared = *m.plans[static_cast<size_t>(m.choose(true, batch))];
  const StepView view = m.upload_decode_step(prepared, batch);
  const KernelParams p = m.params(prepared, view, true);
  for (size_t i = 0; i < prepared.plan.ops.size(); ++i) {
    const auto [first, end] = prepared.op_tasks[i];
    if (end <= first) continue;
    const auto start = std::chrono::steady_clock::now();
    m.run_host_op(prepared, static_cast<int32_t>(i), p, false);
    launch_eager(p, first, end - first, prepared.plan.max_tokens, m.stream);
    cudaError_t state = cudaErrorNotReady;
    double ms = 0;
    while ((state = cudaStreamQuery(m.stream)) == cudaErrorNotReady) {
      ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (ms > timeout_ms) {
        std::fprintf(stderr, "op %zu %s (%s, %d tasks): still running after %.0f ms\n", i, prepared.plan.ops[i].label.c_str(),
                     std::string(op_name(prepared.plan.ops[i].op())).c_str(), end - first, ms);
        return static_cast<int>(i);
      }
    }
    check(state, "diagnosis");
    ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    int32_t code = 0;
    check(cudaMemcpy(&code, m.error_flag.ptr, sizeof(code), cudaMemcpyDeviceToHost), "error flag");
    std::fprintf(stderr, "op %zu %s (%s, %d tasks): %.3f ms%s\n", i, prepared.plan.ops[i].label.c_str(), std::string(op_name(prepared.plan.ops[i].op())).c_str(),
                 end - first, ms, code != 0 ? fmt::format("  device error {}", code).c_str() : "");
  }
  return -1;
}

void CudaBackend::fake_context(int64_t tokens) {
  Impl& m = *impl_;
  if (tokens < 0 || tokens >= m.options.max_context_tokens) fail("cuda: a context of {} tokens does not fit the cache of {}", tokens, m.options.max_context_tokens);
  std::fill(m.contexts.begin(), m.contexts.end(), tokens);
}

double CudaBackend::timed_decode_steps(int batch, int steps, bool prefill_plan) {
  Impl& m = *impl_;
  m.use_device();
  if (batch < 1 || batch > num_slots()) fail("cuda: a decode batch of {} needs {} slots, the backend has {}", batch, batch, num_slots());
  Impl::PreparedPlan& prepared = *m.plans[static_cast<size_t>(m.choose(!prefill_plan, batch))];
  const StepView view = m.upload_decode_step(prepared, batch);
  const PlanOp& head = prepared.plan.op(prepared.plan.output_op);
  float* token_out = prepared.token_offsets.empty() ? nullptr : m.arena.as<float>() + prepared.token_offsets.front();
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  auto one = [&] {
    m.launch(prepared, m.params(prepared, view, m.options.eager), m.options.eager);
    if (m.options.comm) {
      m.fold_argmax(prepared, view, batch, token_out);
    } else {
      launch_argmax(m.arena.as<float>() + head.offset, head.width, view.seq_first_row, view.seq_tokens, batch, m.argmax_ids.as<int32_t>(), token_out, m.stream);
    }
  };
  for (int i = 0; i < kDecodeWarmupSteps; ++i) one();
  check(cudaEventRecord(start, m.stream), "event");
  for (int i = 0; i < steps; ++i) one();
  check(cudaEventRecord(stop, m.stream), "event");
  check(cudaEventSynchronize(stop), "timed steps");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "event");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  m.check_device_error();
  return static_cast<double>(ms) / steps;
}

std::vector<OpcodeProfile> CudaBackend::profile_decode_step(int batch) {
  Impl& m = *impl_;
  m.use_device();
  Impl::PreparedPlan& prepared = *m.plans[static_cast<size_t>(m.choose(true, batch))];
  const StepView view = m.upload_decode_step(prepared, batch);
  const Plan& plan = prepared.plan;
  std::map<std::string, OpcodeProfile> by_op;
  const int repeats = 5;
  // Ops that run nothing (tokens, slice views) get no events: an event record costs a few µs of the
  // stream's time, which would otherwise be charged to them.
  std::vector<size_t> timed;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    if (prepared.op_tasks[i].second > prepared.op_tasks[i].first || plan.ops[i].op() == Op::kAllReduce) timed.push_back(i);
  }
  std::vector<cudaEvent_t> events(timed.size() + 1);
  for (cudaEvent_t& e : events) check(cudaEventCreate(&e), "event");
  std::vector<double> ms(plan.ops.size(), 0.0);
  for (int r = 0; r < repeats + 1; ++r) {
    // A step's later ops may reuse the token buffer's floats (arena reuse): write the ids again.
    m.upload_decode_step(prepared, batch);
    const KernelParams p = m.params(prepared, view, true);
    for (size_t j = 0; j < timed.size(); ++j) {
      check(cudaEventRecord(events[j], m.stream), "event");
      m.launch_op(prepared, timed[j], p);
    }
    check(cudaEventRecord(events.back(), m.stream), "event");
    check(cudaEventSynchronize(events.back()), "profile");
    if (r == 0) continue;  // warm-up
    for (size_t j = 0; j < timed.size(); ++j) {
      float t = 0;
      check(cudaEventElapsedTime(&t, events[j], events[j + 1]), "event");
      ms[timed[j]] += t / repeats;
    }
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  for (size_t i : timed) {
    const PlanOp& op = plan.ops[i];
    OpcodeProfile& entry = by_op[std::string(op_name(op.op()))];
    entry.op = op_name(op.op());
    entry.tasks += prepared.op_tasks[i].second - prepared.op_tasks[i].first;
    entry.ms += ms[i];
    for (int32_t w : op.weights) {
      const WeightDecl& decl = plan.weights[static_cast<size_t>(w)];
      const auto [rows, cols] = matrix_shape(decl.shape);
      const double part = decl.mxfp4 ? static_cast<double>(rows * cols) * 17.0 / 32.0 : static_cast<double>(rows * cols * 2);
      const double parts_read = decl.parts.size() > 1 && op.attrs.has("top_k")
                                    ? std::min<double>(static_cast<double>(decl.parts.size()), static_cast<double>(batch) * op.attrs.get("top_k"))
                                    : static_cast<double>(decl.parts.size());
      entry.bytes += part * parts_read;
    }
  }
  // The megakernel's own view: wait vs run cycles summed over its blocks.
  check(cudaMemsetAsync(m.profile.ptr, 0, m.profile.bytes, m.stream), "profile");
  check(cudaMemsetAsync(m.op_profile.ptr, 0, m.op_profile.bytes, m.stream), "profile");
  m.upload_decode_step(prepared, batch);
  KernelParams p = m.params(prepared, view, false);
  p.profile = m.profile.as<unsigned long long>();
  p.op_profile = m.op_profile.as<unsigned long long>();
  m.launch(prepared, p, false);
  std::vector<unsigned long long> counts(static_cast<size_t>(plan.workers) * 4);
  check(cudaMemcpyAsync(counts.data(), m.profile.ptr, counts.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost, m.stream), "profile");
  std::vector<unsigned long long> per_op(static_cast<size_t>(3 * kProfileSlots));
  check(cudaMemcpyAsync(per_op.data(), m.op_profile.ptr, per_op.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost, m.stream), "profile");
  check(cudaStreamSynchronize(m.stream), "profile");
  m.check_device_error();
  int clock_khz = 0;
  check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, m.options.device), "device query");
  double wait = 0, run = 0, tasks = 0, total = 0;
  for (int w = 0; w < plan.workers; ++w) {
    wait += static_cast<double>(counts[static_cast<size_t>(4 * w)]);
    run += static_cast<double>(counts[static_cast<size_t>(4 * w + 1)]);
    tasks += static_cast<double>(counts[static_cast<size_t>(4 * w + 2)]);
    total += static_cast<double>(counts[static_cast<size_t>(4 * w + 3)]);
  }
  std::vector<OpcodeProfile> out;
  for (auto& [name, entry] : by_op) out.push_back(entry);
  std::sort(out.begin(), out.end(), [](const OpcodeProfile& a, const OpcodeProfile& b) { return a.ms > b.ms; });
  const double to_ms = 1.0 / std::max(clock_khz, 1);  // cycles → ms
  out.push_back({"megakernel:wait (mean per block)", static_cast<int64_t>(tasks), wait * to_ms / plan.workers, 0});
  out.push_back({"megakernel:run (mean per block)", static_cast<int64_t>(tasks), run * to_ms / plan.workers, 0});
  // The rest of a block's time: barriers, releases, the profile's own atomics, loading the first task.
  out.push_back({"megakernel:between tasks (mean per block)", static_cast<int64_t>(tasks), (total - wait - run) * to_ms / plan.workers, 0});
  // Per opcode inside the megakernel, as the mean block spends it: waiting for the op's inputs, running its tasks.
  std::vector<OpcodeProfile> inside;
  for (int slot = 0; slot < kProfileSlots; ++slot) {
    const unsigned long long* c = per_op.data() + 3 * slot;
    if (c[2] == 0) continue;
    const std::string name = slot == kProfileSlots - 1 ? "round_rows" : std::string(op_name(static_cast<Op>(slot)));
    inside.push_back({"megakernel:" + name + " run", static_cast<int64_t>(c[2]), static_cast<double>(c[1]) * to_ms / plan.workers, 0});
    inside.push_back({"megakernel:" + name + " wait", static_cast<int64_t>(c[2]), static_cast<double>(c[0]) * to_ms / plan.workers, 0});
  }
  std::sort(inside.begin(), inside.end(), [](const OpcodeProfile& a, const OpcodeProfile& b) { return a.ms > b.ms; });
  out.insert(out.end(), inside.begin(), inside.end());
  return out;
}

std::vector<CriticalPath> CudaBackend::trace_decode_steps(int batch, int steps) {
  Impl& m = *impl_;
  m.use_device();
  Impl::PreparedPlan& prepared = *m.plans[static_cast<size_t>(m.choose(true, batch))];
  const Plan& plan = prepared.plan;
  size_t positions = 0;
  for (const std::vector<int32_t>& queue : plan.queues) positions += queue.size();
  DeviceBuffer trace((positions * kTraceFields + static_cast<size_t>(plan.workers) * kTraceClockFields) * sizeof(unsigned long long), "trace");
  std::vector<unsigned long long> host(trace.bytes / sizeof(unsigned long long));
  std::vector<CriticalPath> paths;
  for (int s = 0; s < steps; ++s) {
    const StepView view = m.upload_decode_step(prepared, batch);
    if (prepared.gemm.active(view.tokens, m.options.gemm_min_rows) || !prepared.segments.empty()) return {};
    KernelParams p = m.params(prepared, view, false);
    p.trace = trace.as<unsigned long long>();
    launch_megakernel(p, plan.workers, plan.max_tokens, m.stream);
    check(cudaMemcpyAsync(host.data(), trace.ptr, trace.bytes, cudaMemcpyDeviceToHost, m.stream), "trace");
    m.check_device_error();  // synchronizes
    // Each block's clock onto the global timer: two (timer, clock) pairs read at a tick of the timer,
    // as the block started and as it ended; times from the first block's start (a double holds the
    // timer's ~1e18 ns only to ~256 ns).
    const unsigned long long* clocks = host.data() + positions * kTraceFields;
    unsigned long long origin = clocks[0];
    for (size_t w = 0; w < plan.queues.size(); ++w) origin = std::min(origin, clocks[w * kTraceClockFields]);
    std::vector<TaskTimes> times(plan.tasks.size());
    size_t at = 0;
    for (size_t w = 0; w < plan.queues.size(); ++w) {
      const unsigned long long* clock = clocks + w * kTraceClockFields;
      const double g0 = static_cast<double>(clock[0] - origin), g1 = static_cast<double>(clock[2] - origin);
      const double per_cycle = (g1 - g0) / std::max(1.0, static_cast<double>(clock[3] - clock[1]));  // ns
      const auto ns = [&](unsigned long long c) { return g0 + static_cast<double>(static_cast<long long>(c - clock[1])) * per_cycle; };
      for (int32_t t : plan.queues[w]) {
        const unsigned long long* f = host.data() + at * kTraceFields;
        times[static_cast<size_t>(t)] = TaskTimes{ns(f[0]), ns(f[1]), ns(f[2]), ns(f[3])};
        ++at;
      }
    }
    paths.push_back(measured_critical_path(plan, times));
  }
  return paths;
}

// Events before every op and after the last, one host wait at the end; each op's time (its host part
// and its launch) added to its opcode's entry. Ops that run nothing take no events.
void CudaBackend::Impl::launch_timed(const PreparedPlan& prepared, const KernelParams& p, bool gemm, bool mla, bool kda) {
  const size_t n = prepared.plan.ops.size();
  while (timing_events.size() < n + 1) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "event");
    timing_events.push_back(e);
  }
  std::vector<size_t> timed;
  for (size_t i = 0; i < n; ++i) {
    const bool host_part = prepared.plan.ops[i].op() == Op::kAllReduce || (gemm && (prepared.gemm.ops[i] || prepared.gemm.moe_ops[i])) ||
                           (mla && prepared.plan.ops[i].op() == Op::kMlaAttention) || (kda && prepared.plan.ops[i].op() == Op::kKdaDeltaRule);
    if (prepared.op_tasks[i].second > prepared.op_tasks[i].first || host_part) {
      check(cudaEventRecord(timing_events[timed.size()], stream), "event");
      timed.push_back(i);
    }
    launch_op(prepared, i, p, gemm, mla, kda);
  }
  check(cudaEventRecord(timing_events[timed.size()], stream), "event");
  check(cudaEventSynchronize(timing_events[timed.size()]), "op timing");
  for (size_t j = 0; j < timed.size(); ++j) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, timing_events[j], timing_events[j + 1]), "event");
    const size_t i = timed[j];
    OpcodeProfile& entry = op_times[std::string(op_name(prepared.plan.ops[i].op()))];
    entry.op = op_name(prepared.plan.ops[i].op());
    entry.tasks += prepared.op_tasks[i].second - prepared.op_tasks[i].first;
    entry.ms += ms;
  }
}

void CudaBackend::set_op_timing(bool on) { impl_->op_timing = on; }

std::vector<OpcodeProfile> CudaBackend::op_times() const {
  std::vector<OpcodeProfile> out;
  for (const auto& [name, entry] : impl_->op_times) out.push_back(entry);
  std::sort(out.begin(), out.end(), [](const OpcodeProfile& a, const OpcodeProfile& b) { return a.ms > b.ms; });
  return out;
}

void CudaBackend::reset_op_times() { impl_->op_times.clear(); }

}  // namespace plow::cuda
