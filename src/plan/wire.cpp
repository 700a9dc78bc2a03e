// .plow files: see wire.h for the envelope. The body is written compactly; reading bounds the file
// size before allocating, checks the envelope, parses with a nesting limit and converts each field
// with its range, so every count is bounded before anything is sized from it.
#include "plan/wire.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace plow {

namespace {

using nlohmann::json;
using L = PlanLimits;

constexpr char kMagic[8] = {'P', 'L', 'O', 'W', 'P', 'L', 'A', 'N'};
constexpr int64_t kMaxIndex = int64_t{1} << 31;  // any index stored in an int32 field

const std::array<std::pair<StateKind, const char*>, 3> kStateKinds = {
    {{StateKind::kConvWindow, "conv_window"}, {StateKind::kKdaRecurrent, "kda_recurrent"}, {StateKind::kMlaLatent, "mla_latent"}}};

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t get_le(std::string_view in, size_t at, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(static_cast<uint8_t>(in[at + static_cast<size_t>(i)])) << (8 * i);
  return value;
}

// Deepest bracket nesting outside strings, in one pass (nlohmann's callback parser, which could stop
// at a depth, is quadratic on long arrays of objects).
int64_t nesting_depth(std::string_view text) {
  int64_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

json to_json(const Plan& plan) {
  json weights = json::array(), states = json::array(), ops = json::array(), tasks = json::array();
  for (const WeightDecl& w : plan.weights) {
    weights.push_back({{"name", w.name}, {"parts", w.parts}, {"shape", w.shape}, {"reshape_ok", w.reshape_ok}, {"mxfp4", w.mxfp4}});
  }
  for (const StateDecl& s : plan.states) {
    const char* kind = "";
    for (const auto& [k, name] : kStateKinds) kind = k == s.kind ? name : kind;
    states.push_back({{"kind", kind}, {"width", s.width}, {"depth", s.depth}, {"label", s.label}});
  }
  for (const PlanOp& op : plan.ops) {
    json attrs = json::array();
    for (const auto& [name, value] : op.attrs.values()) attrs.push_back(json::array({name, value}));
    ops.push_back({{"op", std::string(op_name(op.op()))}, {"label", op.label}, {"inputs", op.inputs}, {"weights", op.weights},
                   {"state", op.state}, {"width", op.width}, {"dtype", op.dtype == OutDType::kAct ? "act" : "f32"},
                   {"offset", op.offset}, {"attrs", attrs}});
  }
  for (const PlanTask& t : plan.tasks) {
    tasks.push_back({{"op", t.op}, {"cols", {t.col_begin, t.col_end}}, {"wait", t.wait_counter}, {"threshold", t.wait_threshold}, {"signals", t.signals}});
  }
  return {{"format_version", plan.format_version},
          {"model_fingerprint", hex64(plan.model_fingerprint)},
          {"phase", std::string(phase_name(plan.phase))},
          {"max_tokens", plan.max_tokens},
          {"workers", plan.workers},
          {"counters", plan.counters},
          {"arena_floats", plan.arena_floats},
          {"output_op", plan.output_op},
          {"compile", {{"ops_before_fusion", plan.compile.ops_before_fusion}, {"rules_fired", plan.compile.rules_fired}}},
          {"weights", weights},
          {"states", states},
          {"ops", ops},
          {"tasks", tasks},
          {"queues", plan.queues}};
}

// Typed, range-checked access to the parsed body; every error names the file and the field path.
class Reader {
 public:
  explicit Reader(const std::string& source) : source_(source) {}

  template <typename... Args>
  [[noreturn]] void bad(fmt::format_string<Args...> format, Args&&... args) const {
    fail("plan file '{}': {}", source_, fmt::format(format, std::forward<Args>(args)...));
  }

  const json& member(const json& object, const std::string& path, const char* key) const {
    if (!object.is_object()) bad("field '{}' must be an object", path);
    auto it = object.find(key);
    if (it == object.end()) bad("field '{}{}{}' is missing", path, path.empty() ? "" : ".", key);
    return *it;
  }

  int64_t integer(const json& v, const std::string& path, int64_t lo, int64_t hi) const {
    int64_t value = 0;
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) bad("field '{}' is {}, expected {}..{}", path, u, lo, hi);
      value = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      value = v.get<int64_t>();
    } else {
      bad("field '{}' must be an integer, found {}", path, v.dump().substr(0, 64));
    }
    if (value < lo || value > hi) bad("field '{}' is {}, expected {}..{}", path, value, lo, hi);
    return value;
  }

