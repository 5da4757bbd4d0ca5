// The cooperative prefetch of a resharded load ([Note: one reader per file region],
// src/checkpoint/cooperative_prefetch.cpp): one reader per file, the other ranks following behind it;
// a reader that stops or cannot read never holds the others; and a resharded load whose bytes are bad
// fails on every rank without a wait. Ranks are threads over Gloo (common/multi_rank.h).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/cooperative_prefetch.h"
#include "checkpoint/safetensors.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using dcp::detail::CooperativePrefetch;
using dcp::detail::FileRanges;
constexpr int64_t kPiece = CooperativePrefetch::kPiece;

/// A file of `bytes` bytes, written, fsynced and dropped from the page cache.
std::string cold_file(const std::string& dir, int64_t bytes) {
  const auto path = dir + "/data.bin";
  {
    auto f = dcp::detail::File::create(path, "test");
    std::vector<char> buf(static_cast<size_t>(bytes), 'x');
    f.write_all(buf.data(), buf.size(), "test");
    f.fsync();
    f.drop_cache();
  }
  return path;
}

/// Whether every page of [begin, end) of `path` is in the page cache (mincore).
bool resident(const std::string& path, int64_t begin, int64_t end) {
  auto f = dcp::detail::File::open_read(path, "test");
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const int64_t b = begin / page * page;
  const size_t len = static_cast<size_t>(end - b);
  void* map = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, f.fd(), b);
  if (map == MAP_FAILED) {
    ADD_FAILURE() << "mmap of " << path << " [" << b << ", " << end << "): " << std::strerror(errno);
    return false;
  }
  std::vector<unsigned char> vec((len + page - 1) / page);
  EXPECT_EQ(::mincore(map, len, vec.data()), 0);
  ::munmap(map, len);
  for (unsigned char v : vec)
    if (!(v & 1)) return false;
  return true;
}

// The ranges each of 3 ranks reads of one file of 3 pieces and 5 bytes: overlapping, uneven, one rank
// with a range in the middle of a piece. Rank 2 needs the most, so it is the reader.
FileRanges needs_of(int rank) {
  switch (rank) {
    case 0: return {{"data.bin", {{0, 10}, {kPiece + 100, kPiece + 200}}}};
    case 1: return {{"data.bin", {{5, 2 * kPiece}}}};
    default: return {{"data.bin", {{kPiece, 3 * kPiece + 5}}}};
  }
}

// Once wait_for(file, end) returns, the bytes before `end` of every range the rank needs are in the
// page cache, although the file was cold and no rank but the reader read it.
TEST(CooperativePrefetch, WaitersFindTheirBytesInThePageCache) {
  const auto dir = temp_dir("prefetch_follow");
  const auto path = cold_file(dir, 3 * kPiece + 5);
  ASSERT_FALSE(resident(path, 0, 3 * kPiece + 5)) << "the page cache kept the file: the test would prove nothing";
  run_ranks(3, [&](ProcessGroupPtr pg) {
    dcp::detail::Coordinator coord(pg, "test");
    const auto needs = needs_of(pg->rank());
    CooperativePrefetch prefetch(coord, dir, needs);
    for (const auto& [b, e] : needs.at("data.bin")) {
      prefetch.wait_for("data.bin", e);
      EXPECT_TRUE(resident(path, b, e)) << "rank " << pg->rank() << ": [" << b << ", " << e << ") not read yet; first page " << resident(path, b, b + 1) << " last " << resident(path, e - 1, e);
    }
    prefetch.finish();
  });
}

// The reader's rank fails before reading (its destructor stops the thread): the other ranks' waits end
// at once, with the file not read for them (they read it themselves).
TEST(CooperativePrefetch, AStoppedReaderReleasesEveryWaiter) {
  const auto dir = temp_dir("prefetch_stop");
  cold_file(dir, 3 * kPiece + 5);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        dcp::detail::Coordinator coord(pg, "test");
        const auto needs = needs_of(pg->rank());
        auto prefetch = std::make_unique<CooperativePrefetch>(coord, dir, needs);
        if (pg->rank() == 2) {
          prefetch.reset();  // a failed load: no finish()
          throw std::runtime_error("rank 2's load failed");
        }
        for (const auto& [b, e] : needs.at("data.bin")) prefetch->wait_for("data.bin", e);
        prefetch->finish();
      },
      std::chrono::seconds(60), std::chrono::seconds(20));
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  // Measured 0.01 s; the group's timeout (20 s) is what a waiter left behind would take.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

