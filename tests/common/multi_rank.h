// Runs N ranks as threads in one process: an in-memory c10d::HashStore and one Gloo group per rank.
// Each rank's thread gets its group as its thread default (fsdp::default_process_group()).
//
// No hang: if the ranks are not all done within `timeout`, the harness prints which ranks are stuck
// and terminates the process with a failure (a stuck thread cannot be cancelled), so ctest reports
// the test as failed instead of waiting for its own, longer timeout.
//
// The groups' rendezvous is retried (up to kRendezvousAttempts): on a loaded machine Gloo's full-mesh
// connect between two threads of this process has failed once with "Connection closed by peer" while
// other processes made Gloo meshes at the same time. Every rank takes part in each attempt, an attempt in
// which any rank failed is dropped by all of them, and the next uses a fresh store prefix. Only the
// harness's own rendezvous is retried, never what a test runs.
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

#include "fsdp/c10d/distributed.h"

namespace fsdp::testing {

constexpr int kRendezvousAttempts = 3;

/// Harness self-test hook: the next this-many group creations in run_ranks_collect throw (one per
/// attempt, on the highest rank), as a spurious Gloo rendezvous failure would.
inline std::atomic<int>& injected_rendezvous_failures() {
  static std::atomic<int> n{0};
  return n;
}

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
  // Rendezvous attempts: arrived[a] ranks have finished attempt a, failed[a] if any of them failed.
  std::vector<int> arrived(kRendezvousAttempts, 0);
  std::vector<char> failed(kRendezvousAttempts, 0);
  auto make_group = [&](int r) {
    for (int a = 0;; ++a) {
      ProcessGroupPtr group;
      std::string why;
      try {
        auto prefixed = c10::make_intrusive<c10d::PrefixStore>("attempt" + std::to_string(a), store);
        group = make_gloo_group(prefixed, r, world, collective_timeout);
        // After the group is made, so that the other ranks are not left waiting for this one's connect.
        if (r == world - 1 && injected_rendezvous_failures() > 0 && injected_rendezvous_failures()-- > 0) {
          throw std::runtime_error("injected rendezvous failure");
        }
      } catch (const std::exception& e) {
        why = e.what();
      }
      std::unique_lock<std::mutex> lock(mu);
      if (!why.empty()) failed[a] = 1;
      ++arrived[a];
      cv.notify_all();
      cv.wait(lock, [&] { return arrived[a] == world; });
      if (!failed[a]) return group;
      if (a + 1 == kRendezvousAttempts) {
        throw std::runtime_error("multi_rank: the groups' rendezvous failed " + std::to_string(kRendezvousAttempts) +
                                 " times" + (why.empty() ? std::string(" (on another rank)") : ": " + why));
      }
    }
  };
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::string err;
      try {
        auto group = make_group(r);
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
