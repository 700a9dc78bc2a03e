#include "serve/server.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <optional>

#include "core/error.h"
#include "engine/model.h"
#include "runtime/cpu/reference.h"
#include "serve/api_error.h"
#include "serve/chat_template.h"
#include "serve/completion.h"
#include "serve/engine_loop.h"
#include "serve/generation_config.h"
#include "serve/metrics.h"
#include "serve/openai_params.h"
#include "serve/tokenizer.h"

namespace plow {

namespace {
constexpr size_t kHttpThreads = 128;  // concurrent connections served at once
// A whole response's idle writes (a space each): the first after kFirstProbe, each interval twice the
// last, up to kProbe. A write to a socket the client closed still succeeds (its reset arrives after), so
// a hang-up shows at the second write after it: with a fixed 100 ms the slot of a client that left at
// once stayed busy for ~200 ms, long enough for a small model to run a 4,000-token request to its end.
constexpr std::chrono::milliseconds kFirstProbe{10};
constexpr std::chrono::milliseconds kProbe{100};
}  // namespace

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json error_body(int status, const std::string& message, const std::string& param) {
  return {{"error", {{"message", message}, {"type", api_error_type(status)}, {"param", param.empty() ? json(nullptr) : json(param)}, {"code", status}}}};
}

void set_error(httplib::Response& res, int status, const std::string& message, const std::string& param = {}) {
  res.status = status;
  res.set_content(dump(error_body(status, message, param)), "application/json");
}

json parse_body(const httplib::Request& req) {
  try {
    return json::parse(req.body);
  } catch (const json::parse_error& e) {
    throw ApiError(400, fmt::format("the request body is not valid JSON (or not valid UTF-8): {}", e.what()));
  }
}

}  // namespace

struct Server::Impl {
  ServeOptions options;
  std::unique_ptr<LoadedModel> model;
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;
  ServedModel served;
  std::unique_ptr<Backend> backend;
  Metrics metrics;
  std::unique_ptr<EngineLoop> engine;
  httplib::Server http;
  std::atomic<bool> draining{false};
  std::atomic<uint64_t> next_id{0};

  explicit Impl(ServeOptions opts);
  void routes();
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  httplib::Server::Handler guarded(bool authenticated, Handler handler);
  void completions(const httplib::Request& req, httplib::Response& res, bool chat);
  // Responses still being written; shutdown() waits for them after the engine drained, so a drained
  // request's last events reach its client before the listener stops.
  std::mutex inflight_mu;
  std::condition_variable inflight_cv;
  int64_t inflight = 0;
  struct InFlight {
    Impl& impl;
    explicit InFlight(Impl& i) : impl(i) {
      std::lock_guard lock(impl.inflight_mu);
      ++impl.inflight;
    }
    ~InFlight() {
      std::lock_guard lock(impl.inflight_mu);
      if (--impl.inflight == 0) impl.inflight_cv.notify_all();
    }
  };
  bool pump(Completion& completion, EventQueue& queue, std::chrono::milliseconds wait);
  void abort_unfinished(const Completion& completion);
};

Server::Impl::Impl(ServeOptions opts) : options(std::move(opts)) {
  if (options.num_slots < 1) fail("--slots must be >= 1, found {}", options.num_slots);
  if (options.max_tokens_limit < 1) fail("--max-tokens-limit must be >= 1, found {}", options.max_tokens_limit);
  if (options.max_context_tokens < 2) fail("--max-model-len must be >= 2, found {}", options.max_context_tokens);
  if (options.prefix_cache_mb < 0) fail("--prefix-cache-mb must be >= 0 (0 disables the cache), found {}", options.prefix_cache_mb);
  if (options.prefix_cache_mb > (int64_t{1} << 30)) fail("--prefix-cache-mb {} is larger than any memory", options.prefix_cache_mb);
  options.scheduler.prefix_cache_bytes = options.prefix_cache_mb << 20;
  model = LoadedModel::load(options.model_dir);
  const fs::path dir(options.model_dir);
  if (fs::exists(dir / "tokenizer.json") || fs::exists(dir / "tiktoken.model")) tokenizer = Tokenizer::load(options.model_dir);
  if (tokenizer && static_cast<int64_t>(tokenizer->vocab_size()) > model->config.vocab_size) {
    fail("{}: the tokenizer has {} ids but the model's vocab_size is {}", options.model_dir, tokenizer->vocab_size(), model->config.vocab_size);
  }
  if (tokenizer && fs::exists(dir / "tokenizer_config.json")) {
    try {
      chat_template = ChatTemplate::from_tokenizer_config((dir / "tokenizer_config.json").string());
    } catch (const Error&) {
      chat_template.reset();  // no chat template: /v1/chat/completions answers 400
    }
  }
  served.name = options.served_model_name.empty() ? fs::absolute(dir).lexically_normal().filename().string() : options.served_model_name;
  if (served.name.empty()) served.name = fs::absolute(dir).lexically_normal().parent_path().filename().string();
  served.vocab_size = model->config.vocab_size;
  served.max_context_tokens = options.max_context_tokens;
  served.max_tokens_limit = options.max_tokens_limit;
  for (int64_t id : model->config.eos_token_ids) served.eos_ids.push_back(static_cast<int32_t>(id));
  apply_generation_config(options.model_dir, served);  // sampling defaults and extra eos ids
  served.tokenizer = tokenizer ? &*tokenizer : nullptr;
  served.chat_template = chat_template ? &*chat_template : nullptr;
  if (options.make_backend) {
    backend = options.make_backend(*model, options.num_slots, options.max_context_tokens, options.scheduler.max_step_tokens);
  } else {
    backend = std::make_unique<ReferenceBackend>(model->graph, *model->weights, model->weights->storage_dtype(), options.num_slots);
  }
  engine = std::make_unique<EngineLoop>(*backend, options.scheduler, options.max_waiting, metrics);
  http.set_payload_max_length(options.max_body_bytes);
  // One connection holds one thread for as long as it streams: size the pool for many concurrent
  // clients (httplib's default is max(8, cores − 1), which queues the ninth stream behind the others).
  http.new_task_queue = [] { return new httplib::ThreadPool(kHttpThreads); };
  http.set_read_timeout(30, 0);
  http.set_write_timeout(30, 0);
  routes();
}

