#include "engine/prefix_cache.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace plow {

struct PrefixCache::Node {
  Node* parent = nullptr;
  std::vector<int32_t> block;  // page_tokens ids; empty for the root
  int64_t depth = 0;           // blocks between the root and here
  int32_t page = -1;           // latent rows of `block`; -1 for the root
  int64_t locks = 0;           // sequences holding a path through here (the root counts them all)
  std::map<std::vector<int32_t>, std::unique_ptr<Node>> children;  // by block
  std::map<std::vector<int32_t>, std::unique_ptr<Entry>> entries;  // by tail
};

struct PrefixCache::Entry {
  Node* node = nullptr;
  std::vector<int32_t> tail;                  // tokens after the node's blocks (< page_tokens)
  std::vector<std::vector<float>> fixed;      // per state: fixed-size buffers (KDA, conv)
  std::vector<std::vector<float>> tail_rows;  // per state: [tail, row_floats] latent rows
  uint64_t last_used = 0;
  int64_t bytes = 0;
};

namespace {
constexpr int64_t kMaxPages = int64_t{1} << 20;  // bounds the page table (~24 MB of headers), whatever the budget
}

PrefixCache::PrefixCache(int64_t budget_bytes, int64_t page_tokens)
    : budget_bytes_(budget_bytes), page_tokens_(page_tokens), root_(std::make_unique<Node>()) {
  PLOW_CHECK(budget_bytes > 0 && page_tokens >= 1, "prefix cache budget {} bytes, blocks of {} tokens", budget_bytes, page_tokens);
}

PrefixCache::~PrefixCache() = default;

void PrefixCache::init_layout(const SlotSnapshot& snapshot) {
  if (pool_) {
    std::vector<int64_t> fixed;
    for (const auto& f : snapshot.fixed) fixed.push_back(static_cast<int64_t>(f.size()));
    PLOW_CHECK(snapshot.row_floats == row_floats_ && fixed == fixed_floats_, "prefix cache: the slot state layout changed between inserts");
    return;
  }
  row_floats_ = snapshot.row_floats;
  for (const auto& f : snapshot.fixed) fixed_floats_.push_back(static_cast<int64_t>(f.size()));
  const int64_t row = std::accumulate(row_floats_.begin(), row_floats_.end(), int64_t{0});
  const int64_t page_bytes = page_tokens_ * row * static_cast<int64_t>(sizeof(float));
  pool_.emplace(page_tokens_, row, page_bytes > 0 ? std::min(budget_bytes_ / page_bytes, kMaxPages) : kMaxPages);
}

void PrefixCache::touch(Entry& entry) {
  if (entry.last_used != 0) lru_.erase(entry.last_used);
  entry.last_used = ++clock_;
  lru_[entry.last_used] = &entry;
}

std::optional<PrefixCache::Hit> PrefixCache::match(std::span<const int32_t> tokens, int64_t max_tokens) {
  std::optional<Hit> best;
  Node* node = root_.get();
  const auto n = static_cast<int64_t>(tokens.size());
  for (int64_t pos = 0;; pos += page_tokens_) {
    for (const auto& [tail, entry] : node->entries) {
      const int64_t end = pos + static_cast<int64_t>(tail.size());
      if (end == 0 || end > std::min(max_tokens, n)) continue;
      if (!std::equal(tail.begin(), tail.end(), tokens.begin() + pos)) continue;
      if (!best || end > best->tokens) best = Hit{end, node, entry.get()};
    }
    if (pos + page_tokens_ > std::min(max_tokens, n)) break;
    auto child = node->children.find(std::vector<int32_t>(tokens.begin() + pos, tokens.begin() + pos + page_tokens_));
    if (child == node->children.end()) break;
    node = child->second.get();
  }
  if (best) touch(*const_cast<Entry*>(best->entry));
  return best;
}

