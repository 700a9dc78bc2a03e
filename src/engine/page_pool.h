// The paged MLA latent cache's block manager: fixed pages of `page_tokens` latent rows (every MLA
// layer's row for those positions), ref-counted. The prefix cache accounts its memory in these pages
// and shares a page between every conversation whose prefix covers it. Managers split checking from
// committing (can_allocate / allocate); check_integrity() proves no page is leaked or freed twice.
#pragma once

#include <cstdint>
#include <vector>

namespace plow {

class PagePool {
 public:
  // row_floats: floats of one token's rows over all MLA layers. capacity_pages ≥ 0.
  PagePool(int64_t page_tokens, int64_t row_floats, int64_t capacity_pages);

  bool can_allocate(int64_t pages) const { return pages <= pages_free(); }
  int32_t allocate();                 // a free page with one reference; InternalError when none is free
  void ref(int32_t page);             // one more holder of a used page
  void unref(int32_t page);           // one holder less; at zero the page is free again
  int32_t refs(int32_t page) const;

  float* data(int32_t page);          // [page_tokens, row_floats]
  const float* data(int32_t page) const;

  int64_t page_tokens() const { return page_tokens_; }
  int64_t row_floats() const { return row_floats_; }
  int64_t page_bytes() const { return page_tokens_ * row_floats_ * static_cast<int64_t>(sizeof(float)); }
  int64_t pages_capacity() const { return static_cast<int64_t>(refs_.size()); }
  int64_t pages_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t pages_used() const { return pages_capacity() - pages_free(); }

  // Every page is either free (no references, listed exactly once) or used (references > 0, not
  // listed). `expected_refs`, when given ([capacity]), must equal every page's count. InternalError otherwise.
  void check_integrity(const std::vector<int32_t>* expected_refs = nullptr) const;

 private:
  void check_used(int32_t page, const char* what) const;

  int64_t page_tokens_;
  int64_t row_floats_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;                // a stack: the most recently freed page is reused first
  std::vector<std::vector<float>> storage_;  // allocated on a page's first use, kept after
};

}  // namespace plow
