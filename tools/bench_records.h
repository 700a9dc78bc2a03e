// What every `plow bench` record carries and where it goes: the git revision, the machine, the command
// that reproduces the run, and the JSON array of records under bench/results it is appended to.
#pragma once

#include <nlohmann/json.hpp>

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

}  // namespace plow::tools
