// The messages between a server and a tensor-parallel rank in another process (engine/remote_rank):
// one frame = an 8-byte little-endian payload length, then a MessagePack map (nlohmann::json's
// binary format). Token ids and logits travel as MessagePack binaries of the host's int32 / float
// bytes (both ends are the same binary on the same machine). Decoders check every field's presence,
// type and size, and throw plow::Error naming the field: a malformed frame never becomes a step.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>

#include "runtime/backend.h"

namespace plow::rank_wire {

using nlohmann::json;

// Above this a length field is not a frame (the largest real frame is a prefill step's all_logits:
// step tokens × the rank's vocabulary block × 4 bytes).
constexpr uint64_t kMaxFrameBytes = uint64_t{1} << 36;

// Writes one frame; false when the peer is gone (the socket is closed or reset). Never raises SIGPIPE.
bool write_frame(int fd, const json& message);
// Reads one frame; nullopt when the peer closed the socket (before or inside a frame). plow::Error for
// a length above kMaxFrameBytes or a payload that is not MessagePack.
std::optional<json> read_frame(int fd);

json encode_step(const StepInputs& inputs);
StepInputs decode_step(const json& message);
json encode_output(const StepOutput& output);
StepOutput decode_output(const json& message);
json encode_snapshot(const SlotSnapshot& snapshot);
SlotSnapshot decode_snapshot(const json& message);

// A field of `message`: plow::Error naming `key` when it is missing or not of the expected type.
const json& field(const json& message, const char* key);
int64_t int_field(const json& message, const char* key);

}  // namespace plow::rank_wire