// A file the reader cannot open is published unread: the waits end, and each rank's own read reports
// the missing file.
TEST(CooperativePrefetch, AFileTheReaderCannotReadIsPublishedUnread) {
  const auto dir = temp_dir("prefetch_missing");
  run_ranks(
      3,
      [&](ProcessGroupPtr pg) {
        dcp::detail::Coordinator coord(pg, "test");
        const auto needs = needs_of(pg->rank());
        CooperativePrefetch prefetch(coord, dir, needs);
        for (const auto& [b, e] : needs.at("data.bin")) prefetch.wait_for("data.bin", e);
        prefetch.finish();
      },
      std::chrono::seconds(60));
}

// Files one rank needs alone and ranks that need nothing: no reader, no waits.
TEST(CooperativePrefetch, FilesOfOneRankHaveNoReader) {
  const auto dir = temp_dir("prefetch_alone");
  run_ranks(3, [&](ProcessGroupPtr pg) {
    dcp::detail::Coordinator coord(pg, "test");
    FileRanges mine;
    if (pg->rank() < 2) mine["rank" + std::to_string(pg->rank()) + ".bin"] = {{0, 3 * kPiece}};
    CooperativePrefetch prefetch(coord, dir, mine);
    prefetch.wait_for("rank0.bin", 3 * kPiece);  // no file of its own is missing: returns at once
    prefetch.finish();
  });
}

// Two ranks needing five files alike: the ranks' loads tie and then exceed what each file adds, and every
// file still gets a reader (a file without one would leave its waiters to the group's timeout).
TEST(CooperativePrefetch, EveryFileGetsAReaderWhenTheRanksLoadsTie) {
  const auto dir = temp_dir("prefetch_tie");
  const std::vector<std::string> names = {"a.bin", "b.bin", "c.bin", "d.bin", "e.bin"};
  for (const auto& name : names) fs::rename(cold_file(dir, kPiece), dir + "/" + name);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      2,
      [&](ProcessGroupPtr pg) {
        dcp::detail::Coordinator coord(pg, "test");
        FileRanges needs;
        for (const auto& name : names) needs[name] = {{0, kPiece}};
        CooperativePrefetch prefetch(coord, dir, needs);
        for (const auto& [file, ranges] : needs) prefetch.wait_for(file, ranges.back().second);
        prefetch.finish();
      },
      std::chrono::seconds(60), std::chrono::seconds(20));
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  // Measured 0.05 s; a file without a reader would take the 20 s group timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

/// Turns the cooperative prefetch on in dcp::load for one scope (it is off by default).
struct PrefetchOn {
  PrefetchOn() { dcp::detail::set_cooperative_prefetch(true); }
  ~PrefetchOn() { dcp::detail::set_cooperative_prefetch(false); }
};

// A model and AdamW state saved on 2 ranks load bit for bit on 3 and 4 ranks (every file read by one
// rank, the others following), and back on 2 (one rank per file: no reader).
TEST(CooperativePrefetch, ReshardedLoadsAreBitExact) {
  PrefetchOn on;
  const auto dir = temp_dir("prefetch_exact") + "/ck";
  const auto batches = make_batches(4, kCkptBatch, kCkptSeq, 99);
  FullState saved;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7);
    for (const auto& b : batches) t.step(b);
    dcp::save(get_state_dict(t.net, *t.opt), dir);
    auto s = full_state(t);
    if (pg->rank() == 0) saved = s;
  });
  for (int world : {3, 4, 2}) {
    run_ranks(world, [&](ProcessGroupPtr pg) {
      Trainer t(pg, 8);
      auto sd = get_state_dict(t.net, *t.opt);
      dcp::load(sd, dir);
      set_state_dict(t.net, *t.opt, sd);
      EXPECT_EQ(diff_states(full_state(t), saved), "") << world << " ranks, rank " << pg->rank();
    });
  }
}

}  // namespace
}  // namespace fsdp::testing
