// lower_to_plan: graph → Plan for one bucket. Guarantees (checked again by validate_plan): slices
// cover each op exactly, aligned to its granularity; every task waits for all slices of its inputs and
// for every reader of the arena space it overwrites; queues hold tasks in op order. Slice ops become
// views (no buffer, no tasks): their readers read, wait on and keep alive the buffer's owner.
#include "plan/lower.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "plan/occupants.h"

namespace plow {

namespace {

// First-fit allocator over the arena: free blocks by offset, coalesced on release.
class ArenaAllocator {
 public:
  // The first hole that fits and whose start `prefer(offset)` accepts, else the trailing hole grown
  // when it is accepted, else (grow) fresh space past the end, else first fit.
  template <class Prefer>
  int64_t allocate(int64_t floats, Prefer prefer, bool grow) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < floats || !prefer(it->first)) continue;
      const int64_t offset = it->first, left = it->second - floats;
      free_.erase(it);
      if (left > 0) free_[offset + floats] = left;
      return offset;
    }
    if (!free_.empty() && free_.rbegin()->first + free_.rbegin()->second == end_ && prefer(free_.rbegin()->first)) {
      const int64_t offset = free_.rbegin()->first;
      free_.erase(offset);
      end_ = offset + floats;
      return offset;
    }
    if (grow) {
      end_ += floats;
      return end_ - floats;
    }
    return allocate(floats);
  }

  int64_t allocate(int64_t floats) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < floats) continue;
      const int64_t offset = it->first, left = it->second - floats;
      free_.erase(it);
      if (left > 0) free_[offset + floats] = left;
      return offset;
    }
    if (!free_.empty() && free_.rbegin()->first + free_.rbegin()->second == end_) {  // grow the trailing hole
      const int64_t offset = free_.rbegin()->first;
      free_.erase(offset);
      end_ = offset + floats;
      return offset;
    }
    end_ += floats;
    return end_ - floats;
  }

  void release(int64_t offset, int64_t floats) {
    auto [it, inserted] = free_.emplace(offset, floats);
    PLOW_CHECK(inserted, "arena block at {} released twice", offset);
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

  int64_t size() const { return end_; }

 private:
  std::map<int64_t, int64_t> free_;  // offset → floats
  int64_t end_ = 0;
};

void check_options(const LowerOptions& options) {
  if (options.max_tokens < 1 || options.max_tokens > PlanLimits::kMaxTokens) {
    fail("lower_to_plan: max_tokens {} outside 1..{}", options.max_tokens, PlanLimits::kMaxTokens);
  }
  if (options.workers < 1 || options.workers > PlanLimits::kMaxWorkers) {
    fail("lower_to_plan: workers {} outside 1..{}", options.workers, PlanLimits::kMaxWorkers);
  }
  if (options.light_task_elements < 1) fail("lower_to_plan: light_task_elements {} is below 1", options.light_task_elements);
  if (options.shadow_tail_workers < 0) fail("lower_to_plan: shadow_tail_workers {} is below 0", options.shadow_tail_workers);
  if (options.max_context < 0 || (options.max_context > 0 && options.max_context < options.max_tokens)) {
    fail("lower_to_plan: max_context {} is below the bucket's {} tokens", options.max_context, options.max_tokens);
  }
}

std::vector<PlanOp> copy_ops(const Graph& graph) {
  std::vector<PlanOp> ops;
  for (const Node& node : graph.nodes()) {
    PlanOp op;
    op.opcode = static_cast<uint8_t>(node.op);
    op.attrs = node.attrs;
    op.label = node.label;
    op.inputs.assign(node.inputs.begin(), node.inputs.end());
    op.weights.assign(node.weights.begin(), node.weights.end());
    op.state = node.state;
    op.width = node.width;
    op.dtype = node.dtype;
    ops.push_back(std::move(op));
  }
  return ops;
}

// Ancestry sets are kept for graphs up to this many ops (n² bits); larger ones place buffers by first
// fit alone.
constexpr int32_t kMaxAncestryOps = 8192;

