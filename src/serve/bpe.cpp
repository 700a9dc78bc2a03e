// The merge loop: O(n log n) per piece. A queue entry is stale once its left symbol was merged away
// or its pair now merges into a different token; HF checks staleness the same way (by the merged id).
#include "serve/bpe.h"

#include <optional>
#include <queue>

#include "core/error.h"

namespace plow {

namespace {

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  uint32_t start;  // byte offset in the piece
  uint32_t len;    // 0: merged into its left neighbour
};

struct Candidate {
  int32_t rank;
  int32_t pos;  // index of the left symbol; symbol order is byte order, so ties go leftmost
  int32_t id;
  bool operator>(const Candidate& other) const {
    return rank != other.rank ? rank > other.rank : pos > other.pos;
  }
};

template <typename Lookup>
void merge_symbols(std::vector<Symbol>& symbols, const Lookup& lookup) {
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto push = [&](int32_t left) {
    const Symbol& l = symbols[left];
    if (l.next < 0) return;
    if (const std::optional<BpeMerge> m = lookup(l, symbols[l.next])) queue.push({m->rank, left, m->id});
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) push(static_cast<int32_t>(i));
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const std::optional<BpeMerge> current = lookup(left, right);
    if (!current || current->id != top.id) continue;
    left.id = top.id;
    left.len += right.len;
    left.next = right.next;
    right.len = 0;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
}

}  // namespace

void BpeModel::encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  PLOW_CHECK(piece.size() < (size_t{1} << 31), "BPE piece of {} bytes", piece.size());
  if (kind == Kind::kRankByBytes || ignore_merges) {
    if (auto it = vocab.find(piece); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) {
    int32_t id = byte_ids[static_cast<uint8_t>(piece[i])];
    if (id < 0) {
      if (unk_id < 0) continue;  // HF drops a character it has no token for when there is no unk token
      if (fuse_unk && !symbols.empty() && symbols.back().id == unk_id) {
        symbols.back().len += 1;
        continue;
      }
      id = unk_id;
    }
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, -1, static_cast<uint32_t>(i), 1});
    if (index > 0) symbols[index - 1].next = index;
  }
  if (kind == Kind::kMergeTable) {
    merge_symbols(symbols, [&](const Symbol& l, const Symbol& r) -> std::optional<BpeMerge> {
      auto it = merges.find(merge_key(l.id, r.id));
      if (it == merges.end()) return std::nullopt;
      return it->second;
    });
  } else {
    merge_symbols(symbols, [&](const Symbol& l, const Symbol& r) -> std::optional<BpeMerge> {
      auto it = vocab.find(piece.substr(l.start, l.len + r.len));
      if (it == vocab.end()) return std::nullopt;
      return BpeMerge{it->second, it->second};
    });
  }
  for (const Symbol& s : symbols) {
    if (s.len > 0) out.push_back(s.id);
  }
}

}  // namespace plow
