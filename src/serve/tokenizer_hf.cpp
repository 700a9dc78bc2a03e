// Loader for HF tokenizer.json: byte-level BPE only. Every field plow does not implement is rejected
// by name (normalizers other than none, pre-tokenizers other than Sequence/Split/ByteLevel, decoders
// other than ByteLevel, BPE dropout / subword affixes / byte_fallback), because running without it
// would silently produce different ids. post_processor is ignored: encode() never adds BOS/EOS.
#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>

#include "core/error.h"
#include "serve/tokenizer_model.h"
#include "serve/utf8.h"

namespace plow {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer pattern, which ByteLevel uses when use_regex is on (Oniguruma dialect).
constexpr std::string_view kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class JsonReader {
 public:
  explicit JsonReader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void error(const std::string& field, const std::string& what) const {
    fail("{}: field '{}' {}", path_, field, what);
  }
  const json& object(const json& parent, const std::string& key, const std::string& field) const {
    auto it = parent.find(key);
    if (it == parent.end() || !it->is_object()) error(field, it == parent.end() ? "is missing" : "must be an object");
    return *it;
  }
  std::string string(const json& value, const std::string& field) const {
    if (!value.is_string()) error(field, fmt::format("must be a string, found {}", value.dump()));
    return value.get<std::string>();
  }
  bool flag(const json& parent, const std::string& key, const std::string& field, std::optional<bool> fallback) const {
    auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) {
      if (!fallback) error(field, "is missing");
      return *fallback;
    }
    if (!it->is_boolean()) error(field, fmt::format("must be true or false, found {}", it->dump()));
    return it->get<bool>();
  }
  int32_t id(const json& value, const std::string& field) const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= kMaxTokenIds) {
      error(field, fmt::format("must be a token id (integer in [0, {})), found {}", kMaxTokenIds, value.dump()));
    }
    return static_cast<int32_t>(value.get<int64_t>());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A vocabulary string in GPT-2's printable-byte alphabet -> its bytes; nullopt if a character is outside it.
std::optional<std::string> byte_level_bytes(std::string_view token) {
  static const std::vector<int16_t> char_to_byte = [] {
    std::vector<int16_t> table(512, -1);
    const auto& chars = byte_level_chars();
    for (size_t b = 0; b < 256; ++b) table[chars[b]] = static_cast<int16_t>(b);
    return table;
  }();
  std::string bytes;
  size_t pos = 0;
  while (pos < token.size()) {
    const uint32_t cp = utf8::next_code_point(token, pos);
    if (cp >= char_to_byte.size() || char_to_byte[cp] < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(char_to_byte[cp]));
  }
  return bytes;
}

SplitBehavior parse_behavior(const JsonReader& r, const json& value, const std::string& field) {
  const std::string name = r.string(value, field);
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  r.error(field, fmt::format("'{}' is not a split behavior (Removed, Isolated, MergedWithPrevious, MergedWithNext, "
                             "Contiguous)", name));
}

