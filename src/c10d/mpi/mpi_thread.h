// The MPI thread of the "mpi" backend (internal; MPI builds only, see process_group_mpi.h for the design):
// the one thread that initialises MPI, makes every MPI call of the process and finalizes MPI at exit, and
// MpiWork, the c10d::Work its collectives complete.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fsdp::detail {

// Initialises MPI, then runs every MPI call of the process in the order they were posted. One thread
// makes MPI's thread level a non-issue (SERIALIZED is requested, FUNNELED would do) and keeps collectives
// of all groups in the order the program issued them, which is the same on every rank (libfsdp's
// contract). Point-to-point requests are non-blocking and polled between jobs, so a send waiting for its
// receive never blocks the collectives behind it.
class MpiThread {
 public:
  // Started on first use; never destroyed (its thread outlives static destruction; see at_exit()).
  static MpiThread& get();
  static bool started() { return started_.load(); }

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int provided() const { return provided_; }
  bool finalized() const { return finalized_.load(); }

  // Runs `job` on the MPI thread later (in posting order).
  void post(std::function<void()> job);

  // Runs `fn` on the MPI thread and returns its result (rethrows its exception).
  template <typename F>
  auto call(F fn) -> decltype(fn()) {
    using R = decltype(fn());
    auto p = std::make_shared<std::promise<R>>();
    auto fut = p->get_future();
    post([p, fn = std::move(fn)]() mutable {
      try {
        if constexpr (std::is_void_v<R>) {
          fn();
          p->set_value();
        } else {
          p->set_value(fn());
        }
      } catch (...) {
        p->set_exception(std::current_exception());
      }
    });
    return fut.get();
  }

  // A pending non-blocking request and what to do when it completes (on the MPI thread).
  struct Pending {
    MPI_Request request;
    std::function<void(int rc, const MPI_Status&)> done;
  };
  // Only from the MPI thread.
  void add_pending(Pending p) { pending_.push_back(std::move(p)); }

  // FSDP_MPI_SPIN_US (default 50): how long the MPI thread spins on pending requests before it sleeps.
  static std::chrono::microseconds spin_us();

  // Waits for `req` on the MPI thread without taking a core from the compute threads; returns MPI's code.
  // MPI's blocking collectives spin until every peer has arrived; with FSDP's prefetching the MPI thread
  // often waits while this rank (or the peer) computes, and spinning there took a core from the compute
  // threads (GPT "small" on 2 cores: 1.7x Gloo's step time; docs/BENCHMARKS.md). So: spin spin_us(),
  // which covers a peer that is already there, then test with sleeps doubling from 20 us up to 500 us
  // (MPI_Test also drives the collective's progress).
  static int wait_request(MPI_Request* req);

 private:
  MpiThread();
  void init();
  void loop();
  int poll();
  static void at_exit();
  bool exit_barrier(std::chrono::steady_clock::time_point deadline);

  static inline std::atomic<bool> started_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<Pending> pending_;  // MPI thread only
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_mpi_ = true;
  int world_rank_ = 0;
  int world_size_ = 1;
  MPI_Comm exit_comm_ = MPI_COMM_NULL;
  std::atomic<bool> finalized_{false};
};

// Completes on the MPI thread; wait() applies the group's timeout (PyTorch's Gloo does the same per
// collective), so a rank missing from a collective is an error, not a hang.
class MpiWork : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, std::string desc, std::vector<at::Tensor> outputs,
          std::chrono::milliseconds timeout);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // On the MPI thread: runs `fn`, then completes (with its error, if any).
  void run(const std::function<void()>& fn);
  void complete(std::exception_ptr error);
  const std::string& desc() const { return desc_; }
  int source_rank = -1;
  int sourceRank() const override { return source_rank; }

 private:
  std::string desc_;
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace fsdp::detail
