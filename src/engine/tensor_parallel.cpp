#include "engine/tensor_parallel.h"

#include <exception>
#include <condition_variable>
#include <future>
#include <mutex>

#include "core/error.h"

namespace plow {

TensorParallelBackend::TensorParallelBackend(std::vector<TpRank> ranks, TpGroupControl control)
    : control_(std::move(control)), ranks_(std::move(ranks)) {
  if (ranks_.empty()) fail("tensor parallelism: no ranks");
  PLOW_CHECK(ranks_[0].model, "tensor parallelism: rank 0 without its model (the state table of every rank)");
  for (const TpRank& r : ranks_) {
    PLOW_CHECK(r.backend, "tensor parallelism: a rank without a backend");
    if (r.backend->num_slots() != ranks_[0].backend->num_slots() || r.backend->act_dtype() != ranks_[0].backend->act_dtype()) {
      fail("tensor parallelism: the ranks' backends differ in slots or activation dtype");
    }
  }
  states_per_rank_ = ranks_[0].model->graph.states().size();
}

TensorParallelBackend::~TensorParallelBackend() = default;

void TensorParallelBackend::on_every_rank(const std::function<void(int)>& fn) {
  // The first failure is the cause. A rank that fails gives the others control_.abort_after to finish
  // (they fail the same way when the input was at fault); ranks still running then are waiting in a
  // collective for it, and the group is aborted so that they fail instead of hanging.
  std::mutex mutex;
  std::condition_variable cv;
  std::exception_ptr first;
  int finished = 0;
  auto guarded = [&](int r) {
    try {
      fn(r);
    } catch (...) {
      std::unique_lock lock(mutex);
      if (!first) first = std::current_exception();
      finished += 1;
      cv.notify_all();
      if (!cv.wait_for(lock, control_.abort_after, [&] { return finished == size(); }) && control_.abort) {
        lock.unlock();
        control_.abort();
      }
      return;
    }
    const std::lock_guard lock(mutex);
    finished += 1;
    cv.notify_all();
  };
  std::vector<std::future<void>> others;
  for (int r = 1; r < size(); ++r) others.push_back(std::async(std::launch::async, guarded, r));
  guarded(0);
  for (auto& f : others) f.get();
  if (first) {
    if (control_.reset) control_.reset();
    std::rethrow_exception(first);
  }
}

StepOutput TensorParallelBackend::step(const StepInputs& inputs) {
  StepInputs rank_inputs = inputs;
  rank_inputs.argmax_only = false;  // a rank's argmax would be of its block of the vocabulary: gather logits
  std::vector<StepOutput> outputs(ranks_.size());
  on_every_rank([&](int r) { outputs[static_cast<size_t>(r)] = ranks_[static_cast<size_t>(r)].backend->step(rank_inputs); });
  StepOutput result;
  result.rows = outputs[0].rows;
  for (const StepOutput& o : outputs) {
    PLOW_CHECK(o.rows == result.rows, "tensor parallelism: ranks returned {} and {} rows", o.rows, result.rows);
    result.vocab += o.vocab;
  }
  result.logits.reserve(static_cast<size_t>(result.rows * result.vocab));
  for (int64_t row = 0; row < result.rows; ++row) {
    for (const StepOutput& o : outputs) {
      const auto* begin = o.logits.data() + row * o.vocab;
      result.logits.insert(result.logits.end(), begin, begin + o.vocab);
    }
  }
  return result;
}

void TensorParallelBackend::reset_slot(int slot) {
  for (TpRank& r : ranks_) r.backend->reset_slot(slot);
}

int64_t TensorParallelBackend::context_tokens(int slot) const { return ranks_[0].backend->context_tokens(slot); }
int TensorParallelBackend::num_slots() const { return ranks_[0].backend->num_slots(); }
DType TensorParallelBackend::act_dtype() const { return ranks_[0].backend->act_dtype(); }

bool TensorParallelBackend::has_snapshots() const {
  for (const TpRank& r : ranks_) {
    if (!r.backend->has_snapshots()) return false;
  }
  return true;
}

SlotSnapshot TensorParallelBackend::save_slot(int slot, int64_t rows_begin) const {
  SlotSnapshot snap = ranks_[0].backend->save_slot(slot, rows_begin);
  for (size_t r = 1; r < ranks_.size(); ++r) {
    SlotSnapshot part = ranks_[r].backend->save_slot(slot, snap.tokens);  // fixed-size states only
    for (size_t i = 0; i < part.fixed.size(); ++i) {
      snap.row_floats.push_back(0);
      snap.fixed.push_back(std::move(part.fixed[i]));
      snap.rows.emplace_back();
    }
  }
  return snap;
}

void TensorParallelBackend::restore_slot(int slot, const SlotSnapshot& snapshot) {
  const size_t k = states_per_rank_;
  if (snapshot.fixed.size() != k * ranks_.size() || snapshot.rows.size() != snapshot.fixed.size() ||
      snapshot.row_floats.size() != snapshot.fixed.size()) {
    fail("restore_slot: the snapshot has {} states, {} ranks of this model have {}", snapshot.fixed.size(), ranks_.size(), k * ranks_.size());
  }
  for (size_t r = 0; r < ranks_.size(); ++r) {
    SlotSnapshot part;
    part.tokens = snapshot.tokens;
    part.rows_begin = snapshot.rows_begin;
    for (size_t i = 0; i < k; ++i) {
      part.row_floats.push_back(snapshot.row_floats[i]);
      part.fixed.push_back(snapshot.fixed[r * k + i]);
      part.rows.push_back(snapshot.rows[i]);  // per-token states are rank 0's (replicated)
    }
    ranks_[r].backend->restore_slot(slot, part);
  }
}

std::unique_ptr<TensorParallelBackend> make_local_tp_backend(int size, const std::function<std::unique_ptr<LoadedModel>(TpShard)>& load,
                                                             const std::function<std::unique_ptr<Backend>(const LoadedModel&, Collective&)>& make) {
  auto group = std::make_shared<LocalGroup>(size);
  std::vector<TpRank> ranks;
  for (int r = 0; r < size; ++r) {
    TpRank rank;
    rank.model = load({r, size});
    rank.backend = make(*rank.model, group->rank(r));
    ranks.push_back(std::move(rank));
  }
  TpGroupControl control;
  control.abort = [g = group.get()] { g->abort(); };
  control.reset = [g = group.get()] { g->reset(); };
  control.keep_alive = group;
  return std::make_unique<TensorParallelBackend>(std::move(ranks), std::move(control));
}

}  // namespace plow