void parse_pre_tokenizer(const JsonReader& r, const json& node, const std::string& field,
                         std::vector<PreTokenizerStep>& steps) {
  if (!node.is_object()) r.error(field, "must be an object (byte-level BPE needs a ByteLevel pre-tokenizer)");
  const std::string type = r.string(node.contains("type") ? node["type"] : json(), field + ".type");
  if (type == "Sequence") {
    auto it = node.find("pretokenizers");
    if (it == node.end() || !it->is_array()) r.error(field + ".pretokenizers", "must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      parse_pre_tokenizer(r, (*it)[i], fmt::format("{}.pretokenizers[{}]", field, i), steps);
    }
  } else if (type == "Split") {
    PreTokenizerStep step;
    const json& pattern = r.object(node, "pattern", field + ".pattern");
    const std::string where = fmt::format("{}: field '{}.pattern'", r.path(), field);
    if (pattern.contains("Regex")) {
      const std::string regex = r.string(pattern["Regex"], field + ".pattern.Regex");
      step.regex = std::make_shared<PretokenRegex>(regex, RegexDialect::kOniguruma, where);
    } else if (pattern.contains("String")) {
      step.regex = std::make_shared<PretokenRegex>(
          PretokenRegex::literal(r.string(pattern["String"], field + ".pattern.String"), where));
    } else {
      r.error(field + ".pattern", "must hold \"Regex\" or \"String\"");
    }
    step.behavior = parse_behavior(r, node.contains("behavior") ? node["behavior"] : json(), field + ".behavior");
    step.invert = r.flag(node, "invert", field + ".invert", false);
    steps.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    step.add_prefix_space = r.flag(node, "add_prefix_space", field + ".add_prefix_space", std::nullopt);
    if (r.flag(node, "use_regex", field + ".use_regex", true)) {
      step.regex = std::make_shared<PretokenRegex>(kGpt2Pattern, RegexDialect::kOniguruma, r.path() + ": ByteLevel regex");
    }
    steps.push_back(std::move(step));
  } else {
    r.error(field + ".type", fmt::format("'{}' is not supported (plow implements Sequence, Split, ByteLevel)", type));
  }
}

void check_normalizer(const JsonReader& r, const json& root) {
  auto it = root.find("normalizer");
  if (it == root.end() || it->is_null()) return;
  const std::string type = r.string(it->contains("type") ? (*it)["type"] : json(), "normalizer.type");
  if (type == "Sequence" && it->contains("normalizers") && (*it)["normalizers"].is_array() &&
      (*it)["normalizers"].empty()) {
    return;
  }
  if (type == "NFC") {
    r.error("normalizer.type", "'NFC' is not supported (plow has no Unicode composition tables; only a null "
                               "normalizer is implemented)");
  }
  r.error("normalizer.type", fmt::format("'{}' is not supported (only a null normalizer is implemented)", type));
}

void check_decoder(const JsonReader& r, const json& root) {
  auto it = root.find("decoder");
  if (it == root.end() || it->is_null()) r.error("decoder", "is missing (byte-level BPE needs the ByteLevel decoder)");
  const std::string type = r.string(it->contains("type") ? (*it)["type"] : json(), "decoder.type");
  if (type != "ByteLevel") r.error("decoder.type", fmt::format("'{}' is not supported (plow implements ByteLevel)", type));
}

// BPE options: those that change ids and that plow does not implement are rejected by name.
void parse_bpe_options(const JsonReader& r, const json& model, BpeModel& bpe) {
  if (model.contains("type")) {
    const std::string type = r.string(model["type"], "model.type");
    if (type != "BPE") r.error("model.type", fmt::format("'{}' is not supported (plow implements byte-level BPE)", type));
  }
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0)) {
    r.error("model.dropout", fmt::format("must be null (BPE dropout is for training), found {}", model["dropout"].dump()));
  }
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(affix) && !model[affix].is_null() && model[affix] != "") {
      r.error(std::string("model.") + affix, fmt::format("is not supported for byte-level BPE, found {}", model[affix].dump()));
    }
  }
  if (r.flag(model, "byte_fallback", "model.byte_fallback", false)) {
    r.error("model.byte_fallback", "true is not supported (byte-level BPE has every byte in its alphabet)");
  }
  bpe.kind = BpeModel::Kind::kMergeTable;
  bpe.ignore_merges = r.flag(model, "ignore_merges", "model.ignore_merges", false);
  bpe.fuse_unk = r.flag(model, "fuse_unk", "model.fuse_unk", false);
}

// model.vocab -> token string by id (ids may have gaps; an id used twice is an error).
std::vector<std::string> parse_vocab(const JsonReader& r, const json& vocab) {
  std::vector<std::string> vocab_by_id;
  for (const auto& [token, value] : vocab.items()) {
    const int32_t id = r.id(value, fmt::format("model.vocab[\"{}\"]", token));
    if (static_cast<size_t>(id) >= vocab_by_id.size()) vocab_by_id.resize(static_cast<size_t>(id) + 1);
    if (!vocab_by_id[id].empty()) {
      r.error("model.vocab", fmt::format("id {} is given to both \"{}\" and \"{}\"", id, vocab_by_id[id], token));
    }
    if (token.empty()) r.error("model.vocab", fmt::format("id {} has an empty token", id));
    vocab_by_id[id] = token;
  }
  return vocab_by_id;
}

