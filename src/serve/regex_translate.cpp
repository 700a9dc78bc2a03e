// Oniguruma / Rust-regex pattern -> PCRE2 pattern. A single pass over the pattern; character classes
// are parsed into a small tree because PCRE2 (10.42) has neither nested classes nor set operations.
// Every construct whose meaning differs between the engines is rewritten or rejected here.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cctype>
#include <string>
#include <vector>

#include "core/error.h"
#include "serve/pretoken_regex.h"

namespace plow {

namespace {

// Unicode White_Space: PCRE2's UCP `\s` also matches U+180E, which neither Oniguruma nor Rust do.
constexpr const char* kSpaceItems = "\\p{White_Space}";
constexpr const char* kNotSpaceItems = "\\P{White_Space}";
constexpr const char* kOnigWordItems = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
constexpr const char* kRustWordItems = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}";
constexpr const char* kHexItems = "0-9A-Fa-f";

// General categories by loose name (lowercase, no '_', '-', ' ') -> PCRE2 short name.
constexpr std::array<std::pair<const char*, const char*>, 76> kCategories = {{
    {"l", "L"}, {"letter", "L"}, {"lc", "L&"}, {"casedletter", "L&"}, {"l&", "L&"},
    {"lu", "Lu"}, {"uppercaseletter", "Lu"}, {"ll", "Ll"}, {"lowercaseletter", "Ll"},
    {"lt", "Lt"}, {"titlecaseletter", "Lt"}, {"lm", "Lm"}, {"modifierletter", "Lm"},
    {"lo", "Lo"}, {"otherletter", "Lo"}, {"m", "M"}, {"mark", "M"}, {"combiningmark", "M"},
    {"mn", "Mn"}, {"nonspacingmark", "Mn"}, {"mc", "Mc"}, {"spacingmark", "Mc"},
    {"me", "Me"}, {"enclosingmark", "Me"}, {"n", "N"}, {"number", "N"}, {"nd", "Nd"},
    {"decimalnumber", "Nd"}, {"nl", "Nl"}, {"letternumber", "Nl"}, {"no", "No"}, {"othernumber", "No"},
    {"p", "P"}, {"punctuation", "P"}, {"pc", "Pc"}, {"connectorpunctuation", "Pc"},
    {"pd", "Pd"}, {"dashpunctuation", "Pd"}, {"ps", "Ps"}, {"openpunctuation", "Ps"},
    {"pe", "Pe"}, {"closepunctuation", "Pe"}, {"pi", "Pi"}, {"initialpunctuation", "Pi"},
    {"pf", "Pf"}, {"finalpunctuation", "Pf"}, {"po", "Po"}, {"otherpunctuation", "Po"},
    {"s", "S"}, {"symbol", "S"}, {"sm", "Sm"}, {"mathsymbol", "Sm"}, {"sc", "Sc"},
    {"currencysymbol", "Sc"}, {"sk", "Sk"}, {"modifiersymbol", "Sk"}, {"so", "So"},
    {"othersymbol", "So"}, {"z", "Z"}, {"separator", "Z"}, {"zs", "Zs"}, {"spaceseparator", "Zs"},
    {"zl", "Zl"}, {"lineseparator", "Zl"}, {"zp", "Zp"}, {"paragraphseparator", "Zp"},
    {"c", "C"}, {"other", "C"}, {"cc", "Cc"}, {"control", "Cc"}, {"cf", "Cf"}, {"format", "Cf"},
    {"co", "Co"}, {"privateuse", "Co"}, {"cn", "Cn"}, {"any", "Any"},
}};

std::string loose(std::string_view name) {
  std::string out;
  for (char c : name) {
    if (c == '_' || c == '-' || c == ' ') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

bool pcre2_accepts(const std::string& pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code) pcre2_code_free(code);
  return code != nullptr;
}

// One operand of a class: plain PCRE2 class items plus nested classes (a union).
struct ClassNode;
struct Operand {
  std::string items;
  std::vector<ClassNode> nested;
};
struct ClassNode {
  bool negated = false;
  std::vector<Operand> operands;  // intersected; Rust `--` operands after the first are subtracted
  bool difference = false;
};

class Translator {
 public:
  Translator(std::string_view pattern, RegexDialect dialect, const std::string& where)
      : p_(pattern), dialect_(dialect), where_(where) {}

  std::string run() {
    std::string out;
    while (pos_ < p_.size()) {
      const char c = p_[pos_];
      if (c == '\\') {
        ++pos_;
        out += escape_outside();
      } else if (c == '[') {
        ++pos_;
        out += emit(parse_class());
      } else if (c == '(' && peek(1) == '?') {
        out += group_opening();
      } else if ((c == '^' || c == '$') && dialect_ == RegexDialect::kOniguruma) {
        out += c == '^' ? "(?m:^)" : "(?m:$)";  // Oniguruma anchors always match at line breaks
        ++pos_;
      } else if (c == '{' && peek(1) == ',' && dialect_ == RegexDialect::kOniguruma) {
        out += "{0";  // Oniguruma's {,n} is {0,n}; PCRE2 10.42 would read it as literal text
        ++pos_;
      } else {
        out.push_back(c);
        ++pos_;
      }
    }
    return out;
  }

 private:
  char peek(size_t ahead) const { return pos_ + ahead < p_.size() ? p_[pos_ + ahead] : '\0'; }

  [[noreturn]] void error(std::string_view what) const {
    fail("{}: regex '{}': {} (at offset {})", where_, p_, what, pos_);
  }

  const char* word_items() const { return dialect_ == RegexDialect::kRust ? kRustWordItems : kOnigWordItems; }

  // Copies one UTF-8 character starting at pos_.
  std::string take_char() {
    size_t len = 1;
    const auto lead = static_cast<uint8_t>(p_[pos_]);
    if (lead >= 0xF0) len = 4;
    else if (lead >= 0xE0) len = 3;
    else if (lead >= 0xC0) len = 2;
    if (pos_ + len > p_.size()) error("truncated UTF-8 character");
    std::string out(p_.substr(pos_, len));
    pos_ += len;
    return out;
  }

  // After "(?": rewrites inline flag groups "(?flags)" / "(?flags:"; copies every other group opening.
  std::string group_opening() {
    if (peek(2) == '#') {  // comment group: copy verbatim
      const size_t close = p_.find(')', pos_);
      if (close == std::string_view::npos) error("unterminated comment group");
      std::string out(p_.substr(pos_, close + 1 - pos_));
      pos_ = close + 1;
      return out;
    }
    if (peek(2) == 'P' && peek(3) == '<') {  // Python-style named group
      pos_ += 4;
      return "(?<";
    }
    size_t end = pos_ + 2;
    while (end < p_.size() && (std::isalpha(static_cast<unsigned char>(p_[end])) || p_[end] == '-')) ++end;
    const bool flag_group = end > pos_ + 2 && end < p_.size() && (p_[end] == ')' || p_[end] == ':');
    if (!flag_group) {
      pos_ += 2;
      return "(?";
    }
    std::string flags;
    for (size_t i = pos_ + 2; i < end; ++i) {
      const char f = p_[i];
      if (f == '-' || f == 'i' || f == 'x') {
        flags.push_back(f);
      } else if (dialect_ == RegexDialect::kOniguruma && f == 'm') {
        flags.push_back('s');  // Oniguruma's (?m) is dot-all
      } else if (dialect_ == RegexDialect::kRust && (f == 'm' || f == 's' || f == 'U')) {
        flags.push_back(f);
      } else if (dialect_ != RegexDialect::kRust || f != 'u') {  // Rust's u: Unicode mode is always on
        pos_ = i;
        error(fmt::format("inline flag '{}' is not supported", f));
      }
    }
    const char terminator = p_[end];
    pos_ = end + 1;
    if (flags.empty() || flags == "-") return terminator == ':' ? "(?:" : "";
    return "(?" + flags + terminator;
  }

  // After "\p" or "\P"; returns a PCRE2 property escape with the same meaning.
  std::string property(bool negated) {
    std::string name;
    if (peek(0) == '{') {
      const size_t close = p_.find('}', pos_);
      if (close == std::string_view::npos) error("unterminated \\p{...}");
      name = std::string(p_.substr(pos_ + 1, close - pos_ - 1));
      pos_ = close + 1;
    } else if (pos_ < p_.size()) {
      name = std::string(1, p_[pos_++]);
    } else {
      error("\\p at end of pattern");
    }
    if (!name.empty() && name[0] == '^') {  // Oniguruma \p{^X}
      negated = !negated;
      name.erase(0, 1);
    }
    std::string key, value = name;
    if (const size_t eq = name.find_first_of("=:"); eq != std::string::npos) {
      key = loose(name.substr(0, eq));
      value = name.substr(eq + 1);
      if (!key.empty() && key.back() == '!') {
        negated = !negated;
        key.pop_back();
      }
    }
    const char* escape = negated ? "\\P{" : "\\p{";
    if (key == "sc" || key == "script") return fmt::format("{}sc:{}}}", escape, value);
    if (key == "scx" || key == "scriptextensions") return fmt::format("{}scx:{}}}", escape, value);
    if (!key.empty() && key != "gc" && key != "generalcategory") error(fmt::format("property '{}' is not supported", name));
    const std::string norm = loose(value);
    for (const auto& [alias, short_name] : kCategories) {
      if (norm == alias) return fmt::format("{}{}}}", escape, short_name);
    }
    if (!key.empty()) error(fmt::format("unknown general category '{}'", value));
    // A bare script name: PCRE2 >= 10.40 reads \p{Han} as Script_Extensions, both sources mean Script.
    if (pcre2_accepts(fmt::format("\\p{{sc:{}}}", value))) return fmt::format("{}sc:{}}}", escape, value);
    return fmt::format("{}{}}}", escape, value);  // a binary property such as Alphabetic
  }

  // \x, \u, \U escapes -> \x{...}; pos_ is just past the letter.
  std::string hex_escape(char letter) {
    if (peek(0) == '{') {
      const size_t close = p_.find('}', pos_);
      if (close == std::string_view::npos) error("unterminated hex escape");
      std::string digits(p_.substr(pos_ + 1, close - pos_ - 1));
      pos_ = close + 1;
      return "\\x{" + digits + "}";
    }
    const size_t want = letter == 'x' ? 2 : letter == 'u' ? 4 : 8;
    size_t n = 0;
    while (n < want && std::isxdigit(static_cast<unsigned char>(peek(n)))) ++n;
    if (n == 0 || (letter != 'x' && n != want)) error(fmt::format("malformed \\{} escape", letter));
    std::string digits(p_.substr(pos_, n));
    pos_ += n;
    return "\\x{" + digits + "}";
  }

  // Escapes with a different meaning or spelling between the engines, or "" when it copies as is.
  std::string common_escape(char e) {
    switch (e) {
      case 'p': return property(false);
      case 'P': return property(true);
      case 'd': return "\\p{Nd}";
      case 'D': return "\\P{Nd}";
      case 's': return kSpaceItems;
      case 'S': return kNotSpaceItems;
      case 'v': return "\\x{0B}";  // PCRE2's \v is a class of vertical space
      case 'x': return hex_escape('x');
      case 'u': return hex_escape('u');
      case 'U':
        if (dialect_ == RegexDialect::kRust) return hex_escape('U');
        break;
      default: break;
    }
    return "";
  }

  std::string escape_outside() {
    if (pos_ >= p_.size()) error("pattern ends with a backslash");
    const char e = p_[pos_++];
    if (e == 'w') return fmt::format("[{}]", word_items());
    if (e == 'W') return fmt::format("[^{}]", word_items());
    if (e == 'h' && dialect_ == RegexDialect::kOniguruma) return fmt::format("[{}]", kHexItems);
    if (e == 'H' && dialect_ == RegexDialect::kOniguruma) return fmt::format("[^{}]", kHexItems);
    if (e == 'h' || e == 'H') error("\\h is not supported");
    std::string translated = common_escape(e);
    if (!translated.empty()) return translated;
    --pos_;
    std::string out = "\\";
    out += take_char();
    return out;
  }

  // After "[": parses up to the matching "]".
  ClassNode parse_class() {
    ClassNode node;
    if (peek(0) == '^') {
      node.negated = true;
      ++pos_;
    }
    Operand current;
    bool first = true;
    while (true) {
      if (pos_ >= p_.size()) error("unterminated character class");
      const char c = p_[pos_];
      if (c == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      if (c == '[' && peek(1) == ':') {
        const size_t close = p_.find(":]", pos_ + 2);
        if (close == std::string_view::npos) error("unterminated POSIX class");
        current.items += std::string(p_.substr(pos_, close + 2 - pos_));
        pos_ = close + 2;
      } else if (c == '[') {
        ++pos_;
        current.nested.push_back(parse_class());
      } else if (c == '&' && peek(1) == '&') {
        if (node.difference) error("mixing '&&' and '--' in one class is not supported");
        pos_ += 2;
        node.operands.push_back(std::move(current));
        current = Operand{};
      } else if (dialect_ == RegexDialect::kRust && c == '-' && peek(1) == '-') {
        if (node.operands.size() > 0 && !node.difference) error("mixing '&&' and '--' in one class is not supported");
        node.difference = true;
        pos_ += 2;
        node.operands.push_back(std::move(current));
        current = Operand{};
      } else if (dialect_ == RegexDialect::kRust && c == '~' && peek(1) == '~') {
        error("symmetric class difference '~~' is not supported");
      } else if (c == '\\') {
        ++pos_;
        class_escape(current);
      } else if (c == ']' || c == '^') {
        current.items += std::string("\\") + c;  // literal here; escaped so it stays literal anywhere
        ++pos_;
      } else {
        current.items += take_char();
      }
    }
    node.operands.push_back(std::move(current));
    return node;
  }

  void class_escape(Operand& into) {
    if (pos_ >= p_.size()) error("pattern ends with a backslash");
    const char e = p_[pos_++];
    if (e == 'w') {
      into.items += word_items();
    } else if (e == 'W') {
      into.nested.push_back(ClassNode{true, {Operand{word_items(), {}}}, false});
    } else if (e == 'h' && dialect_ == RegexDialect::kOniguruma) {
      into.items += kHexItems;
    } else if (e == 'H' && dialect_ == RegexDialect::kOniguruma) {
      into.nested.push_back(ClassNode{true, {Operand{kHexItems, {}}}, false});
    } else if (e == 'h' || e == 'H') {
      error("\\h is not supported");
    } else if (std::string t = common_escape(e); !t.empty()) {
      into.items += t;
    } else {
      --pos_;
      into.items.push_back('\\');
      into.items += take_char();
    }
  }

  std::string emit_operand(const Operand& op) const {
    std::vector<std::string> parts;
    if (!op.items.empty()) parts.push_back("[" + op.items + "]");
    for (const ClassNode& n : op.nested) parts.push_back(emit(n));
    if (parts.empty()) error("empty character class operand");
    if (parts.size() == 1) return parts[0];
    std::string out = "(?:" + parts[0];
    for (size_t i = 1; i < parts.size(); ++i) out += "|" + parts[i];
    return out + ")";
  }

  // A class becomes a plain PCRE2 class when it can; otherwise a group that consumes exactly one
  // character of the first operand after lookaheads have checked it against the other operands.
  std::string emit(const ClassNode& node) const {
    if (node.operands.size() == 1 && node.operands[0].nested.empty()) {
      if (node.operands[0].items.empty()) error("empty character class");
      return std::string(node.negated ? "[^" : "[") + node.operands[0].items + "]";
    }
    std::string guards;
    for (size_t i = 1; i < node.operands.size(); ++i) {
      const std::string e = emit_operand(node.operands[i]);
      const bool negated_class = e.size() > 2 && e.compare(0, 2, "[^") == 0;
      if (node.difference) {
        guards += "(?!" + e + ")";
      } else if (negated_class) {
        guards += "(?![" + e.substr(2) + ")";  // (?=[^X]) before a one-character match is (?![X])
      } else {
        guards += "(?=" + e + ")";
      }
    }
    const std::string inner = guards.empty() ? emit_operand(node.operands[0])
                                             : "(?:" + guards + emit_operand(node.operands[0]) + ")";
    return node.negated ? "(?:(?!" + inner + ")(?s:.))" : inner;
  }

  std::string_view p_;
  RegexDialect dialect_;
  const std::string& where_;
  size_t pos_ = 0;
};

}  // namespace

std::string translate_regex(std::string_view pattern, RegexDialect dialect, const std::string& where) {
  return Translator(pattern, dialect, where).run();
}

}  // namespace plow
