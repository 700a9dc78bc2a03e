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

namespace plow {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  float at(size_t i) const { return load_as_f32(dtype, data, i); }
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

  const TensorView* find(const std::string& name) const;
  const std::map<std::string, const TensorView*>& tensors() const { return index_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace plow
