#include "engine/rank_wire.h"

#include <cerrno>
#include <cstring>

#include <sys/socket.h>
#include <unistd.h>

#include "core/error.h"

namespace plow::rank_wire {

namespace {

bool write_all(int fd, const uint8_t* data, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// Reads exactly `bytes`; false when the peer closed the socket first (or reset it).
bool read_all(int fd, uint8_t* data, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::read(fd, data, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

template <typename T>
json to_binary(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return json::binary(std::move(bytes));
}

template <typename T>
std::vector<T> from_binary(const json& value, const char* key) {
  if (!value.is_binary()) fail("field '{}': expected binary data, found {}", key, value.type_name());
  const auto& bytes = value.get_binary();
  if (bytes.size() % sizeof(T) != 0) fail("field '{}': {} bytes is not a whole number of {}-byte elements", key, bytes.size(), sizeof(T));
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

std::vector<int64_t> int_list(const json& message, const char* key) {
  const json& list = field(message, key);
  if (!list.is_array()) fail("field '{}': expected an array, found {}", key, list.type_name());
  std::vector<int64_t> values;
  for (const json& v : list) {
    if (!v.is_number_integer()) fail("field '{}': expected integers, found {}", key, v.type_name());
    values.push_back(v.get<int64_t>());
  }
  return values;
}

}  // namespace

bool write_frame(int fd, const json& message) {
  const std::vector<uint8_t> payload = json::to_msgpack(message);
  uint8_t header[8];
  for (int i = 0; i < 8; ++i) header[i] = static_cast<uint8_t>(static_cast<uint64_t>(payload.size()) >> (8 * i));
  return write_all(fd, header, sizeof(header)) && write_all(fd, payload.data(), payload.size());
}

std::optional<json> read_frame(int fd) {
  uint8_t header[8];
  if (!read_all(fd, header, sizeof(header))) return std::nullopt;
  uint64_t bytes = 0;
  for (int i = 0; i < 8; ++i) bytes |= static_cast<uint64_t>(header[i]) << (8 * i);
  if (bytes > kMaxFrameBytes) fail("malformed frame: a length of {} bytes (at most {})", bytes, kMaxFrameBytes);
  std::vector<uint8_t> payload(bytes);
  if (!read_all(fd, payload.data(), payload.size())) return std::nullopt;
  try {
    json message = json::from_msgpack(payload);
    if (!message.is_object()) fail("malformed frame: expected a MessagePack map, found {}", message.type_name());
    return message;
  } catch (const json::exception& e) {
    fail("malformed frame of {} bytes: {}", bytes, e.what());
  }
}

const json& field(const json& message, const char* key) {
  const auto it = message.find(key);
  if (it == message.end()) fail("the message has no field '{}'", key);
  return *it;
}

int64_t int_field(const json& message, const char* key) {
  const json& value = field(message, key);
  if (!value.is_number_integer()) fail("field '{}': expected an integer, found {}", key, value.type_name());
  return value.get<int64_t>();
}

json encode_step(const StepInputs& inputs) {
  json slots = json::array(), query = json::array();
  for (const SequenceStep& s : inputs.sequences) {
    slots.push_back(s.slot);
    query.push_back(s.query_tokens);
  }
  return {{"op", "step"}, {"token_ids", to_binary(inputs.token_ids)}, {"slots", slots}, {"query_tokens", query}, {"all_logits", inputs.all_logits}};
}

StepInputs decode_step(const json& message) {
  StepInputs inputs;
  inputs.token_ids = from_binary<int32_t>(field(message, "token_ids"), "token_ids");
  const std::vector<int64_t> slots = int_list(message, "slots"), query = int_list(message, "query_tokens");
  if (slots.size() != query.size()) fail("a step of {} slots and {} query lengths", slots.size(), query.size());
  for (size_t i = 0; i < slots.size(); ++i) inputs.sequences.push_back({static_cast<int>(slots[i]), query[i]});
  const json& all = field(message, "all_logits");
  if (!all.is_boolean()) fail("field 'all_logits': expected a boolean, found {}", all.type_name());
  inputs.all_logits = all.get<bool>();
  return inputs;
}

json encode_output(const StepOutput& output) { return {{"rows", output.rows}, {"vocab", output.vocab}, {"logits", to_binary(output.logits)}}; }

StepOutput decode_output(const json& message) {
  StepOutput output;
  output.rows = int_field(message, "rows");
  output.vocab = int_field(message, "vocab");
  output.logits = from_binary<float>(field(message, "logits"), "logits");
  if (output.rows < 0 || output.vocab < 0 || static_cast<uint64_t>(output.rows) * static_cast<uint64_t>(output.vocab) != output.logits.size()) {
    fail("logits of {} floats for {} rows of {}", output.logits.size(), output.rows, output.vocab);
  }
  return output;
}

json encode_snapshot(const SlotSnapshot& snapshot) {
  json fixed = json::array(), rows = json::array();
  for (const auto& f : snapshot.fixed) fixed.push_back(to_binary(f));
  for (const auto& r : snapshot.rows) rows.push_back(to_binary(r));
  return {{"tokens", snapshot.tokens}, {"rows_begin", snapshot.rows_begin}, {"row_floats", snapshot.row_floats}, {"fixed", fixed}, {"rows", rows}};
}

SlotSnapshot decode_snapshot(const json& message) {
  SlotSnapshot snapshot;
  snapshot.tokens = int_field(message, "tokens");
  snapshot.rows_begin = int_field(message, "rows_begin");
  snapshot.row_floats = int_list(message, "row_floats");
  for (const char* key : {"fixed", "rows"}) {
    const json& list = field(message, key);
    if (!list.is_array()) fail("field '{}': expected an array, found {}", key, list.type_name());
    auto& out = std::string_view(key) == "fixed" ? snapshot.fixed : snapshot.rows;
    for (const json& b : list) out.push_back(from_binary<float>(b, key));
  }
  if (snapshot.fixed.size() != snapshot.row_floats.size() || snapshot.rows.size() != snapshot.row_floats.size()) {
    fail("a snapshot of {} states with {} fixed buffers and {} row blocks", snapshot.row_floats.size(), snapshot.fixed.size(), snapshot.rows.size());
  }
  return snapshot;
}

}  // namespace plow::rank_wire
