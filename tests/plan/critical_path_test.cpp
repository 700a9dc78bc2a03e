// measured_critical_path: the walk back through producers and queue predecessors, on a hand-made plan
// with known times, and on a lowered plan whose times come from a small simulation of the protocol.
#include "plan/critical_path.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "engine/model.h"
#include "plan/lower.h"

namespace plow {
namespace {

// Two ops on two workers: op 0's tasks A (worker 0) and B (worker 1) signal counter 0; op 1's tasks C
// (worker 0) and D (worker 1) wait for both and signal counter 1.
Plan two_by_two() {
  Plan plan;
  plan.workers = 2;
  plan.counters = 2;
  PlanOp first, second;
  first.opcode = static_cast<uint8_t>(Op::kEmbedding);
  second.opcode = static_cast<uint8_t>(Op::kRmsNorm);
  plan.ops = {first, second};
  PlanTask a{0, 0, 1, 0, 0, {0}}, b{0, 1, 2, 0, 0, {0}}, c{1, 0, 1, 0, 2, {1}}, d{1, 1, 2, 0, 2, {1}};
  plan.tasks = {a, b, c, d};
  plan.queues = {{0, 2}, {1, 3}};
  return plan;
}

TEST(CriticalPath, WalksBackThroughTheProducerThatEndedLast) {
  // A ends at 10, B at 20; C's wait is done at 22 (B), D ends last at 40.
  const std::vector<TaskTimes> times = {{0, 0, 1, 10}, {0, 0, 1, 20}, {10, 22, 23, 30}, {20, 22, 24, 40}};
  const CriticalPath path = measured_critical_path(two_by_two(), times);
  EXPECT_EQ(path.chain, (std::vector<int32_t>{1, 3}));  // B → D (B is also D's queue predecessor: the counter wins)
  EXPECT_DOUBLE_EQ(path.span_ns, 40);
  EXPECT_DOUBLE_EQ(path.run_ns, 19 + 16);
  EXPECT_DOUBLE_EQ(path.hop_ns, 4);
  EXPECT_EQ(path.hops, 1);
  EXPECT_DOUBLE_EQ(path.queue_ns, 0);
  EXPECT_DOUBLE_EQ(path.lead_ns, 1);
  ASSERT_EQ(path.ops.size(), 2u);
  EXPECT_EQ(path.ops[0].op, "rms_norm");  // 16 run + 4 hop
  EXPECT_DOUBLE_EQ(path.ops[0].hop_ns, 4);
  EXPECT_EQ(path.ops[1].op, "embedding");
  EXPECT_DOUBLE_EQ(path.ops[1].run_ns, 19);
}

TEST(CriticalPath, TheProducerMayBeTheQueuePredecessor) {
  // A now runs long (ends at 50, after B's 20): C ends last, and A is both its queue predecessor and
  // the last signaller of its counter.
  const std::vector<TaskTimes> times = {{0, 0, 2, 50}, {0, 0, 1, 20}, {50, 50, 53, 60}, {20, 22, 24, 40}};
  const CriticalPath path = measured_critical_path(two_by_two(), times);
  EXPECT_EQ(path.chain, (std::vector<int32_t>{0, 2}));
  EXPECT_DOUBLE_EQ(path.span_ns, 60);
  EXPECT_DOUBLE_EQ(path.hop_ns, 3);
  EXPECT_DOUBLE_EQ(path.run_ns + path.hop_ns + path.queue_ns + path.lead_ns, path.span_ns);
}

TEST(CriticalPath, ATaskThatWaitsOnNothingComesFromItsQueue) {
  Plan plan = two_by_two();
  plan.tasks[2].wait_counter = 1;  // C waits for nothing: the path reaches it through its queue (a gap)
  plan.tasks[2].wait_threshold = 0;
  const std::vector<TaskTimes> times = {{0, 0, 2, 50}, {0, 0, 1, 20}, {50, 50, 53, 60}, {20, 22, 24, 40}};
  const CriticalPath path = measured_critical_path(plan, times);
  EXPECT_EQ(path.chain, (std::vector<int32_t>{0, 2}));
  EXPECT_DOUBLE_EQ(path.queue_ns, 3);
  EXPECT_EQ(path.hops, 0);
  EXPECT_DOUBLE_EQ(path.lead_ns, 2);
  EXPECT_DOUBLE_EQ(path.span_ns, 60);
}

TEST(CriticalPath, RejectsTimesOfAnotherPlan) {
  EXPECT_THROW(measured_critical_path(two_by_two(), std::vector<TaskTimes>(3)), Error);
}

// A lowered plan, timed by a simulation of the protocol (a task starts 100 ns after both its queue
// predecessor's end and its counter's last release + 700 ns; bodies take 1–4 µs by op): the path's
// parts add up to its span, the span is the run's length, and each link is a producer or a queue edge.
TEST(CriticalPath, OnALoweredPlanThePartsAddUpToTheRun) {
  const auto model = LoadedModel::describe((std::filesystem::path(PLOW_TEST_DATA) / "tiny-kimi-linear" / "config.json").string());
  const Plan plan = lower_to_plan(model->graph, {PlanPhase::kDecode, 1, 4, 0, 42});
  std::vector<int32_t> before(plan.tasks.size(), -1);
  for (const auto& queue : plan.queues) {
    for (size_t i = 1; i < queue.size(); ++i) before[static_cast<size_t>(queue[i])] = queue[i - 1];
  }
  std::vector<double> released(static_cast<size_t>(plan.counters), 0);  // tasks are in op order: signallers come first
  std::vector<TaskTimes> times(plan.tasks.size());
  double last = 0;
  for (size_t t = 0; t < plan.tasks.size(); ++t) {
    const PlanTask& task = plan.tasks[t];
    TaskTimes& now = times[t];
    now.free = before[t] >= 0 ? times[static_cast<size_t>(before[t])].end : 0;
    now.ready = task.wait_threshold > 0 ? std::max(now.free, released[static_cast<size_t>(task.wait_counter)] + 700) : now.free;
    now.start = now.ready + 100;
    now.end = now.start + 1000 * (1 + task.op % 4);
    for (int32_t c : task.signals) released[static_cast<size_t>(c)] = std::max(released[static_cast<size_t>(c)], now.end);
    last = std::max(last, now.end);
  }
  const CriticalPath path = measured_critical_path(plan, times);
  ASSERT_GE(path.tasks, 2);
  EXPECT_DOUBLE_EQ(path.span_ns, last);
  EXPECT_NEAR(path.run_ns + path.hop_ns + path.queue_ns + path.lead_ns, path.span_ns, 1e-6);
  EXPECT_DOUBLE_EQ(path.lead_ns, 100);
  EXPECT_GT(path.hops, 0);
  EXPECT_NEAR(path.hop_ns, 800.0 * static_cast<double>(path.hops), 1e-6);  // each hop: 700 to the wait, 100 to the start
  double by_op = 0;
  for (const CriticalPathOp& op : path.ops) by_op += op.run_ns + op.hop_ns + op.queue_ns;
  EXPECT_NEAR(by_op + path.lead_ns, path.span_ns, 1e-6);
  for (size_t i = 1; i < path.chain.size(); ++i) {
    const int32_t from = path.chain[i - 1], to = path.chain[i];
    const PlanTask& consumer = plan.task(to);
    const bool produced = consumer.wait_threshold > 0 &&
                          std::find(plan.task(from).signals.begin(), plan.task(from).signals.end(), consumer.wait_counter) != plan.task(from).signals.end();
    EXPECT_TRUE(produced || before[static_cast<size_t>(to)] == from) << "link " << from << " → " << to;
  }
}

}  // namespace
}  // namespace plow
