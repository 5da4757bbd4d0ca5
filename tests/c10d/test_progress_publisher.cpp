// Progress marks ([Note: progress marks] in src/c10d/progress_publisher.h): the latest number reaches the
// store within an interval, at most one write per interval however many collectives run, flush writes at
// once, a late caller never moves the mark back, the destructor writes the last one, and a failing store
// neither throws nor hangs (CTest label: join_debug).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "c10d/progress_publisher.h"

namespace fsdp::testing {
namespace {

using detail::ProgressPublisher;

// A store that counts its writes (and can be made to fail them).
class CountingStore : public c10d::HashStore {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& data) override {
    ++sets;
    if (fail) throw std::runtime_error("the store is gone");
    c10d::HashStore::set(key, data);
  }
  std::string value(const std::string& key) {
    auto v = get(key);
    return std::string(v.begin(), v.end());
  }
  std::atomic<int> sets{0};
  std::atomic<bool> fail{false};
};

TEST(ProgressMarks, ManyCollectivesAreOneWritePerInterval) {
  auto store = c10::make_intrusive<CountingStore>();
  ProgressPublisher pub(store, "mark");
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t v = 1; v <= 20000; ++v) pub.publish(v);
  const auto busy = std::chrono::steady_clock::now() - t0;
  // The latest mark arrives within an interval or two (a loaded machine may take longer: polled, up to 10 s).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!(store->check({"mark"}) && store->value("mark") == "20000") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(store->value("mark"), "20000");
  // One write when the first mark arrives, then at most one per interval (plus the trailing one), counted
  // over the whole time so far (a loaded machine oversleeps).
  const int sets = store->sets.load();
  const auto intervals = (std::chrono::steady_clock::now() - t0) / ProgressPublisher::kInterval;
  EXPECT_LE(sets, intervals + 2) << "busy for " << std::chrono::duration<double, std::milli>(busy).count() << " ms";
  EXPECT_GE(sets, 1);
}

TEST(ProgressMarks, FlushWritesTheLatestAtOnce) {
  auto store = c10::make_intrusive<CountingStore>();
  ProgressPublisher pub(store, "mark");
  pub.publish(1);
  ASSERT_TRUE(pub.flush(std::chrono::seconds(5)));
  EXPECT_EQ(store->value("mark"), "1");
  // Right after a write the thread waits an interval; a flush cuts that wait short.
  pub.publish(2);
  pub.publish(7);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(pub.flush(std::chrono::seconds(5)));
  EXPECT_EQ(store->value("mark"), "7");
  // Only that the flush returns promptly (the bound is 100 intervals, for loaded machines).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  // A late caller with an older number never moves the mark back.
  pub.publish(3);
  ASSERT_TRUE(pub.flush(std::chrono::seconds(5)));
  EXPECT_EQ(store->value("mark"), "7");
}

TEST(ProgressMarks, TheDestructorWritesTheLastMark) {
  auto store = c10::make_intrusive<CountingStore>();
  {
    ProgressPublisher pub(store, "mark");
    for (uint64_t v = 1; v <= 1000; ++v) pub.publish(v);
  }
  EXPECT_EQ(store->value("mark"), "1000");
  // Nothing published: no thread, no write.
  { ProgressPublisher idle(store, "other"); }
  EXPECT_FALSE(store->check({"other"}));
}

TEST(ProgressMarks, AFailingStoreNeitherThrowsNorHangs) {
  auto store = c10::make_intrusive<CountingStore>();
  store->fail = true;
  ProgressPublisher pub(store, "mark");
  pub.publish(1);
  EXPECT_FALSE(pub.flush(std::chrono::seconds(5)));
  for (uint64_t v = 2; v <= 100; ++v) pub.publish(v);  // nothing more is written
  EXPECT_FALSE(pub.flush(std::chrono::seconds(5)));
  EXPECT_EQ(store->sets.load(), 1);
}

}  // namespace
}  // namespace fsdp::testing
