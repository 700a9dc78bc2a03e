// Loader for tiktoken-format vocabularies as Kimi ships them: tiktoken.model ("base64(bytes) rank" per
// line, ranks dense from 0, all 256 single bytes present) plus the 256 reserved special ids that follow,
// named by tokenizer_config.json's added_tokens_decoder or "<|reserved_token_{id}|>" (tokenization_kimi.py).
#include <nlohmann/json.hpp>

#include <charconv>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "serve/tokenizer_model.h"

namespace plow {

const std::string_view kKimiPattern =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

using nlohmann::json;

constexpr size_t kReservedSpecialTokens = 256;  // TikTokenTokenizer.num_reserved_special_tokens

// Strict RFC 4648 base64 (standard alphabet, '=' padding only at the end); nullopt when malformed.
std::optional<std::string> base64_decode(std::string_view text) {
  if (text.empty() || text.size() % 4 != 0) return std::nullopt;
  const auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t padding = 0;
  while (padding < 2 && text[text.size() - 1 - padding] == '=') ++padding;
  std::string out;
  uint32_t buffer = 0;
  int bits = 0;
  for (size_t i = 0; i < text.size() - padding; ++i) {
    const int v = value(text[i]);
    if (v < 0) return std::nullopt;
    buffer = (buffer << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((buffer >> bits) & 0xFF));
    }
  }
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Token bytes by rank, from tiktoken.model.
std::vector<std::string> read_ranks(const std::string& path) {
  const std::string text = read_file(path);
  std::vector<std::string> by_rank;
  std::vector<size_t> line_of_rank;
  std::unordered_map<std::string, size_t> line_of_token;
  size_t line_number = 0;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + start, end - start);
    start = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find_first_of(" \t");
    const size_t rank_start = line.find_first_not_of(" \t", space);
    if (space == std::string_view::npos || rank_start == std::string_view::npos ||
        line.find_first_of(" \t", rank_start) != std::string_view::npos) {
      fail("{}:{}: expected \"<base64 token> <rank>\", found \"{}\"", path, line_number, line);
    }
    const std::string_view token_text = line.substr(0, space), rank_text = line.substr(rank_start);
    const std::optional<std::string> token = base64_decode(token_text);
    if (!token) fail("{}:{}: token \"{}\" is not valid base64", path, line_number, token_text);
    int64_t rank = -1;
    const auto [ptr, ec] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    if (ec != std::errc() || ptr != rank_text.data() + rank_text.size() || rank < 0 ||
        rank >= kMaxTokenIds - static_cast<int64_t>(kReservedSpecialTokens)) {
      fail("{}:{}: rank \"{}\" is not an integer in [0, {})", path, line_number, rank_text,
           kMaxTokenIds - static_cast<int64_t>(kReservedSpecialTokens));
    }
    const auto r = static_cast<size_t>(rank);
    if (r >= by_rank.size()) {
      by_rank.resize(r + 1);
      line_of_rank.resize(r + 1, 0);
    }
    if (line_of_rank[r] != 0) fail("{}:{}: rank {} is already given on line {}", path, line_number, r, line_of_rank[r]);
    if (auto [it, inserted] = line_of_token.emplace(*token, line_number); !inserted) {
      fail("{}:{}: token \"{}\" is already given on line {}", path, line_number, token_text, it->second);
    }
    by_rank[r] = *token;
    line_of_rank[r] = line_number;
  }
  if (by_rank.empty()) fail("{}: no tokens", path);
  for (size_t r = 0; r < by_rank.size(); ++r) {
    if (line_of_rank[r] == 0) fail("{}: ranks must be 0..{} without gaps, rank {} is missing", path, by_rank.size() - 1, r);
  }
  return by_rank;
}

// Names and special flags of the reserved ids [base, base + 256).
void read_specials(const std::string& path, size_t base, TokenizerModel& m) {
  const std::string text = read_file(path);
  json config;
  try {
    config = json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
  if (!config.is_object()) fail("{}: expected a JSON object at the top level", path);
  std::vector<AddedToken> reserved(kReservedSpecialTokens);
  for (size_t i = 0; i < kReservedSpecialTokens; ++i) {
    reserved[i] = AddedToken{fmt::format("<|reserved_token_{}|>", base + i), static_cast<int32_t>(base + i), true};
  }
  auto decoder = config.find("added_tokens_decoder");
  if (decoder != config.end() && !decoder->is_null()) {
    if (!decoder->is_object()) fail("{}: field 'added_tokens_decoder' must be an object", path);
    for (const auto& [key, entry] : decoder->items()) {
      const std::string field = fmt::format("added_tokens_decoder[\"{}\"]", key);
      int64_t id = -1;
      const auto [ptr, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || ptr != key.data() + key.size()) fail("{}: field '{}': the key must be a token id", path, field);
      if (id < static_cast<int64_t>(base) || id >= static_cast<int64_t>(base + kReservedSpecialTokens)) {
        fail("{}: field '{}': id {} is outside the special-token range [{}, {}) that follows tiktoken.model's ranks",
             path, field, id, base, base + kReservedSpecialTokens);
      }
      if (!entry.is_object() || !entry.contains("content") || !entry["content"].is_string() ||
          entry["content"].get<std::string>().empty()) {
        fail("{}: field '{}.content' must be a non-empty string", path, field);
      }
      AddedToken& t = reserved[static_cast<size_t>(id) - base];
      t.content = entry["content"].get<std::string>();
      if (entry.contains("special") && !entry["special"].is_boolean()) fail("{}: field '{}.special' must be true or false", path, field);
      t.special = entry.value("special", true);
    }
  }
  std::unordered_map<std::string, int32_t> seen;
  for (const AddedToken& t : reserved) {
    if (auto [it, inserted] = seen.emplace(t.content, t.id); !inserted) {
      fail("{}: field 'added_tokens_decoder': \"{}\" names both id {} and id {}", path, t.content, it->second, t.id);
    }
  }
  m.added_tokens = std::move(reserved);
}

}  // namespace

std::shared_ptr<const TokenizerModel> load_tiktoken_tokenizer(const std::string& model_path, const std::string& config_path) {
  auto m = std::make_shared<TokenizerModel>();
  m->format = TokenizerFormat::kTiktoken;
  m->source = model_path;
  std::vector<std::string> by_rank = read_ranks(model_path);
  const size_t base = by_rank.size();
  m->bpe.kind = BpeModel::Kind::kRankByBytes;
  for (size_t r = 0; r < base; ++r) {
    m->bpe.vocab.emplace(by_rank[r], static_cast<int32_t>(r));
    if (by_rank[r].size() == 1) m->bpe.byte_ids[static_cast<uint8_t>(by_rank[r][0])] = static_cast<int32_t>(r);
  }
  for (size_t b = 0; b < 256; ++b) {
    if (m->bpe.byte_ids[b] < 0) fail("{}: no token for the single byte 0x{:02X} (tiktoken needs all 256)", model_path, b);
  }
  read_specials(config_path, base, *m);
  m->tiktoken_regex = std::make_unique<PretokenRegex>(kKimiPattern, RegexDialect::kRust,
                                                      model_path + ": Kimi pre-tokenizer pattern");
  m->token_bytes = std::move(by_rank);
  for (const AddedToken& t : m->added_tokens) m->token_bytes.push_back(t.content);
  m->token_present.assign(m->token_bytes.size(), 1);
  m->token_special.assign(m->token_bytes.size(), 0);
  for (const AddedToken& t : m->added_tokens) m->token_special[t.id] = t.special;
  m->finish_load();
  return m;
}

}  // namespace plow
