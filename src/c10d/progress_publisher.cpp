// Progress marks written by a background thread (see progress_publisher.h).
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (value <= latest_) return;
    latest_ = value;
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
}

bool ProgressPublisher::flush(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return written_.wait_for(lock, timeout, [&] { return broken_ || published_ >= latest_; }) && !broken_;
}

void ProgressPublisher::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || published_ < latest_; });
    if (published_ >= latest_ || broken_) break;  // stopping with nothing left to write
    const uint64_t value = latest_;
    lock.unlock();
    bool ok = true;
    try {
      store_->set(key_, std::to_string(value));
    } catch (...) {
      ok = false;  // the store is gone (e.g. its host exited): the marks only serve diagnostics
    }
    lock.lock();
    if (!ok) broken_ = true;
    published_ = ok ? value : published_;
    written_.notify_all();
    if (broken_) break;
  }
}

}  // namespace fsdp::detail
