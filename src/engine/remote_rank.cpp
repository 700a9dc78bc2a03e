#include "engine/remote_rank.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "engine/rank_wire.h"

namespace plow {

using rank_wire::json;

namespace {

// Waits up to `limit` for `pid` to exit; its wait status, or nullopt when it is still running.
std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return status;
    if (done < 0) return -1;  // not our child any more (reaped elsewhere)
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string describe_status(int status) {
  if (status == -1) return "reaped elsewhere";
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return fmt::format("wait status {}", status);
}

}  // namespace

RemoteRankBackend::RemoteRankBackend(int rank, int fd, pid_t pid) : rank_(rank), fd_(fd), pid_(pid) {}

std::unique_ptr<RemoteRankBackend> RemoteRankBackend::spawn(int rank, const std::function<std::vector<std::string>(int fd)>& make_argv) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) fail("tensor-parallel rank {}: cannot create its socket: {}", rank, std::strerror(errno));
  std::vector<std::string> args = make_argv(fds[1]);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    fail("tensor-parallel rank {}: cannot start its process: {}", rank, std::strerror(errno));
  }
  if (pid == 0) {  // async-signal-safe calls only until exec: the server may have other threads
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the server died before the line above
    fcntl(fds[1], F_SETFD, 0);           // this end survives exec; the server's end (CLOEXEC) does not
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);  // the server blocks SIGTERM/SIGINT for its waiter thread
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGINT, &ignore, nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  return std::make_unique<RemoteRankBackend>(rank, fds[0], pid);
}

RemoteRankBackend::~RemoteRankBackend() {
  close(fd_);
  if (pid_ <= 0 || reaped_) return;
  // A serving rank exits when its socket closes; one that never got that far, or answered nonsense, is stopped.
  if (!ready_ || !broken_.empty()) kill(pid_, SIGKILL);
  if (!wait_exit(pid_, std::chrono::seconds(10))) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

std::string RemoteRankBackend::who() const {
  return pid_ > 0 ? fmt::format("tensor-parallel rank {} (pid {})", rank_, pid_) : fmt::format("tensor-parallel rank {}", rank_);
}

std::string RemoteRankBackend::exit_status() const {
  if (pid_ <= 0) return "it closed its socket";
  if (reaped_) return "it had exited";
  // The socket closes as the process exits: give the kernel a moment to make it a zombie.
  const std::optional<int> status = wait_exit(pid_, std::chrono::seconds(2));
  if (!status) return "it closed its socket and is still running";
  reaped_ = true;
  return describe_status(*status);
}

void RemoteRankBackend::broken(std::string message) const {
  broken_ = std::move(message);
  throw Error(broken_);
}

void RemoteRankBackend::await(std::string_view stage) {
  const std::lock_guard lock(call_mutex_);
  if (!broken_.empty()) throw Error(broken_);
  std::optional<json> message;
  try {
    message = rank_wire::read_frame(fd_);
  } catch (const Error& e) {
    broken(fmt::format("{}: while starting: {}", who(), e.what()));
  }
  if (!message) broken(fmt::format("{} exited while starting (before '{}'): {}", who(), stage, exit_status()));
  if (const auto error = message->find("error"); error != message->end()) {
    broken(fmt::format("{} failed to start: {}", who(), error->is_string() ? error->get<std::string>() : error->dump()));
  }
  try {
    const json& got = rank_wire::field(*message, "stage");
    if (!got.is_string() || got.get<std::string>() != stage) fail("expected the stage '{}', found {}", stage, got.dump());
    if (stage == "ready") {
      slots_ = static_cast<int>(rank_wire::int_field(*message, "slots"));
      const json& act = rank_wire::field(*message, "act_dtype");
      const std::optional<DType> dtype = act.is_string() ? dtype_from_safetensors(act.get<std::string>()) : std::nullopt;
      if (!dtype) fail("field 'act_dtype': {} is not a dtype", act.dump());
      act_ = *dtype;
      const json& snapshots = rank_wire::field(*message, "snapshots");
      if (!snapshots.is_boolean()) fail("field 'snapshots': expected a boolean, found {}", snapshots.type_name());
      snapshots_ = snapshots.get<bool>();
      ready_ = true;
    }
  } catch (const Error& e) {
    broken(fmt::format("{}: a malformed start-up message: {}", who(), e.what()));
  }
}

void RemoteRankBackend::abort_rank() {
  const std::lock_guard lock(write_mutex_);
  rank_wire::write_frame(fd_, {{"op", "abort"}});  // a rank that is gone has nothing to abort
}

json RemoteRankBackend::call(const json& request, std::string_view what) const {
  if (!broken_.empty()) throw Error(broken_);
  PLOW_CHECK(ready_, "{}: {} before the rank was ready", who(), what);
  bool sent = false;
  {
    const std::lock_guard write(write_mutex_);
    sent = rank_wire::write_frame(fd_, request);
  }
  std::optional<json> reply;
  try {
    if (sent) reply = rank_wire::read_frame(fd_);
  } catch (const Error& e) {
    broken(fmt::format("{}: a malformed reply to {}: {}", who(), what, e.what()));
  }
  if (!reply) broken(fmt::format("{} exited: {} (during {})", who(), exit_status(), what));
  if (const auto error = reply->find("error"); error != reply->end()) {
    throw Error(fmt::format("tensor-parallel rank {}: {}", rank_, error->is_string() ? error->get<std::string>() : error->dump()));
  }
  return std::move(*reply);
}

StepOutput RemoteRankBackend::step(const StepInputs& inputs) {
  const std::lock_guard lock(call_mutex_);
  const json reply = call(rank_wire::encode_step(inputs), "step");
  try {
    return rank_wire::decode_output(reply);
  } catch (const Error& e) {
    broken(fmt::format("{}: a malformed reply to step: {}", who(), e.what()));
  }
}

void RemoteRankBackend::reset_slot(int slot) {
  const std::lock_guard lock(call_mutex_);
  call({{"op", "reset"}, {"slot", slot}}, "reset_slot");
}

int64_t RemoteRankBackend::context_tokens(int slot) const {
  const std::lock_guard lock(call_mutex_);
  const json reply = call({{"op", "context"}, {"slot", slot}}, "context_tokens");
  try {
    return rank_wire::int_field(reply, "tokens");
  } catch (const Error& e) {
    broken(fmt::format("{}: a malformed reply to context_tokens: {}", who(), e.what()));
  }
}

int RemoteRankBackend::num_slots() const {
  PLOW_CHECK(ready_, "{}: num_slots before the rank was ready", who());
  return slots_;
}

DType RemoteRankBackend::act_dtype() const {
  PLOW_CHECK(ready_, "{}: act_dtype before the rank was ready", who());
  return act_;
}

bool RemoteRankBackend::has_snapshots() const { return ready_ && snapshots_; }

SlotSnapshot RemoteRankBackend::save_slot(int slot, int64_t rows_begin) const {
  const std::lock_guard lock(call_mutex_);
  const json reply = call({{"op", "save"}, {"slot", slot}, {"rows_begin", rows_begin}}, "save_slot");
  try {
    return rank_wire::decode_snapshot(reply);
  } catch (const Error& e) {
    broken(fmt::format("{}: a malformed reply to save_slot: {}", who(), e.what()));
  }
}

void RemoteRankBackend::restore_slot(int slot, const SlotSnapshot& snapshot) {
  const std::lock_guard lock(call_mutex_);
  call({{"op", "restore"}, {"slot", slot}, {"snapshot", rank_wire::encode_snapshot(snapshot)}}, "restore_slot");
}

}  // namespace plow