httplib::Server::Handler Server::Impl::guarded(bool authenticated, Handler handler) {
  return [this, authenticated, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
    try {
      if (authenticated && !options.api_key.empty() && req.get_header_value("Authorization") != "Bearer " + options.api_key) {
        throw ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')");
      }
      if (draining) throw ApiError(503, "the server is shutting down");
      handler(req, res);
    } catch (const ApiError& e) {
      set_error(res, e.status, e.what(), e.param);
    } catch (const Error& e) {
      set_error(res, 400, e.what());
    } catch (const std::exception& e) {
      set_error(res, 500, fmt::format("internal error: {}", e.what()));
    }
  };
}

// Applies the request's events: waits up to `wait` for the first, then takes what has arrived until
// `wait` is over (at least one). Unbounded, the draining kept a provider inside while a fast engine
// kept the queue full, and a whole response's probes (and so a hang-up) waited seconds.
bool Server::Impl::pump(Completion& completion, EventQueue& queue, std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  auto event = queue.pop(wait);
  if (!event) return false;
  do {
    if (completion.apply(*event)) engine->abort(completion.request_id(event->choice));
  } while (std::chrono::steady_clock::now() < deadline && (event = queue.pop(std::chrono::milliseconds(0))));
  return true;
}

void Server::Impl::abort_unfinished(const Completion& completion) {
  for (size_t i = 0; i < completion.num_choices(); ++i) {
    if (!completion.done(i)) engine->abort(completion.request_id(i));
  }
}

// Both kinds of response are written by a content provider, so a client that hangs up is noticed
// while its request runs (a failed write) and its slot is freed at once: a stream writes its events;
// a whole response, while it waits, writes a space (JSON allows leading whitespace) at growing
// intervals up to kProbe.
void Server::Impl::completions(const httplib::Request& req, httplib::Response& res, bool chat) {
  const json body = parse_body(req);
  CompletionParams params = parse_completion(body, served, chat);
  const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id++);
  auto completion = std::make_shared<Completion>(std::move(params), served, id);
  auto queue = std::make_shared<EventQueue>();
  std::vector<Request> requests;
  const CompletionParams& p = completion->params();
  for (size_t i = 0; i < p.prompts.size(); ++i) {
    requests.push_back({completion->request_id(i), p.prompts[i], p.sampling, p.max_tokens, p.stop_token_ids});
  }
  engine->submit(std::move(requests), queue);
  auto tracker = std::make_shared<InFlight>(*this);  // shutdown() waits for it to be released
  auto release = [this, completion, tracker](bool success) {
    if (!success) abort_unfinished(*completion);
  };
  if (!p.stream) {
    struct Probe {
      std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
      std::chrono::milliseconds interval = kFirstProbe;
    };
    auto probe = std::make_shared<Probe>();
    res.set_chunked_content_provider(
        "application/json",
        [this, completion, queue, probe](size_t, httplib::DataSink& sink) {
          const auto due = probe->last + probe->interval;
          pump(*completion, *queue, std::max(std::chrono::milliseconds(0), std::chrono::ceil<std::chrono::milliseconds>(due - std::chrono::steady_clock::now())));
          std::string out;
          if (completion->done()) {
            out = dump(completion->response());
          } else if (engine->stopped()) {
            out = dump(error_body(503, "the server stopped", ""));
          } else if (const auto now = std::chrono::steady_clock::now(); now >= due) {
            probe->last = now;
            probe->interval = std::min(2 * probe->interval, kProbe);
            return sink.write(" ", 1);  // false: the client left
          } else {
            return true;
          }
          if (!sink.write(out.data(), out.size())) return false;
          sink.done();
          return true;
        },
        release);
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, completion, queue](size_t, httplib::DataSink& sink) {
        pump(*completion, *queue, std::chrono::milliseconds(50));
        for (size_t i = 0; i < completion->num_choices(); ++i) {
          while (auto chunk = completion->next_chunk(i)) {
            const std::string line = "data: " + dump(*chunk) + "\n\n";
            if (!sink.write(line.data(), line.size())) return false;  // the client left: the releaser aborts
          }
        }
        if (completion->done()) {
          std::string tail;
          if (completion->params().include_usage) tail += "data: " + dump(completion->usage_chunk()) + "\n\n";
          tail += "data: [DONE]\n\n";
          if (!sink.write(tail.data(), tail.size())) return false;
          sink.done();
        } else if (engine->stopped()) {
          return false;
        }
        return true;
      },
      release);
}

