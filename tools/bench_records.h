// What every `plow bench` record carries and where it goes: the git revision, the machine, the command
// that reproduces the run, and the JSON array of records under bench/results it is appended to.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>

namespace plow::tools {

// The short git revision (−dirty when the tree has changes; PLOW_GIT_REV overrides).
std::string git_revision();
// The CPU's model name (/proc/cpuinfo).
std::string cpu_model();
// This process's argv, space-separated.
std::string process_command_line();
// Runs a shell command and returns what it printed on stdout; *status gets pclose's status.
std::string run_and_capture(const std::string& command, int* status = nullptr);
// Appends `records` to the JSON array at `path` (created when missing).
void append_records(const std::string& path, const nlohmann::json& records);

// A kernel peer's records ({"tokens", "ms"} or {"tokens", "skipped"}) by length, from the JSON array
// `command` prints; when it prints none, `bench` (e.g. "bench prefill") says so on stderr and the map
// is empty (a missing package is a finding, not a crash).
std::map<int64_t, nlohmann::json> run_length_peer(const std::string& bench, const std::string& name, const std::string& command);
// The peer's record for length p with ours beside it (ours < 0: not measured in this run); with both,
// `speedup_vs_peer` and a line on stderr naming `name`.
nlohmann::json peer_entry(const std::map<int64_t, nlohmann::json>& peer, int64_t p, double ours, const std::string& what, const std::string& name);

}  // namespace plow::tools