SlotSnapshot PrefixCache::materialize(const Hit& hit) const {
  PLOW_CHECK(hit.node && hit.entry && hit.entry->node == hit.node, "materialize of a hit without its node and entry");
  std::vector<const Node*> path;
  for (const Node* n = hit.node; n->parent; n = n->parent) path.push_back(n);
  std::reverse(path.begin(), path.end());
  SlotSnapshot snap;
  snap.tokens = hit.tokens;
  snap.row_floats = row_floats_;
  snap.fixed = hit.entry->fixed;
  snap.rows.resize(row_floats_.size());
  int64_t offset = 0;  // of this state's rows within a page
  for (size_t s = 0; s < row_floats_.size(); ++s) {
    const int64_t block_floats = page_tokens_ * row_floats_[s];
    std::vector<float>& rows = snap.rows[s];
    rows.reserve(static_cast<size_t>(hit.tokens * row_floats_[s]));
    for (const Node* n : path) {
      const float* data = pool_->data(n->page) + offset;
      rows.insert(rows.end(), data, data + block_floats);
    }
    rows.insert(rows.end(), hit.entry->tail_rows[s].begin(), hit.entry->tail_rows[s].end());
    offset += block_floats;
  }
  return snap;
}

void PrefixCache::lock(Node* node) {
  for (Node* n = node; n; n = n->parent) {
    ++n->locks;
    if (n->page >= 0) pool_->ref(n->page);
  }
  ++locks_;
}

void PrefixCache::unlock(Node* node) {
  PLOW_CHECK(node && node->locks > 0, "unlock of a path that is not locked");
  for (Node* n = node; n; n = n->parent) {
    --n->locks;
    if (n->page >= 0) pool_->unref(n->page);
  }
  --locks_;
  prune(node);
}

void PrefixCache::remove_entry(Entry& entry) {
  lru_.erase(entry.last_used);
  entry_bytes_ -= entry.bytes;
  Node* node = entry.node;
  node->entries.erase(entry.tail);  // destroys `entry`
  prune(node);
}

// Drops nodes that can no longer lead to a snapshot: unlocked leaves without entries, upwards.
void PrefixCache::prune(Node* node) {
  while (node->parent && node->children.empty() && node->entries.empty() && node->locks == 0) {
    Node* parent = node->parent;
    pool_->unref(node->page);
    --nodes_;
    parent->children.erase(node->block);  // destroys `node`
    node = parent;
  }
}

bool PrefixCache::evict_one() {
  if (lru_.empty()) return false;
  remove_entry(*lru_.begin()->second);
  ++evictions_;
  return true;
}

bool PrefixCache::insert(std::span<const int32_t> tokens, const Backend& backend, int slot) {
  const auto n = static_cast<int64_t>(tokens.size());
  PLOW_CHECK(backend.context_tokens(slot) == n, "insert of {} tokens from slot {} holding {}", n, slot, backend.context_tokens(slot));
  if (n == 0) return false;
  const int64_t blocks = n / page_tokens_;
  const std::vector<int32_t> tail(tokens.begin() + blocks * page_tokens_, tokens.end());
  Node* node = root_.get();
  int64_t shared = 0;  // blocks already in the tree
  while (shared < blocks) {
    auto child = node->children.find(std::vector<int32_t>(tokens.begin() + shared * page_tokens_, tokens.begin() + (shared + 1) * page_tokens_));
    if (child == node->children.end()) break;
    node = child->second.get();
    ++shared;
  }
  if (shared == blocks) {
    auto existing = node->entries.find(tail);
    if (existing != node->entries.end()) {  // the same tokens again: keep the first snapshot
      touch(*existing->second);
      return true;
    }
  }
  SlotSnapshot snap = backend.save_slot(slot, shared * page_tokens_);
  init_layout(snap);
  const int64_t new_pages = blocks - shared;
  const int64_t tail_tokens = static_cast<int64_t>(tail.size());
  int64_t entry_floats = 0;
  for (size_t s = 0; s < row_floats_.size(); ++s) entry_floats += fixed_floats_[s] + tail_tokens * row_floats_[s];
  const int64_t entry_bytes = entry_floats * static_cast<int64_t>(sizeof(float));
  const int64_t need = new_pages * pool_->page_bytes() + entry_bytes;
  if (need > budget_bytes_ || new_pages > pool_->pages_capacity()) return false;
  lock(node);  // the shared path survives the evictions below
  bool fits = true;
  while (stats().bytes_used + need > budget_bytes_ || !pool_->can_allocate(new_pages)) {
    if (!evict_one()) {
      fits = false;
      break;
    }
  }
  Node* locked = node;
  if (fits) {
    for (int64_t b = shared; b < blocks; ++b) {
      auto child = std::make_unique<Node>();
      child->parent = node;
      child->block.assign(tokens.begin() + b * page_tokens_, tokens.begin() + (b + 1) * page_tokens_);
      child->depth = b + 1;
      child->page = pool_->allocate();
      float* page = pool_->data(child->page);
      for (size_t s = 0; s < row_floats_.size(); ++s) {
        const int64_t block_floats = page_tokens_ * row_floats_[s];
        const float* rows = snap.rows[s].data() + (b - shared) * block_floats;
        std::copy(rows, rows + block_floats, page);
        page += block_floats;
      }
      Node* raw = child.get();
      node->children.emplace(child->block, std::move(child));
      node = raw;
      ++nodes_;
    }
    auto entry = std::make_unique<Entry>();
    entry->node = node;
    entry->tail = tail;
    entry->fixed = std::move(snap.fixed);
    entry->tail_rows.resize(row_floats_.size());
    for (size_t s = 0; s < row_floats_.size(); ++s) {
      const std::vector<float>& rows = snap.rows[s];
      entry->tail_rows[s].assign(rows.end() - tail_tokens * row_floats_[s], rows.end());
    }
    entry->bytes = entry_bytes;
    entry_bytes_ += entry_bytes;
    Entry& stored = *node->entries.emplace(tail, std::move(entry)).first->second;
    touch(stored);
  }
  unlock(locked);
  return fits;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s;
  s.budget_bytes = budget_bytes_;
  s.pages_used = pool_ ? pool_->pages_used() : 0;
  s.bytes_used = (pool_ ? s.pages_used * pool_->page_bytes() : 0) + entry_bytes_;
  s.nodes = nodes_;
  s.entries = static_cast<int64_t>(lru_.size());
  s.locks = locks_;
  s.evictions = evictions_;
  return s;
}