  const json& array(const json& v, const std::string& path, int64_t max_size) const {
    if (!v.is_array()) bad("field '{}' must be an array", path);
    if (static_cast<int64_t>(v.size()) > max_size) bad("field '{}' has {} entries, the limit is {}", path, v.size(), max_size);
    return v;
  }

  std::string string(const json& v, const std::string& path) const {
    if (!v.is_string()) bad("field '{}' must be a string", path);
    const auto& text = v.get_ref<const std::string&>();
    if (static_cast<int64_t>(text.size()) > L::kMaxNameBytes) bad("field '{}' is {} bytes long, the limit is {}", path, text.size(), L::kMaxNameBytes);
    return text;
  }

  bool boolean(const json& v, const std::string& path) const {
    if (!v.is_boolean()) bad("field '{}' must be true or false", path);
    return v.get<bool>();
  }

  template <typename T>
  std::vector<T> integers(const json& v, const std::string& path, int64_t max_size, int64_t lo, int64_t hi) const {
    std::vector<T> out;
    array(v, path, max_size);
    out.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) out.push_back(static_cast<T>(integer(v[i], fmt::format("{}[{}]", path, i), lo, hi)));
    return out;
  }

 private:
  const std::string& source_;
};

WeightDecl read_weight(const Reader& r, const json& v, const std::string& path) {
  WeightDecl w;
  w.name = r.string(r.member(v, path, "name"), path + ".name");
  const json& parts = r.array(r.member(v, path, "parts"), path + ".parts", L::kMaxWeightParts);
  for (size_t i = 0; i < parts.size(); ++i) w.parts.push_back(r.string(parts[i], fmt::format("{}.parts[{}]", path, i)));
  w.shape = r.integers<int64_t>(r.member(v, path, "shape"), path + ".shape", L::kMaxShapeRank, 1, L::kMaxDim);
  w.reshape_ok = r.boolean(r.member(v, path, "reshape_ok"), path + ".reshape_ok");
  w.mxfp4 = r.boolean(r.member(v, path, "mxfp4"), path + ".mxfp4");
  return w;
}

StateDecl read_state(const Reader& r, const json& v, const std::string& path) {
  StateDecl s;
  const std::string kind = r.string(r.member(v, path, "kind"), path + ".kind");
  bool known = false;
  for (const auto& [k, name] : kStateKinds) {
    if (kind == name) s.kind = k, known = true;
  }
  if (!known) r.bad("field '{}.kind' is \"{}\", expected conv_window, kda_recurrent or mla_latent", path, kind);
  s.width = r.integer(r.member(v, path, "width"), path + ".width", 1, L::kMaxWidth);
  s.depth = r.integer(r.member(v, path, "depth"), path + ".depth", 0, L::kMaxWidth);
  s.label = r.string(r.member(v, path, "label"), path + ".label");
  return s;
}

PlanOp read_op(const Reader& r, const json& v, const std::string& path) {
  PlanOp op;
  const std::string name = r.string(r.member(v, path, "op"), path + ".op");
  bool known = false;
  for (uint8_t code = 0; code < static_cast<uint8_t>(Op::kCount); ++code) {
    if (op_name(static_cast<Op>(code)) == name) op.opcode = code, known = true;
  }
  if (!known) r.bad("{}: opcode '{}' is not in this build's op table", path, name);
  op.label = r.string(r.member(v, path, "label"), path + ".label");
  op.inputs = r.integers<int32_t>(r.member(v, path, "inputs"), path + ".inputs", L::kMaxOpInputs, 0, L::kMaxOps - 1);
  op.weights = r.integers<int32_t>(r.member(v, path, "weights"), path + ".weights", L::kMaxOpWeights, 0, L::kMaxWeights - 1);
  op.state = static_cast<int32_t>(r.integer(r.member(v, path, "state"), path + ".state", -1, L::kMaxStates - 1));
  op.width = r.integer(r.member(v, path, "width"), path + ".width", 1, L::kMaxWidth);
  const std::string dtype = r.string(r.member(v, path, "dtype"), path + ".dtype");
  if (dtype != "act" && dtype != "f32") r.bad("field '{}.dtype' is \"{}\", expected \"act\" or \"f32\"", path, dtype);
  op.dtype = dtype == "act" ? OutDType::kAct : OutDType::kF32;
  op.offset = r.integer(r.member(v, path, "offset"), path + ".offset", 0, L::kMaxArenaFloats);
  const json& attrs = r.array(r.member(v, path, "attrs"), path + ".attrs", L::kMaxAttrs);
  for (size_t i = 0; i < attrs.size(); ++i) {
    const std::string at = fmt::format("{}.attrs[{}]", path, i);
    if (!attrs[i].is_array() || attrs[i].size() != 2 || !attrs[i][1].is_number()) r.bad("field '{}' must be [name, number]", at);
    const std::string key = r.string(attrs[i][0], at + "[0]");
    if (op.attrs.has(key)) r.bad("field '{}': attribute '{}' appears twice", at, key);
    op.attrs.set(key, attrs[i][1].get<double>());
  }
  return op;
}

