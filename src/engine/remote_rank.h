// A tensor-parallel rank in another process (issue F: `plow serve --tp N --backend cuda` runs one
// process per GPU). In the server the rank is a RemoteRankBackend, a Backend that forwards every call
// over a Unix socket (frames of engine/rank_wire) and returns the rank's reply; in the rank's process
// serve_rank answers those calls from the rank's own backend. TensorParallelBackend drives proxies and
// in-process ranks alike. A rank that dies or answers nonsense is a plow::Error naming the rank, never
// a wait on a socket that will not answer.
#pragma once

#include <nlohmann/json.hpp>

#include <sys/types.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/backend.h"

namespace plow {

class RemoteRankBackend : public Backend {
 public:
  // `fd`: this end of the rank's socket (owned from here on). `pid`: the rank's process (the
  // destructor reaps it), or 0 when a thread of this process serves the rank (tests).
  RemoteRankBackend(int rank, int fd, pid_t pid);
  // Starts argv(fd) (argv[0]: the executable's path; fd: the child's end of a new socket) as rank
  // `rank`'s process. The child is killed when the thread that calls spawn exits (PR_SET_PDEATHSIG:
  // call it from the thread that lives as long as the server), ignores SIGINT (Ctrl-C drains the
  // server, which then closes the socket) and exits when the socket closes.
  static std::unique_ptr<RemoteRankBackend> spawn(int rank, const std::function<std::vector<std::string>(int fd)>& argv);
  // Closes the socket (the rank's serve_rank returns), then waits up to 10 s for the process to exit
  // before killing it; a rank that never became ready, or answered nonsense, is killed at once.
  ~RemoteRankBackend() override;
  RemoteRankBackend(const RemoteRankBackend&) = delete;
  RemoteRankBackend& operator=(const RemoteRankBackend&) = delete;

  // Reads the rank's next start-up message, which must be `stage`: a worker announces what it is
  // about to do ("joining": the NCCL group, whose join blocks until every rank calls it), and
  // serve_rank starts with "ready" (slots, activation dtype, snapshots), needed before any call.
  void await(std::string_view stage);
  // Asks the rank to abort its collectives: its step in flight fails instead of waiting for a peer
  // that will not come. Any thread, also while another thread waits for this rank's reply.
  void abort_rank();
  pid_t pid() const { return pid_; }

  StepOutput step(const StepInputs& inputs) override;
  void reset_slot(int slot) override;
  int64_t context_tokens(int slot) const override;
  int num_slots() const override;
  DType act_dtype() const override;
  bool has_snapshots() const override;
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override;
  void restore_slot(int slot, const SlotSnapshot& snapshot) override;

 private:
  // One request and its reply, with call_mutex_ held (by the caller, which decodes the reply under
  // it). The rank's error reply is rethrown as plow::Error naming the rank; end of file or a malformed
  // frame breaks the proxy (every later call fails the same way).
  nlohmann::json call(const nlohmann::json& request, std::string_view what) const;
  [[noreturn]] void broken(std::string message) const;
  std::string who() const;        // "tensor-parallel rank 1 (pid 4242)"
  std::string exit_status() const;  // how the process ended ("exit status 3", "killed by signal 9")

  int rank_ = 0;
  int fd_ = -1;
  pid_t pid_ = 0;
  mutable bool reaped_ = false;
  int slots_ = 0;
  DType act_ = DType::F32;
  bool snapshots_ = false;
  bool ready_ = false;
  mutable std::mutex call_mutex_;   // one request in flight; guards broken_ and reaped_
  mutable std::mutex write_mutex_;  // a request's frame and an abort's do not interleave
  mutable std::string broken_;      // set once: the failure every later call repeats
};

// The rank's side. A worker process reports what it is about to do (announce_rank_stage) or why it
// could not start (report_rank_failure), then serve_rank answers the server until it closes the
// socket: it sends "ready", then one reply per request, in order. `abort` is called from another
// thread when the server asks for it or closes the socket during a request; it must make a step
// that waits in a collective fail (ncclCommAbort, LocalGroup::abort).
void announce_rank_stage(int fd, std::string_view stage);
void report_rank_failure(int fd, std::string_view message);
void serve_rank(int fd, Backend& backend, const std::function<void()>& abort);

}  // namespace plow
