// `plow serve`: an OpenAI-compatible HTTP server (cpp-httplib) over one model on the reference CPU
// backend. Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET
// /v1/models, /health, /metrics (and /debug/integrity with debug_endpoints). Every refused request gets an OpenAI error object and the server
// keeps serving; shutdown() stops accepting, finishes in-flight requests, then returns from run().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/model.h"
#include "engine/scheduler.h"

namespace plow {

// Makes the backend the server runs (num_slots sequences, max_context_tokens each, steps of at most
// max_step_tokens tokens). Unset: the CPU reference.
using BackendFactory = std::function<std::unique_ptr<Backend>(const LoadedModel& model, int num_slots, int64_t max_context_tokens,
                                                              int64_t max_step_tokens)>;

struct ServeOptions {
  BackendFactory make_backend;
  std::string model_dir;
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (bind() returns it)
  std::string api_key;              // empty: no authentication
  int64_t max_tokens_limit = 4096;  // largest max_tokens a request may ask for
  int64_t max_context_tokens = 4096;
  int num_slots = 16;               // sequences decoding at once
  int64_t max_waiting = 256;        // queued requests beyond which new ones get 429
  size_t max_body_bytes = size_t{1} << 20;
  SchedulerOptions scheduler;
  std::string served_model_name;    // default: the model directory's name
  int64_t prefix_cache_mb = 512;    // prefix cache budget (0: no prefix cache)
  bool debug_endpoints = false;     // GET /debug/integrity: the scheduler's and prefix cache's integrity check
};

class Server {
 public:
  explicit Server(ServeOptions options);  // loads the model and tokenizer; plow::Error when they are bad
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int bind();  // binds host:port, returns the port; plow::Error when it cannot
  void run();  // serves until shutdown()
  // Stops accepting (new requests get 503), waits for in-flight requests, and makes run() return.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace plow
