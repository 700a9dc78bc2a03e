#include "core/npy.h"

#include <fstream>
#include <iterator>
#include <cstring>
#include <regex>

#include "core/error.h"

namespace plow {

namespace {
constexpr char kMagic[] = "\x93NUMPY";

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  return count;
}
}  // namespace

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::string shape_text = "(";
  for (size_t i = 0; i < shape.size(); ++i) shape_text += fmt::format("{}{}", shape[i], shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
  shape_text += ")";
  std::string header = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}", shape_text);
  // magic(6) + version(2) + header length(2) + header + '\n', padded to a multiple of 64
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');

  std::ofstream out(path, std::ios::binary);
  if (!out) fail("cannot open '{}' for writing", path);
  out.write(kMagic, 6);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const auto header_len = static_cast<uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(header_len & 0xFF), static_cast<char>(header_len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(element_count(shape) * 4));
  if (!out) fail("write to '{}' failed", path);
}

NpyArray read_npy_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '{}'", path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, kMagic, 6) != 0) fail("'{}' is not a .npy file (bad magic)", path);
  const auto major = static_cast<uint8_t>(bytes[6]);
  if (major != 1) fail("'{}': .npy version {} not supported (expected 1)", path, major);
  const size_t header_len = static_cast<uint8_t>(bytes[8]) | (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
  if (10 + header_len > bytes.size()) fail("'{}': .npy header length {} runs past the file", path, header_len);
  const std::string header = bytes.substr(10, header_len);
  if (header.find("'descr': '<f4'") == std::string::npos) fail("'{}': expected dtype '<f4' in header {}", path, header);
  if (header.find("'fortran_order': False") == std::string::npos) fail("'{}': expected C order", path);
  std::smatch match;
  if (!std::regex_search(header, match, std::regex(R"('shape': \(([0-9, ]*)\))"))) fail("'{}': no shape in header", path);
  NpyArray array;
  const std::string dims = match[1].str();
  const std::regex number("[0-9]+");
  std::sregex_iterator it(dims.begin(), dims.end(), number), end;
  for (; it != end; ++it) array.shape.push_back(std::stoll(it->str()));
  const int64_t count = element_count(array.shape);
  const size_t data_bytes = bytes.size() - 10 - header_len;
  if (data_bytes != static_cast<size_t>(count) * 4) {
    fail("'{}': {} data bytes, expected {} for its shape", path, data_bytes, count * 4);
  }
  array.data.resize(static_cast<size_t>(count));
  std::memcpy(array.data.data(), bytes.data() + 10 + header_len, data_bytes);
  return array;
}

}  // namespace plow