void PrefixCache::check_integrity() const {
  std::vector<int32_t> expected(pool_ ? static_cast<size_t>(pool_->pages_capacity()) : 0, 0);
  int64_t nodes = 0, entries = 0, bytes = 0;
  std::vector<const Node*> stack{root_.get()};
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    int64_t child_locks = 0;
    for (const auto& [block, child] : node->children) {
      PLOW_CHECK(child->parent == node && child->block == block && static_cast<int64_t>(block.size()) == page_tokens_ &&
                     child->depth == node->depth + 1,
                 "prefix cache node at depth {} is linked inconsistently", child->depth);
      PLOW_CHECK(child->page >= 0 && child->page < static_cast<int32_t>(expected.size()), "node at depth {} holds page {}", child->depth, child->page);
      expected[static_cast<size_t>(child->page)] += static_cast<int32_t>(1 + child->locks);
      child_locks += child->locks;
      ++nodes;
      stack.push_back(child.get());
    }
    PLOW_CHECK(child_locks <= node->locks, "node at depth {} has {} locks, its children {}", node->depth, node->locks, child_locks);
    PLOW_CHECK(!node->parent || !node->children.empty() || !node->entries.empty() || node->locks > 0,
               "an unlocked leaf at depth {} holds no snapshot (it should have been pruned)", node->depth);
    for (const auto& [tail, entry] : node->entries) {
      PLOW_CHECK(entry->node == node && entry->tail == tail && static_cast<int64_t>(tail.size()) < page_tokens_, "entry at depth {} is misplaced",
                 node->depth);
      auto it = lru_.find(entry->last_used);
      PLOW_CHECK(it != lru_.end() && it->second == entry.get(), "entry at depth {} is missing from the LRU index", node->depth);
      ++entries;
      bytes += entry->bytes;
    }
  }
  PLOW_CHECK(root_->locks == locks_, "{} locks held, the root counts {}", locks_, root_->locks);
  PLOW_CHECK(nodes == nodes_ && entries == static_cast<int64_t>(lru_.size()) && bytes == entry_bytes_,
             "tree has {} nodes / {} entries / {} entry bytes, counters say {} / {} / {}", nodes, entries, bytes, nodes_, lru_.size(), entry_bytes_);
  if (pool_) {
    pool_->check_integrity(&expected);
    PLOW_CHECK(pool_->pages_used() == nodes_, "{} pages used by {} nodes", pool_->pages_used(), nodes_);
  }
  PLOW_CHECK(stats().bytes_used <= budget_bytes_, "prefix cache holds {} bytes over its budget of {}", stats().bytes_used, budget_bytes_);
}

}  // namespace plow
