// Runs N ranks as threads in one process: an in-memory c10d::HashStore and one Gloo group per rank.
// Each rank's thread gets its group as its thread default (fsdp::default_process_group()).
//
// No hang: if the ranks are not all done within `timeout`, the harness prints which ranks are stuck
// and terminates the process with a failure (a stuck thread cannot be cancelled), so ctest reports
// the test as failed instead of waiting for its own, longer timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fsdp/distributed.h"

namespace fsdp::testing {

/// Runs fn(group) on `world` threads. Returns the error message of each rank: "" when it succeeded,
/// never "" when it threw (an exception with an empty message is reported as such).
/// `collective_timeout` bounds every collective (so a mismatch fails instead of hanging).
inline std::vector<std::string> run_ranks_collect(int world, const std::function<void(ProcessGroupPtr)>& fn,
                                                  std::chrono::seconds timeout = std::chrono::seconds(90),
                                                  std::chrono::milliseconds collective_timeout =
                                                      std::chrono::seconds(30)) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(collective_timeout);
  std::vector<std::string> errors(world);
  std::vector<char> done(world, 0);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::string err;
      try {
        auto group = make_gloo_group(store, r, world, collective_timeout);
        set_thread_default_process_group(group);
        fn(group);
      } catch (const c10::Error& e) {
        err = e.what_without_backtrace();
        // "" means success to the callers: a failure must never read as one, whatever its message.
        if (err.empty()) err = "c10::Error with an empty message";
      } catch (const std::exception& e) {
        err = e.what();
        if (err.empty()) err = "exception with an empty message";
      } catch (...) {
        err = "exception of a type that is not std::exception";
      }
      set_thread_default_process_group(nullptr);
      std::lock_guard<std::mutex> lock(mu);
      errors[r] = err;
      done[r] = 1;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    bool all = cv.wait_for(lock, timeout, [&] {
      for (char d : done)
        if (!d) return false;
      return true;
    });
    if (!all) {
      std::cerr << "multi_rank: ranks still running after " << timeout.count() << " s:";
      for (int r = 0; r < world; ++r)
        if (!done[r]) std::cerr << " " << r;
      std::cerr << " -- failing the test instead of hanging" << std::endl;
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// Runs fn on `world` ranks and fails the current test with every rank's error, if any.
inline void run_ranks(int world, const std::function<void(ProcessGroupPtr)>& fn,
                      std::chrono::seconds timeout = std::chrono::seconds(90)) {
  auto errors = run_ranks_collect(world, fn, timeout);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r << " of " << world << " failed";
  }
}

}  // namespace fsdp::testing