// Places every buffer (first fit, reuse after the last reader) and returns, per op, the earlier ops
// that must finish before it writes: the readers of the space it takes over (or the previous owner
// itself when nothing read it). The output op is never released. `readers` is per buffer owner (a
// read through a view is a read of its owner), `sources` per op the owners of what it reads; views get
// their owner's offset plus their column.
// A buffer whose last reader is op k is released only after the next op's output is placed, so no
// op's output shares floats with the inputs of the op before it: a backend may let an op write its
// reader's output in its epilogue while it still reads its inputs (the cuda prefill path's MLA output
// gate, mla_gemm.h).
// Of the holes that fit, the first whose readers have all finished by the time the op may run anyway
// (each is one of its sources or what those waited for) is taken: space read by an op off its path
// would make it wait for that op. Without such a hole a decode plan's buffer goes past the arena's end
// (its buffers are a bucket of rows: the 48B arena grows by ~3%), a prefill plan's takes the first
// fit (its buffers are chunks of thousands of rows). First fit took the router's logits, free once the top-k had read
// them, for the shared expert's gate/up output, so the shared expert waited for the top-k and every
// worker's routed gate/up behind it (48B decode: 20 of 26 MoE layers, ~9 µs each on the critical path).
std::vector<std::vector<int32_t>> place_buffers(Plan& plan, const std::vector<std::vector<int32_t>>& readers,
                                                const std::vector<std::vector<int32_t>>& sources) {
  const auto n = static_cast<int32_t>(plan.ops.size());
  const bool ancestry = n <= kMaxAncestryOps;
  // done_by[i][j]: op j has finished whenever op i may start (j is a source of i, or done by one).
  std::vector<std::vector<bool>> done_by(ancestry ? plan.ops.size() : 0);
  const auto absorb = [&](std::vector<bool>& done, int32_t s) {  // s finished, and what it waited for
    done[static_cast<size_t>(s)] = true;
    const auto& before = done_by[static_cast<size_t>(s)];
    for (size_t j = 0; j < before.size(); ++j) done[j] = done[j] || before[j];
  };
  std::vector<std::vector<int32_t>> release_after(plan.ops.size());
  for (int32_t i = 0; i < n; ++i) {
    if (plan.ops[static_cast<size_t>(i)].is_view()) continue;
    const int32_t last_use = readers[static_cast<size_t>(i)].empty() ? i : readers[static_cast<size_t>(i)].back();
    if (i != plan.output_op) release_after[static_cast<size_t>(last_use)].push_back(i);
  }
  ArenaAllocator arena;
  OccupantMap occupants;
  std::vector<std::vector<int32_t>> war(plan.ops.size());
  std::vector<int32_t> pending;  // the last placed op's dead buffers, released after the next placement
  for (int32_t i = 0; i < n; ++i) {
    PlanOp& op = plan.ops[static_cast<size_t>(i)];
    if (op.is_view()) {  // its owner is earlier, so already placed (and still live: this view's readers read it)
      op.offset = activation_view(plan, i).offset;
      const auto& dead = release_after[static_cast<size_t>(i)];
      pending.insert(pending.end(), dead.begin(), dead.end());
      continue;
    }
    const int64_t floats = plan.buffer_floats(op);
    std::vector<bool> done(ancestry ? plan.ops.size() : 0, false);
    if (ancestry) {
      for (int32_t s : sources[static_cast<size_t>(i)]) absorb(done, s);
      op.offset = arena.allocate(floats, [&](int64_t offset) {
        for (int32_t previous : occupants.owners(offset, offset + floats)) {
          const auto& read_by = readers[static_cast<size_t>(previous)];
          if (read_by.empty() && !done[static_cast<size_t>(previous)]) return false;
          for (int32_t r : read_by) {
            if (!done[static_cast<size_t>(r)]) return false;
          }
        }
        return true;
      }, plan.phase == PlanPhase::kDecode);
    } else {
      op.offset = arena.allocate(floats);
    }
    for (int32_t previous : occupants.claim(op.offset, op.offset + floats, i)) {
      const auto& read_by = readers[static_cast<size_t>(previous)];
      if (read_by.empty()) {
        war[static_cast<size_t>(i)].push_back(previous);
      } else {
        war[static_cast<size_t>(i)].insert(war[static_cast<size_t>(i)].end(), read_by.begin(), read_by.end());
      }
    }
    if (ancestry) {
      for (int32_t w : war[static_cast<size_t>(i)]) absorb(done, w);
      done_by[static_cast<size_t>(i)] = std::move(done);
    }
    for (int32_t dead : pending) {
      const PlanOp& freed = plan.ops[static_cast<size_t>(dead)];
      arena.release(freed.offset, plan.buffer_floats(freed));
    }
    pending = release_after[static_cast<size_t>(i)];
  }
  plan.arena_floats = arena.size();
  return war;
}

bool is_light(Op op) {
  switch (op) {
    case Op::kShortConvSilu:
    case Op::kKdaGate:
    case Op::kSigmoid:
    case Op::kSiluMul:
    case Op::kAdd:
    case Op::kSituMul:
    case Op::kSigmoidMul:
    case Op::kRmsNorm:
    case Op::kAddNorm:
      return true;
    default:
      return false;
  }
}