PlanTask read_task(const Reader& r, const json& v, const std::string& path) {
  PlanTask t;
  t.op = static_cast<int32_t>(r.integer(r.member(v, path, "op"), path + ".op", 0, L::kMaxOps - 1));
  const auto cols = r.integers<int64_t>(r.member(v, path, "cols"), path + ".cols", 2, 0, L::kMaxWidth);
  if (cols.size() != 2) r.bad("field '{}.cols' must be [begin, end]", path);
  t.col_begin = cols[0];
  t.col_end = cols[1];
  t.wait_counter = static_cast<int32_t>(r.integer(r.member(v, path, "wait"), path + ".wait", 0, L::kMaxCounters - 1));
  t.wait_threshold = r.integer(r.member(v, path, "threshold"), path + ".threshold", 0, L::kMaxTasks);
  t.signals = r.integers<int32_t>(r.member(v, path, "signals"), path + ".signals", L::kMaxSignals, 0, L::kMaxCounters - 1);
  return t;
}

Plan from_json(const Reader& r, const json& body) {
  Plan plan;
  plan.format_version = static_cast<uint32_t>(r.integer(r.member(body, "", "format_version"), "format_version", kPlanFormatVersion, kPlanFormatVersion));
  const std::string fingerprint = r.string(r.member(body, "", "model_fingerprint"), "model_fingerprint");
  if (fingerprint.size() != 16 || fingerprint.find_first_not_of("0123456789abcdef") != std::string::npos) {
    r.bad("field 'model_fingerprint' must be 16 lowercase hex digits");
  }
  plan.model_fingerprint = std::stoull(fingerprint, nullptr, 16);
  const std::string phase = r.string(r.member(body, "", "phase"), "phase");
  if (phase != "decode" && phase != "prefill") r.bad("field 'phase' is \"{}\", expected \"decode\" or \"prefill\"", phase);
  plan.phase = phase == "decode" ? PlanPhase::kDecode : PlanPhase::kPrefill;
  plan.max_tokens = r.integer(r.member(body, "", "max_tokens"), "max_tokens", 1, L::kMaxTokens);
  plan.workers = static_cast<int32_t>(r.integer(r.member(body, "", "workers"), "workers", 1, L::kMaxWorkers));
  plan.counters = static_cast<int32_t>(r.integer(r.member(body, "", "counters"), "counters", 0, L::kMaxCounters));
  plan.arena_floats = r.integer(r.member(body, "", "arena_floats"), "arena_floats", 0, L::kMaxArenaFloats);
  plan.output_op = static_cast<int32_t>(r.integer(r.member(body, "", "output_op"), "output_op", 0, L::kMaxOps - 1));
  const json& compile = r.member(body, "", "compile");
  plan.compile.ops_before_fusion = r.integer(r.member(compile, "compile", "ops_before_fusion"), "compile.ops_before_fusion", 0, L::kMaxOps);
  const json& rules = r.array(r.member(compile, "compile", "rules_fired"), "compile.rules_fired", L::kMaxRules);
  for (size_t i = 0; i < rules.size(); ++i) plan.compile.rules_fired.push_back(r.string(rules[i], fmt::format("compile.rules_fired[{}]", i)));

  const json& weights = r.array(r.member(body, "", "weights"), "weights", L::kMaxWeights);
  for (size_t i = 0; i < weights.size(); ++i) plan.weights.push_back(read_weight(r, weights[i], fmt::format("weights[{}]", i)));
  const json& states = r.array(r.member(body, "", "states"), "states", L::kMaxStates);
  for (size_t i = 0; i < states.size(); ++i) plan.states.push_back(read_state(r, states[i], fmt::format("states[{}]", i)));
  const json& ops = r.array(r.member(body, "", "ops"), "ops", L::kMaxOps);
  for (size_t i = 0; i < ops.size(); ++i) plan.ops.push_back(read_op(r, ops[i], fmt::format("ops[{}]", i)));
  const json& tasks = r.array(r.member(body, "", "tasks"), "tasks", L::kMaxTasks);
  for (size_t i = 0; i < tasks.size(); ++i) plan.tasks.push_back(read_task(r, tasks[i], fmt::format("tasks[{}]", i)));
  const json& queues = r.array(r.member(body, "", "queues"), "queues", L::kMaxWorkers);
  for (size_t i = 0; i < queues.size(); ++i) {
    plan.queues.push_back(r.integers<int32_t>(queues[i], fmt::format("queues[{}]", i), L::kMaxTasks, 0, L::kMaxTasks - 1));
  }
  return plan;
}

}  // namespace

