// Publication of a rank's collective progress in the store, off the collective's path (issue 16, part 3).
//
// Every collective marks in the store that this rank reached it ("fsdp_progress/<group>/<rank>" = seq + 1),
// so that a rank whose collective failed (a timeout) can name the ranks that never reached it
// (ProcessGroup::lagging_ranks). Done inline, that mark is a store round trip (TCP to the store's host) on
// every collective: on tiny models the largest part of the collectives layer's own cost. Here the
// collective only records the number and wakes a background thread, which writes the latest number to the
// store (coalescing marks that arrive while a write is in flight). A failure is diagnosed only after the
// group timeout, by which time every live rank's thread has written its mark; lagging_ranks() first
// flushes this rank's own.
//
// No PyTorch counterpart: c10d keeps no such marks (its NCCL watchdog dumps per-rank traces instead).
#pragma once

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
  /// Writes to `key` of `store` (the store is shared, c10d stores are thread-safe).
  ProgressPublisher(c10::intrusive_ptr<c10d::Store> store, std::string key);
  /// Stops the thread after it wrote the latest mark (or gave up on the store).
  ~ProgressPublisher();
  ProgressPublisher(const ProgressPublisher&) = delete;
  ProgressPublisher& operator=(const ProgressPublisher&) = delete;

  /// Records `value` as this rank's progress (written soon, asynchronously). Cheap: a lock and a wake-up.
  void publish(uint64_t value);
  /// Waits up to `timeout` until the latest value is in the store. Returns whether it is.
  bool flush(std::chrono::milliseconds timeout);

 private:
  void run();

  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  std::mutex mu_;
  std::condition_variable wake_, written_;
  uint64_t latest_ = 0, published_ = 0;
  bool stop_ = false, broken_ = false;  // broken: the store failed, nothing more is written
  std::thread thread_;                  // started on the first publish
};

}  // namespace fsdp::detail