// A router task's columns (experts), at least: the router is the one op of its layer's chain whose
// weights are too few to need every worker (48B: 256 experts, 1.2 MB), so that the workers past its
// tasks can take what the order puts after it at once (the add_norm the experts read, when the router
// reads the residual sum's terms: add-norm-into-router). H200, 48B, 4 columns (64 tasks) against ~2
// (132): batch 1 × 0 4.79 against 4.80 ms a step, batch 4 × 0 10.27 against 10.42 (docs/cuda.md; the
// profile did not show that add_norm's readers waiting less, so the mechanism is not established).
constexpr int64_t kRouterTaskColumns = 4;

// Tasks of one op: min(workers, units) slices of near-equal whole units (unit = slice granularity);
// a light op (is_light) at most one a light_task_elements output elements of the bucket. A task costs
// its worker a fixed few µs whatever its size up to a load per thread (H200, 256 threads: add 2.8 µs,
// short_conv_silu and kda_gate 5.2, add_norm 5.9 a task at 1 to 31 columns of one row), so 132 tasks
// of a 4,096-wide decode conv cost 132 workers 5 µs each where 8 tasks cost 8 of them; the rotating
// first worker (below) puts the next op's tasks on the others. An op that spreads (spread_tasks: MLA
// one per worker, moe_topk one per 16 rows, gated_rms_norm one per 8) gets that many tasks when it has
// more than its slices: the tasks past its units own the empty slice [width, width), for backends
// that split its work otherwise (cuda MLA's split-KV, the norm's and moe_topk's rows).
// `reserved`: workers the op's tasks leave alone (a serial op's, for the ops in its shadow: below).
void add_tasks(Plan& plan, const Graph& graph, int32_t op_index, int64_t light_task_elements, int64_t reserved,
               std::vector<std::vector<int32_t>>& tasks_of) {
  const Node& node = graph.node(op_index);
  const int64_t unit = slice_granularity(node);
  PLOW_CHECK(unit > 0 && node.width % unit == 0, "{}: width {} is not a multiple of its slice unit {}", node.label, node.width, unit);
  const int64_t units = node.width / unit;
  int64_t slices = std::min<int64_t>(plan.workers - reserved, units);
  if (is_light(node.op)) slices = std::clamp<int64_t>((plan.max_tokens * node.width + light_task_elements - 1) / light_task_elements, 1, slices);
  if (node.op == Op::kRouterLogits || node.op == Op::kAddNormRouterLogits) slices = std::min<int64_t>(slices, (units + kRouterTaskColumns - 1) / kRouterTaskColumns);
  const int64_t tasks = std::max<int64_t>(spread_tasks(node, plan.workers, plan.max_tokens), slices);
  for (int64_t s = 0; s < tasks; ++s) {
    PlanTask task;
    task.op = op_index;
    task.col_begin = s < slices ? units * s / slices * unit : node.width;
    task.col_end = s < slices ? units * (s + 1) / slices * unit : node.width;
    task.wait_counter = op_index;  // one counter per op, on the consumer side
    tasks_of[static_cast<size_t>(op_index)].push_back(static_cast<int32_t>(plan.tasks.size()));
    plan.tasks.push_back(std::move(task));
  }
}

}  // namespace

