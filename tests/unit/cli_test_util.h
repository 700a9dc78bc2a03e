// Shared by the tests that run the real `plow` binary (PLOW_BINARY): file slurping and one command run
// with its exit code, stdout and stderr captured.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace plow::test {

inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct Outcome {
  int exit_code;  // 128: killed by a signal or the timeout
  std::string out, err;
};

// Runs `PLOW_BINARY args` under `timeout timeout_s`; stdout and stderr go through files in `scratch`.
inline Outcome run_plow(const std::string& args, const std::filesystem::path& scratch, int timeout_s = 120) {
  const std::string command = "timeout " + std::to_string(timeout_s) + " " + PLOW_BINARY + " " + args + " >" +
                              (scratch / "out").string() + " 2>" + (scratch / "err").string();
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, slurp(scratch / "out"), slurp(scratch / "err")};
}

}  // namespace plow::test
