// The rank's end of engine/remote_rank: a reader thread takes frames off the socket (so that an abort
// reaches the rank while its main thread waits in a collective) and queues requests; the calling
// thread runs them on the backend in order and writes one reply each.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <sys/socket.h>
#include <unistd.h>

#include "core/error.h"
#include "engine/rank_wire.h"
#include "engine/remote_rank.h"

namespace plow {

using rank_wire::json;

namespace {

int slot_field(const json& message) {
  const int64_t slot = rank_wire::int_field(message, "slot");
  if (slot < 0 || slot > (int64_t{1} << 30)) fail("field 'slot': {} is not a slot", slot);
  return static_cast<int>(slot);
}

// One request on the backend; a failure (the backend's or the request's) is the reply {"error": …}.
json answer(Backend& backend, const json& request) {
  try {
    const json& op = rank_wire::field(request, "op");
    const std::string name = op.is_string() ? op.get<std::string>() : op.dump();
    if (name == "step") return rank_wire::encode_output(backend.step(rank_wire::decode_step(request)));
    if (name == "reset") {
      backend.reset_slot(slot_field(request));
      return {{"ok", true}};
    }
    if (name == "context") return {{"tokens", backend.context_tokens(slot_field(request))}};
    if (name == "save") return rank_wire::encode_snapshot(backend.save_slot(slot_field(request), rank_wire::int_field(request, "rows_begin")));
    if (name == "restore") {
      backend.restore_slot(slot_field(request), rank_wire::decode_snapshot(rank_wire::field(request, "snapshot")));
      return {{"ok", true}};
    }
    fail("an unknown request '{}'", name);
  } catch (const std::exception& e) {
    return {{"error", e.what()}};
  }
}

}  // namespace

void announce_rank_stage(int fd, std::string_view stage) { rank_wire::write_frame(fd, {{"stage", stage}}); }

void report_rank_failure(int fd, std::string_view message) { rank_wire::write_frame(fd, {{"error", message}}); }

void serve_rank(int fd, Backend& backend, const std::function<void()>& abort) {
  const json ready = {{"stage", "ready"}, {"slots", backend.num_slots()}, {"act_dtype", dtype_name(backend.act_dtype())},
                      {"snapshots", backend.has_snapshots()}};
  if (!rank_wire::write_frame(fd, ready)) return;
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<json> requests;
  bool closed = false, busy = false;
  std::optional<std::string> malformed;  // the reader's last word: the stream cannot be trusted after it
  std::thread reader([&] {
    for (;;) {
      std::optional<json> message;
      try {
        message = rank_wire::read_frame(fd);
      } catch (const Error& e) {
        const std::lock_guard lock(mutex);
        malformed = e.what();
        closed = true;
        cv.notify_all();
        return;
      }
      std::unique_lock lock(mutex);
      const bool abort_now = !message ? busy : message->value("op", json()) == "abort";
      if (!message) closed = true;
      if (!abort_now && message) requests.push_back(std::move(*message));
      cv.notify_all();
      lock.unlock();
      if (abort_now) abort();  // a step waiting for a peer fails now; the server gets its error
      if (!message) return;
    }
  });
  for (;;) {
    json request;
    {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return !requests.empty() || closed; });
      if (requests.empty()) {
        // A malformed request still gets an answer: the server is waiting for one.
        if (malformed) rank_wire::write_frame(fd, {{"error", fmt::format("a malformed request: {}", *malformed)}});
        break;
      }
      request = std::move(requests.front());
      requests.pop_front();
      busy = true;
    }
    const json reply = answer(backend, request);
    {
      const std::lock_guard lock(mutex);
      busy = false;
    }
    if (!rank_wire::write_frame(fd, reply)) break;
  }
  shutdown(fd, SHUT_RDWR);  // wakes the reader if the server still holds its end
  reader.join();
}

}  // namespace plow
