#include "tools/bench_records.h"

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "core/error.h"

namespace plow::tools {

using nlohmann::json;

std::string run_and_capture(const std::string& command, int* status) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) out.append(buffer.data(), n);
  const int rc = pclose(pipe);
  if (status != nullptr) *status = rc;
  return out;
}

std::string git_revision() {
  if (const char* env = std::getenv("PLOW_GIT_REV"); env != nullptr && *env != '\0') return env;
  std::string rev = run_and_capture("git rev-parse --short=12 HEAD 2>/dev/null");
  while (!rev.empty() && (rev.back() == '\n' || rev.back() == ' ')) rev.pop_back();
  if (rev.empty()) return "unknown";
  const std::string dirty = run_and_capture("git status --porcelain --untracked-files=no 2>/dev/null");
  return dirty.empty() ? rev : rev + "-dirty";
}

void append_records(const std::string& path, const json& records) {
  json all = json::array();
  if (std::filesystem::exists(path)) {
    std::ifstream in(path);
    try {
      all = json::parse(in);
    } catch (const json::exception& e) {
      fail("{}: not a JSON array of benchmark records ({}); move it away to start a new one", path, e.what());
    }
    if (!all.is_array()) fail("{}: expected a JSON array of benchmark records", path);
  }
  for (const json& r : records) all.push_back(r);
  if (const auto parent = std::filesystem::path(path).parent_path(); !parent.empty()) std::filesystem::create_directories(parent);
  std::ofstream out(path);
  out << all.dump(1) << "\n";
  if (!out) fail("{}: cannot write the benchmark records", path);
}

std::map<int64_t, json> run_length_peer(const std::string& bench, const std::string& name, const std::string& command) {
  std::map<int64_t, json> records;
  int status = 0;
  const std::string out = run_and_capture(command, &status);
  try {
    for (const json& r : json::parse(out.substr(out.find('[') == std::string::npos ? 0 : out.find('[')))) records[r.at("tokens").get<int64_t>()] = r;
  } catch (const json::exception& e) {
    std::cerr << fmt::format("{}: the {} peer printed no JSON array of records (status {}): {}\n", bench, name, status, e.what());
  }
  return records;
}

json peer_entry(const std::map<int64_t, json>& peer, int64_t p, double ours, const std::string& what, const std::string& name) {
  json entry = peer.contains(p) ? peer.at(p) : json{{"skipped", "the peer did not report this length"}};
  entry["what"] = what;
  if (ours >= 0) entry["ours_ms_per_layer"] = ours;
  if (ours > 0 && entry.contains("ms")) {
    entry["speedup_vs_peer"] = entry["ms"].get<double>() / ours;
    std::cerr << fmt::format("  {}, one layer: ours {:.3f} ms, peer {:.3f} ms ({:.2f}x)\n", name, ours, entry["ms"].get<double>(), entry["ms"].get<double>() / ours);
  }
  return entry;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

std::string process_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string out, arg;
  while (std::getline(in, arg, '\0')) out += (out.empty() ? "" : " ") + arg;
  return out;
}

}  // namespace plow::tools
