// Safetensors checkpoints, single-file or sharded (model.safetensors.index.json), memory-mapped.
// Every header is validated before any tensor is handed out: header length within the file, known
// dtype, byte count = dtype size × shape, offsets inside the data section, no two tensors overlapping.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mxfp4.h"

namespace plow {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  // MXFP4 weights (§7.7) are a logical [out, in] matrix over two stored tensors: `data` holds the
  // packed codes [out, in/2] and `mx_scales` the E8M0 scales [out, in/32]; dtype is then U8.
  const uint8_t* mx_scales = nullptr;

  bool is_mxfp4() const { return mx_scales != nullptr; }
  int64_t numel() const;
  float at(size_t i) const {
    if (is_mxfp4()) {
      const int64_t in = shape.back();
      return mxfp4_at(data, mx_scales, in, static_cast<int64_t>(i) / in, static_cast<int64_t>(i) % in);
    }
    return load_as_f32(dtype, data, i);
  }
  std::string shape_string() const;
};

class MappedFile;

// One .safetensors file, mapped read-only for the lifetime of the object.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a model directory: model.safetensors, or the shards named by the index.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& model_dir);
  // A checkpoint held in memory (random weights for benchmarks); `label` stands in for the directory.
  static Checkpoint in_memory(std::string label);
  void add_tensor(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes);

  const TensorView* find(const std::string& name) const;
  const std::map<std::string, const TensorView*>& tensors() const { return index_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> owned_bytes_;
  std::vector<std::unique_ptr<TensorView>> owned_views_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace plow
