// Progress marks written by a background thread, at most once per interval ([Note: progress marks]).
#include "c10d/progress_publisher.h"

#include <utility>

namespace fsdp::detail {

ProgressPublisher::ProgressPublisher(c10::intrusive_ptr<c10d::Store> store, std::string key)
    : store_(std::move(store)), key_(std::move(key)) {}

ProgressPublisher::~ProgressPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void ProgressPublisher::publish(uint64_t value) {
  // Monotonic: a late caller with an older number never moves the mark back.
  uint64_t seen = latest_.load();
  while (value > seen && !latest_.compare_exchange_weak(seen, value)) {
  }
  if (value <= seen) return;
  std::call_once(started_, [this] { thread_ = std::thread([this] { run(); }); });
  // Sequentially consistent with the thread's `idle_ = true; read latest_`: either it sees the new value
  // or this sees it idle and wakes it.
  if (idle_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    wake_.notify_one();
  }
}

bool ProgressPublisher::flush(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  ++flushing_;
  wake_.notify_one();
  const bool ok = written_.wait_for(lock, timeout, [&] { return broken_ || published_ >= latest_.load(); });
  --flushing_;
  return ok && !broken_;
}

void ProgressPublisher::run() {
  std::unique_lock<std::mutex> lock(mu_);
  auto behind = [&] { return published_ < latest_.load(); };
  bool just_wrote = false;
  while (true) {
    if (just_wrote) {
      // The interval between writes: collectives meanwhile only move latest_ (no wake-up), unless a flush or
      // the destructor asks for the latest mark now.
      wake_.wait_for(lock, kInterval, [&] { return stop_ || (flushing_ > 0 && behind()); });
    }
    idle_.store(true);
    wake_.wait(lock, [&] { return stop_ || behind(); });
    idle_.store(false);
    if (!behind()) break;  // stopping with nothing left to write
    const uint64_t value = latest_.load();
    lock.unlock();
    bool ok = true;
    try {
      store_->set(key_, std::to_string(value));
    } catch (...) {
      ok = false;  // the store is gone (e.g. its host exited): the marks only serve diagnostics
    }
    lock.lock();
    if (ok) {
      published_ = value;
    } else {
      broken_ = true;
    }
    written_.notify_all();
    if (broken_) break;
    just_wrote = true;
  }
}

}  // namespace fsdp::detail