// model.merges in either form ("a b" strings or ["a", "b"] pairs); rank = position in the list.
void parse_merges(const JsonReader& r, const json& model, const json& vocab, BpeModel& bpe) {
  const auto vocab_id = [&](const std::string& token, size_t rank) {
    auto it = vocab.find(token);
    if (it == vocab.end()) r.error(fmt::format("model.merges[{}]", rank), fmt::format("token \"{}\" is not in model.vocab", token));
    return it->get<int32_t>();
  };
  auto merges = model.find("merges");
  if (merges == model.end() || !merges->is_array()) r.error("model.merges", merges == model.end() ? "is missing" : "must be an array");
  if (merges->size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max())) r.error("model.merges", "has too many entries");
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const json& entry = (*merges)[rank];
    const std::string field = fmt::format("model.merges[{}]", rank);
    std::string left, right;
    if (entry.is_string()) {
      const std::string line = entry.get<std::string>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        r.error(field, fmt::format("must be two tokens separated by one space, found \"{}\"", line));
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2) {
      left = r.string(entry[0], field + "[0]");
      right = r.string(entry[1], field + "[1]");
    } else {
      r.error(field, fmt::format("must be \"left right\" or [\"left\", \"right\"], found {}", entry.dump()));
    }
    const int32_t left_id = vocab_id(left, rank), right_id = vocab_id(right, rank);
    const int32_t merged_id = vocab_id(left + right, rank);
    // Later duplicates win, as in tokenizers' HashMap collect.
    bpe.merges.insert_or_assign(BpeModel::merge_key(left_id, right_id), BpeMerge{static_cast<int32_t>(rank), merged_id});
  }
}

// The BPE model section: options, vocab, merges, and the byte-keyed tables the encoder runs on.
void parse_bpe(const JsonReader& r, const json& root, TokenizerModel& m, std::vector<std::string>& vocab_by_id) {
  const json& model = r.object(root, "model", "model");
  parse_bpe_options(r, model, m.bpe);
  const json& vocab = r.object(model, "vocab", "model.vocab");
  vocab_by_id = parse_vocab(r, vocab);
  parse_merges(r, model, vocab, m.bpe);
  for (size_t id = 0; id < vocab_by_id.size(); ++id) {
    if (vocab_by_id[id].empty()) continue;
    if (auto bytes = byte_level_bytes(vocab_by_id[id])) m.bpe.vocab.emplace(*bytes, static_cast<int32_t>(id));
  }
  const auto& chars = byte_level_chars();
  for (size_t b = 0; b < 256; ++b) {
    std::string ch;
    utf8::append_code_point(chars[b], ch);
    if (auto it = vocab.find(ch); it != vocab.end()) m.bpe.byte_ids[b] = it->get<int32_t>();
  }
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    const std::string unk = r.string(model["unk_token"], "model.unk_token");
    auto it = vocab.find(unk);
    if (it == vocab.end()) r.error("model.unk_token", fmt::format("\"{}\" is not in model.vocab", unk));
    m.bpe.unk_id = it->get<int32_t>();
  }
}

