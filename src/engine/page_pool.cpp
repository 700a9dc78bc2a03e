#include "engine/page_pool.h"

#include <algorithm>

#include "core/error.h"

namespace plow {

PagePool::PagePool(int64_t page_tokens, int64_t row_floats, int64_t capacity_pages)
    : page_tokens_(page_tokens), row_floats_(row_floats) {
  PLOW_CHECK(page_tokens >= 1 && row_floats >= 0 && capacity_pages >= 0, "page pool of {} pages × {} tokens × {} floats", capacity_pages,
             page_tokens, row_floats);
  refs_.assign(static_cast<size_t>(capacity_pages), 0);
  storage_.resize(static_cast<size_t>(capacity_pages));
  for (int64_t page = capacity_pages - 1; page >= 0; --page) free_.push_back(static_cast<int32_t>(page));
}

void PagePool::check_used(int32_t page, const char* what) const {
  PLOW_CHECK(page >= 0 && page < pages_capacity(), "{} of page {} outside 0..{}", what, page, pages_capacity() - 1);
  PLOW_CHECK(refs_[static_cast<size_t>(page)] > 0, "{} of free page {}", what, page);
}

int32_t PagePool::allocate() {
  PLOW_CHECK(!free_.empty(), "allocate with no free page ({} used)", pages_used());
  const int32_t page = free_.back();
  free_.pop_back();
  refs_[static_cast<size_t>(page)] = 1;
  std::vector<float>& data = storage_[static_cast<size_t>(page)];
  if (data.empty()) data.resize(static_cast<size_t>(page_tokens_ * row_floats_));
  return page;
}

void PagePool::ref(int32_t page) {
  check_used(page, "ref");
  ++refs_[static_cast<size_t>(page)];
}

void PagePool::unref(int32_t page) {
  check_used(page, "unref");  // a double free lands here
  if (--refs_[static_cast<size_t>(page)] == 0) free_.push_back(page);
}

int32_t PagePool::refs(int32_t page) const {
  PLOW_CHECK(page >= 0 && page < pages_capacity(), "refs of page {} outside 0..{}", page, pages_capacity() - 1);
  return refs_[static_cast<size_t>(page)];
}

float* PagePool::data(int32_t page) {
  check_used(page, "data");
  return storage_[static_cast<size_t>(page)].data();
}

const float* PagePool::data(int32_t page) const {
  check_used(page, "data");
  return storage_[static_cast<size_t>(page)].data();
}

void PagePool::check_integrity(const std::vector<int32_t>* expected_refs) const {
  std::vector<int> listed(refs_.size(), 0);
  for (int32_t page : free_) {
    PLOW_CHECK(page >= 0 && page < pages_capacity(), "free list holds page {} outside 0..{}", page, pages_capacity() - 1);
    ++listed[static_cast<size_t>(page)];
  }
  for (size_t page = 0; page < refs_.size(); ++page) {
    PLOW_CHECK(refs_[page] >= 0, "page {} has {} references", page, refs_[page]);
    PLOW_CHECK(listed[page] <= 1, "page {} is in the free list {} times (freed twice)", page, listed[page]);
    PLOW_CHECK((refs_[page] == 0) == (listed[page] == 1), "page {} has {} references and is {}in the free list (leaked or freed while used)", page,
               refs_[page], listed[page] ? "" : "not ");
    if (expected_refs) {
      PLOW_CHECK(expected_refs->size() == refs_.size(), "expected references for {} pages, the pool has {}", expected_refs->size(), refs_.size());
      PLOW_CHECK((*expected_refs)[page] == refs_[page], "page {} has {} references, its holders account for {}", page, refs_[page],
                 (*expected_refs)[page]);
    }
  }
}

}  // namespace plow
