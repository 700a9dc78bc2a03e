// ChatTemplate: loading from tokenizer_config.json, and the render context HF's apply_chat_template
// builds (special tokens, then tools/documents = None and add_generation_prompt = False, then the
// caller's variables). Parsing and evaluation live in the jinja_* files.
#include "serve/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "serve/jinja_eval.h"
#include "serve/jinja_parser.h"

namespace plow {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open the file", path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{}: read error", path);
  return text.str();
}

std::tm local_now() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  return tm;
}

}  // namespace

ChatTemplate ChatTemplate::parse(std::string source, std::string origin) {
  ChatTemplate t;
  t.program_ = jinja::parse_program(source, origin);
  t.source_ = std::move(source);
  t.origin_ = std::move(origin);
  return t;
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  nlohmann::ordered_json config;
  try {
    config = nlohmann::ordered_json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", path, e.what());
  }
  if (!config.is_object()) fail("{}: expected a JSON object, found {}", path, config.type_name());

  std::string source, origin;
  auto field = config.find("chat_template");
  if (field == config.end() || field->is_null()) {
    std::filesystem::path sibling = std::filesystem::path(path).parent_path() / "chat_template.jinja";
    if (!std::filesystem::exists(sibling)) {
      fail("{}: no 'chat_template' field and no chat_template.jinja beside it: the model ships no chat template",
           path);
    }
    source = read_file(sibling.string());
    origin = sibling.string();
  } else if (field->is_string()) {
    source = field->get<std::string>();
    origin = path + ": chat_template";
  } else if (field->is_array()) {
    std::string names;
    for (const auto& entry : *field) {
      if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() || !entry.contains("template") ||
          !entry["template"].is_string()) {
        fail("{}: 'chat_template' list entries must be {{\"name\": string, \"template\": string}}, found {}", path,
             entry.dump());
      }
      names += (names.empty() ? "" : ", ") + entry["name"].get<std::string>();
      if (entry["name"] == "default") {
        source = entry["template"].get<std::string>();
        origin = path + ": chat_template[default]";
      }
    }
    if (origin.empty()) fail("{}: 'chat_template' has no entry named 'default' (found: {})", path, names);
  } else {
    fail("{}: 'chat_template' must be a string or a list of named templates, found {}", path, field->type_name());
  }

  ChatTemplate t = parse(std::move(source), std::move(origin));
  for (const char* name : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    auto token = config.find(name);
    if (token == config.end() || token->is_null()) continue;
    if (token->is_string()) {
      t.set_default(name, *token);
    } else if (token->is_object() && token->contains("content") && (*token)["content"].is_string()) {
      t.set_default(name, (*token)["content"]);
    } else {
      fail("{}: '{}' must be a string or an object with a string 'content', found {}", path, name, token->dump());
    }
  }
  return t;
}

void ChatTemplate::set_default(const std::string& name, nlohmann::ordered_json value) {
  defaults_[name] = std::move(value);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) fail("{}: the render context must be a JSON object, found {}", origin_, context.type_name());
  nlohmann::ordered_json merged = defaults_;
  for (const char* name : {"tools", "documents"}) {
    if (!context.contains(name)) merged[name] = nullptr;
  }
  if (!context.contains("add_generation_prompt")) merged["add_generation_prompt"] = false;
  for (const auto& [key, value] : context.items()) merged[key] = value;

  std::vector<std::pair<std::string, jinja::Value>> variables;
  try {
    for (const auto& [key, value] : merged.items()) variables.emplace_back(key, jinja::from_json(value));
  } catch (const jinja::TemplateError& e) {
    fail("{}: {}", origin_, e.what());
  }
  static const Clock kLocalClock = local_now;
  return jinja::render_program(*program_, std::move(variables), clock_ ? clock_ : kLocalClock, limits_);
}

std::string ChatTemplate::render(const nlohmann::json& context) const {
  return render(nlohmann::ordered_json(context));
}

}  // namespace plow
