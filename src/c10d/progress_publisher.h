// Publication of a rank's collective progress in the store, off the collective's path (issue 16, part 3;
// rate-limited in issue 37).
//
// [Note: progress marks]
// Every collective marks in the store that this rank reached it ("fsdp_progress/<group>/<rank>" = seq + 1),
// so that a rank whose collective failed (a timeout) can name the ranks that never reached it
// (ProcessGroup::lagging_ranks). Done inline, that mark is a store round trip (TCP to the store's host) on
// every collective. Done by a background thread woken at every collective, it still cost each collective a
// wake-up of that thread, a TCP send and the store server's wake-up, on the CPUs the ranks compute on:
// 30-110 us of a one-host all-reduce of 8 floats that takes 16-20 us without it (issue 37, measured with
// collectives back to back on 2 ranks). So the thread writes at most once per kInterval: a collective only
// stores its number in an atomic (and wakes the thread when it is idle, i.e. after a quiet spell); the thread
// writes the latest number, waits kInterval, and writes again if it moved. A rank's mark is therefore at most
// kInterval (plus a store round trip) behind it. Failures are diagnosed after the group timeout (seconds), or
// at once when a peer died or disagreed; lagging_ranks() flushes this rank's own mark and first waits
// kSettle so that a live peer's mark has caught up before it is read.
//
// No PyTorch counterpart: c10d keeps no such marks (its NCCL watchdog dumps per-rank traces instead).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp::detail {

class ProgressPublisher {
 public:
  /// The shortest time between two writes of one rank's mark.
  static constexpr std::chrono::milliseconds kInterval{20};
  /// How long a reader of the marks waits for its peers' latest marks to arrive (two intervals).
  static constexpr std::chrono::milliseconds kSettle{2 * kInterval};

  /// Writes to `key` of `store` (the store is shared, c10d stores are thread-safe).
  ProgressPublisher(c10::intrusive_ptr<c10d::Store> store, std::string key);
  /// Stops the thread after it wrote the latest mark (or gave up on the store).
  ~ProgressPublisher();
  ProgressPublisher(const ProgressPublisher&) = delete;
  ProgressPublisher& operator=(const ProgressPublisher&) = delete;

  /// Records `value` as this rank's progress (written within kInterval, asynchronously). Cheap: an atomic
  /// store, plus a lock and a wake-up when the thread is idle.
  void publish(uint64_t value);
  /// Waits up to `timeout` until the latest value is in the store (writing it at once). Returns whether it is.
  bool flush(std::chrono::milliseconds timeout);

 private:
  void run();

  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  std::atomic<uint64_t> latest_{0};
  std::atomic<bool> idle_{false};  // the thread waits for a new value without a deadline: publish wakes it
  std::mutex mu_;
  std::condition_variable wake_, written_;
  uint64_t published_ = 0;                             // under mu_
  bool stop_ = false, broken_ = false;  // under mu_; broken: the store failed, nothing more is written
  int flushing_ = 0;                    // under mu_: callers in flush()
  std::thread thread_;                                 // started on the first publish
  std::once_flag started_;
};

}  // namespace fsdp::detail
