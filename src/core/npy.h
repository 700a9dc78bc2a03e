// NumPy .npy files of little-endian float32 in C order: written by `plow generate --dump-logits`,
// read by the oracle tests. The reader validates the header and rejects anything else by name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace plow {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);
NpyArray read_npy_f32(const std::string& path);

}  // namespace plow
