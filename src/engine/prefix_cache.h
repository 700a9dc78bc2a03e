// Hybrid prefix cache (DESIGN.md §6): a radix tree over blocks of `page_tokens` prompt tokens. Each
// node holds one PagePool page with the MLA latent rows of its block; a node may also hold snapshot
// entries: the fixed-size state (KDA recurrent + conv windows) after exactly depth·page_tokens +
// |tail| tokens, with the tail's tokens and latent rows. A hybrid model resumes only where such a
// snapshot exists, so the scheduler takes them at prompt ends and turn ends. Memory (pages + entries)
// stays under a byte budget by evicting least-recently-used entries and then the nodes left useless.
// Invariants (check_integrity): every page is held by exactly one node, with 1 + locks references;
// an unlocked leaf holds an entry; bytes_used = pages·page_bytes + Σ entry bytes ≤ budget.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "engine/page_pool.h"
#include "runtime/backend.h"

namespace plow {

struct PrefixCacheStats {
  int64_t budget_bytes = 0;
  int64_t bytes_used = 0;
  int64_t pages_used = 0;
  int64_t nodes = 0;      // blocks in the tree (the root excluded)
  int64_t entries = 0;    // snapshots
  int64_t locks = 0;      // sequences holding a path
  int64_t evictions = 0;  // entries evicted since start
};

class PrefixCache {
 public:
  struct Node;
  struct Entry;
  struct Hit {
    int64_t tokens = 0;  // cached prefix length: the restored slot has consumed exactly these
    Node* node = nullptr;
    const Entry* entry = nullptr;
  };

  // budget_bytes > 0; page_tokens ≥ 1 (the block size of the tree and of the pages).
  PrefixCache(int64_t budget_bytes, int64_t page_tokens);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // The longest prefix of `tokens`, at most max_tokens long, that ends at a snapshot; marks it used.
  std::optional<Hit> match(std::span<const int32_t> tokens, int64_t max_tokens);
  // The whole slot state of a hit (rows from 0), for Backend::restore_slot.
  SlotSnapshot materialize(const Hit& hit) const;
  // A sequence that restored `hit` holds its path (pages referenced, never evicted) until unlock().
  void lock(Node* node);
  void unlock(Node* node);

  // Records the state of `slot`, which has consumed exactly `tokens`. Shares the blocks already in
  // the tree, copies the new blocks' rows into fresh pages. False when it does not fit the budget
  // even after eviction (nothing changes then).
  bool insert(std::span<const int32_t> tokens, const Backend& backend, int slot);

  PrefixCacheStats stats() const;
  int64_t page_tokens() const { return page_tokens_; }
  // InternalError when an invariant above is broken (tests call it after every step).
  void check_integrity() const;

 private:
  void init_layout(const SlotSnapshot& snapshot);
  void touch(Entry& entry);
  bool evict_one();  // the least recently used entry, and the nodes it leaves useless
  void prune(Node* node);
  void remove_entry(Entry& entry);

  int64_t budget_bytes_;
  int64_t page_tokens_;
  std::unique_ptr<Node> root_;
  std::optional<PagePool> pool_;               // created at the first insert, when the row width is known
  std::vector<int64_t> row_floats_;            // per state (0: fixed-size)
  std::vector<int64_t> fixed_floats_;          // per state
  std::map<uint64_t, Entry*> lru_;             // last use → entry, oldest first
  uint64_t clock_ = 0;
  int64_t entry_bytes_ = 0;
  int64_t nodes_ = 0;
  int64_t locks_ = 0;
  int64_t evictions_ = 0;
};

}  // namespace plow
