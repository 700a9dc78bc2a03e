#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace plow {

namespace fs = std::filesystem;
using nlohmann::json;

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  return count;
}

std::string TensorView::shape_string() const {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += fmt::format("{}{}", i ? "," : "", shape[i]);
  return text + "]";
}

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open '{}': {}", path, std::strerror(errno));
    struct stat info {};
    if (::fstat(fd, &info) != 0) {
      ::close(fd);
      fail("cannot stat '{}': {}", path, std::strerror(errno));
    }
    size_ = static_cast<size_t>(info.st_size);
    if (size_ > 0) {
      void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (mapped == MAP_FAILED) {
        ::close(fd);
        fail("cannot map '{}': {}", path, std::strerror(errno));
      }
      data_ = static_cast<const uint8_t*>(mapped);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

namespace {

// Parses one header entry into a view, checking dtype, shape and byte count against the data section.
TensorView parse_entry(const std::string& path, const std::string& name, const json& entry, const uint8_t* data,
                       uint64_t data_size) {
  if (!entry.is_object()) fail("{}: tensor '{}': header entry must be an object, found {}", path, name, entry.dump());
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || !dtype_it->is_string()) fail("{}: tensor '{}': missing or non-string 'dtype'", path, name);
  if (shape_it == entry.end() || !shape_it->is_array()) fail("{}: tensor '{}': missing or non-list 'shape'", path, name);
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    fail("{}: tensor '{}': 'data_offsets' must be [begin, end]", path, name);
  }
  TensorView view;
  view.name = name;
  const auto dtype = dtype_from_safetensors(dtype_it->get<std::string>());
  if (!dtype) fail("{}: tensor '{}': unsupported dtype '{}' (expected F32, BF16, F16, U8, I32 or I64)", path, name, dtype_it->get<std::string>());
  view.dtype = *dtype;
  uint64_t count = 1;
  for (const auto& dim : *shape_it) {
    if (!dim.is_number_unsigned()) fail("{}: tensor '{}': shape entry {} is not a non-negative integer", path, name, dim.dump());
    const auto d = dim.get<uint64_t>();
    if (d != 0 && count > std::numeric_limits<uint64_t>::max() / 16 / d) fail("{}: tensor '{}': shape {} overflows", path, name, shape_it->dump());
    count *= d;
    view.shape.push_back(static_cast<int64_t>(d));
  }
  for (const auto& offset : *offsets_it) {
    if (!offset.is_number_unsigned()) fail("{}: tensor '{}': data_offsets entry {} is not a non-negative integer", path, name, offset.dump());
  }
  const auto begin = (*offsets_it)[0].get<uint64_t>();
  const auto end = (*offsets_it)[1].get<uint64_t>();
  if (begin > end || end > data_size) {
    fail("{}: tensor '{}': data_offsets [{}, {}] lie outside the data section of {} bytes", path, name, begin, end, data_size);
  }
  const uint64_t expected = count * dtype_size(view.dtype);
  if (end - begin != expected) {
    fail("{}: tensor '{}': {} bytes stored, but dtype {} × shape {} needs {}", path, name, end - begin,
         dtype_name(view.dtype), shape_it->dump(), expected);
  }
  view.data = data + begin;
  view.nbytes = static_cast<size_t>(expected);
  return view;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), file_(std::make_unique<MappedFile>(path)) {
  const size_t size = file_->size();
  if (size < 8) fail("{}: truncated: {} bytes, a safetensors file needs at least 8", path, size);
  uint64_t header_size = 0;
  std::memcpy(&header_size, file_->data(), 8);
  if (header_size > size - 8) fail("{}: header length {} runs past the end of the file ({} bytes)", path, header_size, size);
  json header;
  try {
    header = json::parse(file_->data() + 8, file_->data() + 8 + header_size);
  } catch (const json::parse_error& e) {
    fail("{}: malformed JSON header: {}", path, e.what());
  }
  if (!header.is_object()) fail("{}: header must be a JSON object", path);
  const uint8_t* data = file_->data() + 8 + header_size;
  const uint64_t data_size = size - 8 - header_size;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    tensors_.emplace(name, parse_entry(path, name, entry, data, data_size));
  }
  // No two tensors may share bytes.
  std::vector<const TensorView*> by_offset;
  for (const auto& [name, view] : tensors_) by_offset.push_back(&view);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorView* prev = by_offset[i - 1];
    if (prev->data + prev->nbytes > by_offset[i]->data) {
      fail("{}: tensors '{}' and '{}' overlap in the data section", path, prev->name, by_offset[i]->name);
    }
  }
}