void parse_added_tokens(const JsonReader& r, const json& root, TokenizerModel& m, const std::vector<std::string>& vocab_by_id) {
  auto list = root.find("added_tokens");
  if (list == root.end() || list->is_null()) return;
  if (!list->is_array()) r.error("added_tokens", "must be an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& entry = (*list)[i];
    const std::string field = fmt::format("added_tokens[{}]", i);
    if (!entry.is_object()) r.error(field, "must be an object");
    AddedToken t;
    t.id = r.id(entry.contains("id") ? entry["id"] : json(), field + ".id");
    t.content = r.string(entry.contains("content") ? entry["content"] : json(), field + ".content");
    if (t.content.empty()) r.error(field + ".content", "must not be empty");
    t.special = r.flag(entry, "special", field + ".special", false);
    t.single_word = r.flag(entry, "single_word", field + ".single_word", false);
    t.lstrip = r.flag(entry, "lstrip", field + ".lstrip", false);
    t.rstrip = r.flag(entry, "rstrip", field + ".rstrip", false);
    t.normalized = r.flag(entry, "normalized", field + ".normalized", !t.special);
    const json& vocab = root["model"]["vocab"];
    if (auto it = vocab.find(t.content); it != vocab.end() && it->get<int32_t>() != t.id) {
      r.error(field + ".id", fmt::format("is {} but model.vocab gives \"{}\" id {}", t.id, t.content, it->get<int32_t>()));
    }
    if (static_cast<size_t>(t.id) < vocab_by_id.size() && !vocab_by_id[t.id].empty() && vocab_by_id[t.id] != t.content) {
      r.error(field + ".id", fmt::format("{} already names \"{}\" in model.vocab", t.id, vocab_by_id[t.id]));
    }
    for (const AddedToken& other : m.added_tokens) {
      if (other.id == t.id || other.content == t.content) {
        r.error(field, fmt::format("duplicates added token {} \"{}\"", other.id, other.content));
      }
    }
    m.added_tokens.push_back(std::move(t));
  }
}

}  // namespace

std::shared_ptr<const TokenizerModel> load_hf_tokenizer(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  json root;
  try {
    root = json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
  const JsonReader r(path);
  if (!root.is_object()) fail("{}: expected a JSON object at the top level", path);
  auto m = std::make_shared<TokenizerModel>();
  m->format = TokenizerFormat::kHuggingFace;
  m->source = path;
  std::vector<std::string> vocab_by_id;
  parse_bpe(r, root, *m, vocab_by_id);
  parse_added_tokens(r, root, *m, vocab_by_id);
  check_normalizer(r, root);
  parse_pre_tokenizer(r, root.contains("pre_tokenizer") ? root["pre_tokenizer"] : json(), "pre_tokenizer", m->pre_tokenizer);
  size_t byte_levels = 0;
  for (const PreTokenizerStep& s : m->pre_tokenizer) byte_levels += s.kind == PreTokenizerStep::Kind::kByteLevel;
  if (byte_levels != 1 || m->pre_tokenizer.back().kind != PreTokenizerStep::Kind::kByteLevel) {
    r.error("pre_tokenizer", "must end with exactly one ByteLevel step (plow implements byte-level BPE)");
  }
  check_decoder(r, root);

  size_t size = vocab_by_id.size();
  for (const AddedToken& t : m->added_tokens) size = std::max(size, static_cast<size_t>(t.id) + 1);
  m->token_bytes.assign(size, {});
  m->token_present.assign(size, 0);
  m->token_special.assign(size, 0);
  // What the ByteLevel decoder emits per token: its bytes, or its UTF-8 text when a character is outside
  // the byte alphabet (tokenizers' decode_chain does the same per token).
  const auto set_token = [&](size_t id, const std::string& text) {
    auto bytes = byte_level_bytes(text);
    m->token_bytes[id] = bytes ? *bytes : text;
    m->token_present[id] = 1;
  };
  for (size_t id = 0; id < vocab_by_id.size(); ++id) {
    if (!vocab_by_id[id].empty()) set_token(id, vocab_by_id[id]);
  }
  for (const AddedToken& t : m->added_tokens) {
    set_token(t.id, t.content);
    m->token_special[t.id] = t.special;
  }
  m->finish_load();
  return m;
}

const std::vector<uint32_t>& byte_level_chars() {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> chars(256, 0);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      chars[b] = printable ? b : next++;
    }
    return chars;
  }();
  return table;
}

}  // namespace plow
