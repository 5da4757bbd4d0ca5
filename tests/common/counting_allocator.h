// A CPU allocator for tests that counts the bytes each rank thread holds: per-rank live bytes and their
// peak when ranks are threads (multi_rank.h). Installed with c10::SetCPUAllocator; a thread is counted
// once it sets CountingAllocator::current() to its Counter, and a free is credited to the thread that
// allocated the block, whichever thread frees it.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace fsdp::testing {

struct CountingAllocator final : c10::Allocator {
  struct Counter {
    std::atomic<int64_t> now{0}, peak{0};
    /// Starts a new peak from what is alive now (e.g. after the first training step).
    void reset_peak() { peak = now.load(); }
  };
  /// The calling thread's counter (nullptr: not counted).
  static Counter*& current() {
    thread_local Counter* c = nullptr;
    return c;
  }
  // The context is the data pointer itself (a "simple" DataPtr, as the default CPU allocator's): some
  // kernels (oneDNN's bf16 paths) take memory through raw_allocate, which requires it. Sizes and
  // counters are kept in a side table.
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n == 0 ? 1 : n);
    Counter* counter = current();
    {
      std::lock_guard<std::mutex> lock(table_mutex());
      table()[p] = {n, counter};
    }
    if (counter) {
      const int64_t v = counter->now += static_cast<int64_t>(n);
      int64_t old = counter->peak.load();
      while (v > old && !counter->peak.compare_exchange_weak(old, v)) {
      }
    }
    return {p, p, &deallocate, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deallocate; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  struct Entry {
    size_t n;
    Counter* counter;
  };
  static std::mutex& table_mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<void*, Entry>& table() {
    static auto* t = new std::unordered_map<void*, Entry>();  // never destroyed: frees may come at exit
    return *t;
  }
  static void deallocate(void* p) {
    if (p == nullptr) return;
    Entry e{0, nullptr};
    {
      std::lock_guard<std::mutex> lock(table_mutex());
      auto it = table().find(p);
      if (it != table().end()) {
        e = it->second;
        table().erase(it);
      }
    }
    if (e.counter) e.counter->now -= static_cast<int64_t>(e.n);
    c10::free_cpu(p);
  }
};

/// Installs `counting` as LibTorch's CPU allocator for the scope. c10 ignores a SetCPUAllocator whose
/// priority is below the current one's, so each install and restore takes a higher priority than the last
/// (several tests in one process).
struct UseCountingAllocator {
  explicit UseCountingAllocator(CountingAllocator& counting) : previous(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(&counting, ++priority());
  }
  ~UseCountingAllocator() { c10::SetCPUAllocator(previous, ++priority()); }
  UseCountingAllocator(const UseCountingAllocator&) = delete;
  UseCountingAllocator& operator=(const UseCountingAllocator&) = delete;
  static uint8_t& priority() {
    static uint8_t p = 100;
    return p;
  }
  c10::Allocator* previous;
};

}  // namespace fsdp::testing
