// Byte-pair encoding of one pre-tokenized piece, for both vocabularies plow reads: HF merge tables
// (a pair of ids merges at the rank of its line in `merges`) and tiktoken ranks (two adjacent parts
// merge at the rank of their concatenated bytes). Merging is a priority queue over a linked list,
// lowest rank first and leftmost on ties, which is the order both reference implementations follow.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace plow {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
// Lookup by string_view without building a std::string.
using BytesToId = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeMerge {
  int32_t rank;
  int32_t id;  // the merged token
};

struct BpeModel {
  enum class Kind { kMergeTable, kRankByBytes };
  Kind kind = Kind::kMergeTable;
  BytesToId vocab;                    // model tokens by their bytes (tiktoken: id == rank)
  std::array<int32_t, 256> byte_ids;  // token of each single byte, -1 when the vocabulary lacks it
  std::unordered_map<uint64_t, BpeMerge> merges;  // kMergeTable: key = left id << 32 | right id
  bool ignore_merges = false;  // kMergeTable: a piece that is itself a token is emitted whole
  int32_t unk_id = -1;         // kMergeTable: stands for bytes without a token (else they are dropped, as HF does)
  bool fuse_unk = false;

  BpeModel() { byte_ids.fill(-1); }
  static uint64_t merge_key(int32_t left, int32_t right) {
    return static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32 | static_cast<uint32_t>(right);
  }
  // Appends the ids of piece (raw bytes) to out.
  void encode(std::string_view piece, std::vector<int32_t>& out) const;
};

}  // namespace plow