SafetensorsFile::~SafetensorsFile() = default;

Checkpoint Checkpoint::open(const std::string& model_dir) {
  if (!fs::is_directory(model_dir)) fail("model directory '{}' does not exist", model_dir);
  Checkpoint checkpoint;
  checkpoint.dir_ = model_dir;
  const fs::path dir(model_dir);
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    json index;
    try {
      index = json::parse(in);
    } catch (const json::parse_error& e) {
      fail("{}: malformed JSON: {}", index_path.string(), e.what());
    }
    const auto map_it = index.find("weight_map");
    if (!index.is_object() || map_it == index.end() || !map_it->is_object()) {
      fail("{}: expected an object with a 'weight_map' object", index_path.string());
    }
    std::map<std::string, SafetensorsFile*> shards;
    for (const auto& [name, file] : map_it->items()) {
      if (!file.is_string()) fail("{}: weight_map['{}'] must be a file name, found {}", index_path.string(), name, file.dump());
      const std::string shard_name = file.get<std::string>();
      if (shard_name.find('/') != std::string::npos || shard_name == ".." ) {
        fail("{}: weight_map['{}'] names '{}', expected a file in the model directory", index_path.string(), name, shard_name);
      }
      if (!shards.count(shard_name)) {
        const fs::path shard_path = dir / shard_name;
        if (!fs::exists(shard_path)) fail("{}: shard '{}' (for tensor '{}') does not exist", index_path.string(), shard_name, name);
        checkpoint.files_.push_back(std::make_unique<SafetensorsFile>(shard_path.string()));
        shards[shard_name] = checkpoint.files_.back().get();
      }
      const auto& tensors = shards[shard_name]->tensors();
      auto it = tensors.find(name);
      if (it == tensors.end()) fail("{}: tensor '{}' is mapped to '{}', which does not contain it", index_path.string(), name, shard_name);
      checkpoint.index_[name] = &it->second;
    }
    for (const auto& file : checkpoint.files_) {
      for (const auto& [name, view] : file->tensors()) {
        if (!checkpoint.index_.count(name)) fail("{}: tensor '{}' is not listed in {}", file->path(), name, index_path.string());
        if (checkpoint.index_[name] != &view) fail("{}: tensor '{}' is also stored in another shard", file->path(), name);
      }
    }
    return checkpoint;
  }
  const fs::path single = dir / "model.safetensors";
  if (!fs::exists(single)) fail("model directory '{}' has neither model.safetensors nor model.safetensors.index.json", model_dir);
  checkpoint.files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
  for (const auto& [name, view] : checkpoint.files_.back()->tensors()) checkpoint.index_[name] = &view;
  return checkpoint;
}

Checkpoint Checkpoint::in_memory(std::string label) {
  Checkpoint checkpoint;
  checkpoint.dir_ = std::move(label);
  return checkpoint;
}

void Checkpoint::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
  auto view = std::make_unique<TensorView>();
  view->name = name;
  view->dtype = dtype;
  view->shape = std::move(shape);
  PLOW_CHECK(static_cast<size_t>(view->numel()) * dtype_size(dtype) == bytes.size(), "tensor '{}' size", name);
  owned_bytes_.push_back(std::make_unique<std::vector<uint8_t>>(std::move(bytes)));
  view->data = owned_bytes_.back()->data();
  view->nbytes = owned_bytes_.back()->size();
  PLOW_CHECK(!index_.count(name), "tensor '{}' added twice", name);
  index_[name] = view.get();
  owned_views_.push_back(std::move(view));
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

}  // namespace plow