Plan lower_to_plan(const Graph& graph, const LowerOptions& options) {
  check_options(options);
  graph.verify();
  if (graph.nodes().size() > static_cast<size_t>(PlanLimits::kMaxOps)) fail("lower_to_plan: {} ops, the limit is {}", graph.nodes().size(), PlanLimits::kMaxOps);
  Plan plan;
  plan.model_fingerprint = options.model_fingerprint;
  plan.phase = options.phase;
  plan.max_tokens = options.max_tokens;
  plan.workers = options.workers;
  plan.ops = copy_ops(graph);
  plan.weights = graph.weights();
  plan.states = graph.states();
  plan.output_op = graph.output();
  plan.counters = static_cast<int32_t>(plan.ops.size());
  if (plan.ops[static_cast<size_t>(plan.output_op)].is_view()) {
    fail("lower_to_plan: the output '{}' is a slice; backends read the logits from a buffer of their own", plan.ops[static_cast<size_t>(plan.output_op)].label);
  }

  // Per op, the ops owning the buffers it reads (a view's owner stands for the view): what it waits on
  // (read after write) and what must stay live until it has run.
  const size_t n = plan.ops.size();
  std::vector<std::vector<int32_t>> sources_of(n);
  std::vector<std::vector<int32_t>> readers(n);  // per buffer owner: distinct, ascending
  for (size_t j = 0; j < n; ++j) {
    if (plan.ops[j].is_view()) continue;
    for (int32_t input : plan.ops[j].inputs) {
      const int32_t owner = activation_view(plan, input).owner;
      sources_of[j].push_back(owner);
      auto& list = readers[static_cast<size_t>(owner)];
      if (list.empty() || list.back() != static_cast<int32_t>(j)) list.push_back(static_cast<int32_t>(j));
    }
  }
  const std::vector<std::vector<int32_t>> war = place_buffers(plan, readers, sources_of);

  // A serial op's shadow: the ops after it and before its first reader (the compiler's schedule puts
  // there what can run while it does, compiler/schedule.h) leave its workers alone, so that those go
  // on to its readers as soon as it ends. Round-robin gave the top-k's worker a task of the shared
  // expert too, between the top-k and that worker's routed gate/up: the routed experts' last task
  // started ~10 µs after the top-k ended (48B decode, every MoE layer on the measured critical path).
  std::vector<int32_t> shadow_of(n, -1);
  for (size_t i = 0; i < n; ++i) {
    if (plan.ops[i].op() != Op::kMoeTopK || readers[i].empty()) continue;
    if (spread_tasks(graph.node(static_cast<int>(i)), plan.workers, plan.max_tokens) * 2 > plan.workers) continue;
    for (int32_t j = static_cast<int32_t>(i) + 1; j < readers[i].front(); ++j) shadow_of[static_cast<size_t>(j)] = static_cast<int32_t>(i);
  }

  // A shadow's tail: its last ops, but light ones, that neither the serial op's first reader nor an op
  // before that reads (the shared expert's down projection, read by the routed down op; K3's shadow
  // holds the shared expert's situ_mul, two light tasks, and keeps it). With shadow_tail_workers D, a
  // tail op runs on D workers of its own and the first reader (the routed gate/up) on the others, so
  // the tail runs beside the first reader instead of before it on every worker: the shared expert's
  // two projections overran the top-k's shadow by ~9 µs a MoE layer, all of it on the critical path
  // (48B decode, docs/cuda.md). tail_of[j]: the serial op whose tail j is; tail_beside[r]: the serial
  // op whose tail runs beside r.
  std::vector<int32_t> tail_of(n, -1), tail_beside(n, -1);
  const int64_t tail_workers = options.shadow_tail_workers;
  if (tail_workers > 0 && tail_workers * LowerOptions::kWorkersPerTailWorker <= plan.workers) {
    for (size_t serial = 0; serial < n; ++serial) {
      if (plan.ops[serial].op() != Op::kMoeTopK || readers[serial].empty()) continue;
      const int32_t first_reader = readers[serial].front();
      if (shadow_of[static_cast<size_t>(first_reader) - 1] != static_cast<int32_t>(serial) || spreads_over_workers(plan.ops[static_cast<size_t>(first_reader)].op())) continue;
      // The tail is the shadow's last ops: one before an op the first reader needs would hold that op back
      // on the tail's workers (K3's full config puts the shared gate/up before the latent down projection).
      for (int32_t j = first_reader - 1; j > static_cast<int32_t>(serial); --j) {
        const PlanOp& op = plan.ops[static_cast<size_t>(j)];
        if (op.is_view()) continue;
        // A light op fits the shadow; a tail op's tasks must fit its workers.
        const bool tail = !is_light(op.op()) && !readers[static_cast<size_t>(j)].empty() && readers[static_cast<size_t>(j)].front() > first_reader &&
                          spread_tasks(graph.node(j), plan.workers, plan.max_tokens) <= tail_workers;
        if (!tail) break;
        tail_of[static_cast<size_t>(j)] = static_cast<int32_t>(serial);
        tail_beside[static_cast<size_t>(first_reader)] = static_cast<int32_t>(serial);
      }
    }
  }

  // kTokens is written by the backend before the workers start, and a view is read in place: neither
  // has tasks.
  std::vector<std::vector<int32_t>> tasks_of(n);
  for (size_t i = 0; i < n; ++i) {
    if (plan.ops[i].op() == Op::kTokens || plan.ops[i].is_view()) continue;
    const int32_t serial = shadow_of[i];
    int64_t reserved = serial >= 0 && !spreads_over_workers(plan.ops[i].op()) ? static_cast<int64_t>(tasks_of[static_cast<size_t>(serial)].size()) : 0;
    if (tail_of[i] >= 0) reserved = plan.workers - tail_workers;
    if (tail_beside[i] >= 0) reserved = tail_workers;
    add_tasks(plan, graph, static_cast<int32_t>(i), options.light_task_elements, reserved, tasks_of);
  }

  // Every task of op Y waits for all tasks of the owners of Y's inputs (read after write) and of the
  // readers of the space Y's buffer takes over (write after read); each of those signals Y's counter once.
  for (size_t y = 0; y < n; ++y) {
    if (tasks_of[y].empty()) continue;
    std::vector<int32_t> sources = sources_of[y];
    sources.insert(sources.end(), war[y].begin(), war[y].end());
    std::sort(sources.begin(), sources.end());
    sources.erase(std::unique(sources.begin(), sources.end()), sources.end());
    int64_t threshold = 0;
    for (int32_t source : sources) {
      PLOW_CHECK(static_cast<size_t>(source) < y, "op {} depends on later op {}", y, source);
      for (int32_t t : tasks_of[static_cast<size_t>(source)]) plan.tasks[static_cast<size_t>(t)].signals.push_back(static_cast<int32_t>(y));
      threshold += static_cast<int64_t>(tasks_of[static_cast<size_t>(source)].size());
    }
    for (int32_t t : tasks_of[y]) plan.tasks[static_cast<size_t>(t)].wait_threshold = threshold;
  }

  // Queues: tasks in op order; an op's slices go round-robin from a rotating first worker. Why this
  // cannot deadlock: every wait is on tasks of strictly earlier ops, and each queue holds at most one
  // task per op in increasing op order. Take the unfinished task of the lowest op: everything it waits
  // for belongs to earlier ops, so it is finished; everything ahead of it in its queue belongs to
  // earlier ops, so that is finished too. Its worker therefore reaches it and runs it; by induction
  // every task runs, whatever the interleaving and whatever the delays.
  // An op in a serial op's shadow skips that op's workers (its tasks fit the others: add_tasks). A
  // shadow's tail runs on the tail_workers workers after the serial op's first worker, and the serial
  // op's first reader skips those.
  plan.queues.assign(static_cast<size_t>(plan.workers), {});
  std::vector<int32_t> worker_of(plan.tasks.size(), -1);
  const auto tail_set = [&](int32_t serial) {  // the tail_workers workers after the serial op's first one, not its own
    const auto workers = static_cast<size_t>(plan.workers);
    std::vector<bool> serial_runs(workers, false), in(workers, false);
    for (int32_t t : tasks_of[static_cast<size_t>(serial)]) serial_runs[static_cast<size_t>(worker_of[static_cast<size_t>(t)])] = true;
    size_t w = static_cast<size_t>(worker_of[static_cast<size_t>(tasks_of[static_cast<size_t>(serial)].front())]);
    for (int64_t taken = 0; taken < tail_workers;) {
      w = (w + 1) % workers;
      if (serial_runs[w]) continue;
      in[w] = true;
      ++taken;
    }
    return in;
  };
  int32_t first_worker = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& list = tasks_of[i];
    std::vector<bool> skip(static_cast<size_t>(plan.workers), false);
    if (shadow_of[i] >= 0 && list.size() + tasks_of[static_cast<size_t>(shadow_of[i])].size() <= static_cast<size_t>(plan.workers)) {
      for (int32_t t : tasks_of[static_cast<size_t>(shadow_of[i])]) skip[static_cast<size_t>(worker_of[static_cast<size_t>(t)])] = true;
    }
    if (tail_of[i] >= 0 && !list.empty()) {
      skip = tail_set(tail_of[i]);
      skip.flip();
    }
    if (tail_beside[i] >= 0) skip = tail_set(tail_beside[i]);
    size_t w = static_cast<size_t>(first_worker);
    for (int32_t t : list) {
      while (skip[w]) w = (w + 1) % static_cast<size_t>(plan.workers);
      plan.queues[w].push_back(t);
      worker_of[static_cast<size_t>(t)] = static_cast<int32_t>(w);
      w = (w + 1) % static_cast<size_t>(plan.workers);
    }
    first_worker = static_cast<int32_t>(w);
  }
  if (plan.tasks.size() > static_cast<size_t>(PlanLimits::kMaxTasks) || plan.arena_floats > PlanLimits::kMaxArenaFloats) {
    fail("lower_to_plan: {} tasks and an arena of {} floats exceed the plan limits ({} tasks, {} floats)", plan.tasks.size(),
         plan.arena_floats, PlanLimits::kMaxTasks, PlanLimits::kMaxArenaFloats);
  }
  return plan;
}

}  // namespace plow
