// Shared by the server tests (tests/server) and the GPU server tests (tests/gpu): a small model
// directory with a tokenizer, and a server running in-process on a free loopback port.
#pragma once

#include <httplib.h>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <thread>

#include "serve/server.h"

namespace plow::server_test {

namespace fs = std::filesystem;

// tiny-kimi-linear (under `data`) plus the byte-level tokenizer and chat template of tiny-kimi-linear-chat.
inline fs::path make_model_dir(const fs::path& data) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("plow_server_test_{}", ::getpid()) / "tiny-kimi-linear-chat";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(data / "tiny-kimi-linear")) fs::copy(entry.path(), dir / entry.path().filename());
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) fs::copy(data / "tiny-kimi-linear-chat" / name, dir / name);
  return dir;
}

struct Running {
  std::unique_ptr<Server> server;
  int port = 0;
  std::thread thread;

  explicit Running(ServeOptions options) {
    options.port = 0;
    server = std::make_unique<Server>(std::move(options));
    port = server->bind();
    thread = std::thread([this] { server->run(); });
  }
  ~Running() {
    server->shutdown();
    thread.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    return c;
  }
};

}  // namespace plow::server_test