void Server::Impl::routes() {
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const std::string message = res.status == 413 ? fmt::format("the request body is over {} bytes", options.max_body_bytes)
                                : res.status == 404 ? std::string("no such route")
                                                    : fmt::format("HTTP {}", res.status);
    set_error(res, res.status, message);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.Post("/v1/completions", guarded(true, [this](const auto& req, auto& res) { completions(req, res, false); }));
  http.Post("/v1/chat/completions", guarded(true, [this](const auto& req, auto& res) { completions(req, res, true); }));
  http.Get("/v1/models", guarded(true, [this](const auto&, auto& res) {
    const json card = {{"id", served.name}, {"object", "model"}, {"created", 0}, {"owned_by", "plow"}, {"max_model_len", served.max_context_tokens}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({card})}}), "application/json");
  }));
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining) return set_error(res, 503, "the server is shutting down");
    res.status = 200;
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(served.name, engine->gauges()), "text/plain; version=0.0.4");
  });
  if (options.debug_endpoints) {
    http.Get("/debug/integrity", [this](const httplib::Request&, httplib::Response& res) {
      try {
        engine->check_integrity();
        res.set_content(dump({{"ok", true}, {"num_requests_running", engine->num_running()}, {"num_requests_waiting", engine->num_waiting()}}),
                        "application/json");
      } catch (const std::exception& e) {
        set_error(res, 500, fmt::format("integrity check failed: {}", e.what()));
      }
    });
  }
  http.Post("/tokenize", guarded(true, [this](const auto& req, auto& res) {
    const json body = parse_body(req);
    if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
    std::vector<int32_t> ids;
    if (body.contains("messages")) {
      ids = chat_prompt(body["messages"], served);
    } else if (body.contains("prompt") && body["prompt"].is_string()) {
      ids = parse_prompt(body["prompt"], served, "prompt");
    } else {
      throw ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt");
    }
    res.set_content(dump({{"count", ids.size()}, {"max_model_len", served.max_context_tokens}, {"tokens", ids}}), "application/json");
  }));
  http.Post("/detokenize", guarded(true, [this](const auto& req, auto& res) {
    const json body = parse_body(req);
    if (!body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) throw ApiError(400, "'tokens' (a list of ids) is required", "tokens");
    if (!tokenizer) throw ApiError(400, fmt::format("model '{}' has no tokenizer", served.name));
    std::vector<int32_t> ids;
    for (const json& id : body["tokens"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= static_cast<int64_t>(tokenizer->vocab_size())) {
        throw ApiError(400, fmt::format("'tokens' entries must be ids in [0, {}), found {}", tokenizer->vocab_size(), id.dump()), "tokens");
      }
      ids.push_back(id.get<int32_t>());
    }
    res.set_content(dump({{"prompt", tokenizer->decode(ids)}}), "application/json");
  }));
}

Server::Server(ServeOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Server::~Server() {
  impl_->http.stop();
}

// Debian's cpp-httplib listens with a backlog of 5: a burst of concurrent clients overflows the accept
// queue and some connections are reset before they are served. The listening socket is remembered
// when it is made (httplib's own options kept) and put back into listen() with a deep queue.
int Server::bind() {
  const ServeOptions& o = impl_->options;
  auto listening = std::make_shared<int>(-1);
  impl_->http.set_socket_options([listening](socket_t sock) {
    httplib::default_socket_options(sock);
    *listening = static_cast<int>(sock);
  });
  int port = o.port;
  if (o.port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    if (port < 0) fail("cannot bind {} (any port)", o.host);
  } else if (!impl_->http.bind_to_port(o.host, o.port)) {
    fail("cannot bind {}:{} (in use, or not a local address)", o.host, o.port);
  }
  if (*listening >= 0 && ::listen(*listening, SOMAXCONN) != 0) fail("cannot deepen the accept queue of {}:{}", o.host, port);
  return port;
}

void Server::run() { impl_->http.listen_after_bind(); }

void Server::shutdown() {
  impl_->draining = true;
  impl_->engine->drain();
  {
    std::unique_lock lock(impl_->inflight_mu);
    impl_->inflight_cv.wait(lock, [&] { return impl_->inflight == 0; });  // a failed write releases a response too
  }
  impl_->http.stop();
}

}  // namespace plow