std::string serialize_plan(const Plan& plan) {
  const std::string body = to_json(plan).dump();
  std::string out(kMagic, sizeof(kMagic));
  put_le(out, kPlanFormatVersion, 4);
  put_le(out, body.size(), 8);
  put_le(out, fnv1a64(body), 8);
  return out + body;
}

Plan parse_plan(std::string_view bytes, const std::string& source_name) {
  const Reader r(source_name);
  if (bytes.size() < kPlanHeaderBytes) r.bad("truncated: {} bytes, the header alone is {}", bytes.size(), kPlanHeaderBytes);
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) r.bad("not a plow plan (the file does not start with \"PLOWPLAN\")");
  const uint64_t version = get_le(bytes, 8, 4), length = get_le(bytes, 12, 8), checksum = get_le(bytes, 20, 8);
  if (version != kPlanFormatVersion) r.bad("format version {}, this build reads version {}", version, kPlanFormatVersion);
  if (length > static_cast<uint64_t>(L::kMaxBodyBytes)) r.bad("body length {} exceeds the limit of {} bytes", length, L::kMaxBodyBytes);
  if (length != bytes.size() - kPlanHeaderBytes) r.bad("header says the body is {} bytes, the file holds {}", length, bytes.size() - kPlanHeaderBytes);
  const std::string_view body = bytes.substr(kPlanHeaderBytes);
  if (fnv1a64(body) != checksum) r.bad("checksum mismatch (header {}, body {}): the file is corrupt", hex64(checksum), hex64(fnv1a64(body)));
  if (nesting_depth(body) > L::kMaxJsonDepth) r.bad("body nests deeper than {} levels", L::kMaxJsonDepth);
  json parsed;
  try {
    parsed = json::parse(body);
  } catch (const json::exception& e) {
    r.bad("body is not valid JSON: {}", e.what());
  }
  try {
    Plan plan = from_json(r, parsed);
    plan.source = source_name;
    return plan;
  } catch (const json::exception& e) {
    r.bad("{}", e.what());  // a type the Reader did not anticipate: still a clean error
  }
}

void write_plan(const std::string& path, const Plan& plan) {
  const std::string bytes = serialize_plan(plan);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail("cannot write plan file '{}'", path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) fail("writing plan file '{}' failed", path);
}

Plan read_plan(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail("plan file '{}' cannot be read: {}", path, ec.message());
  if (size > static_cast<uintmax_t>(L::kMaxBodyBytes) + kPlanHeaderBytes) {
    fail("plan file '{}': {} bytes exceeds the limit of {} bytes", path, size, L::kMaxBodyBytes + static_cast<int64_t>(kPlanHeaderBytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("plan file '{}' cannot be opened", path);
  std::string bytes(static_cast<size_t>(size), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  if (in.gcount() != static_cast<std::streamsize>(size)) fail("plan file '{}': read {} of {} bytes", path, in.gcount(), size);
  return parse_plan(bytes, path);
}

}  // namespace plow
