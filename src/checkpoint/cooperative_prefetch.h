// Cooperative prefetch of a resharded load: one reader per file region, the other ranks following
// behind it ([Note: one reader per file region]).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/coordinator.h"

namespace fsdp::dcp::detail {

/// Byte ranges [begin, end) of files, by file name (merged and sorted).
using FileRanges = std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>;

/// One load's cooperative prefetch (see the note in cooperative_prefetch.cpp). Every rank of the load
/// constructs it with the ranges it will read (none when its checks failed): the constructor exchanges
/// them through the store and starts this rank's reader thread when it was named the reader of some
/// files. Before a rank reads bytes of a file, wait_for(file, end) returns once the file's reader has
/// brought them into the page cache. The destructor joins the reader thread (the thread waits on
/// nothing but the disk, so it always ends).
class CooperativePrefetch {
 public:
  CooperativePrefetch(Coordinator& coord, const std::string& dir, const FileRanges& needed);
  CooperativePrefetch(const CooperativePrefetch&) = delete;
  CooperativePrefetch& operator=(const CooperativePrefetch&) = delete;
  ~CooperativePrefetch();

  /// Waits for this rank's reader thread to finish its files (every piece published). Call after the
  /// rank's own reads; the destructor alone stops the thread early (a failed load), publishing the rest
  /// unread so that no other rank waits for it.
  void finish();

  /// Blocks until the reader of `file` (if it has one) has read the file's bytes before `end`. Throws
  /// c10::Error after the group's timeout, naming the reader rank.
  void wait_for(const std::string& file, int64_t end);

  /// Piece size of the readers' preads (and of their progress reports): large sequential requests.
  static constexpr int64_t kPiece = int64_t(8) << 20;

 private:
  struct Reads {
    int reader = -1;
    std::vector<std::pair<int64_t, int64_t>> pieces;  // in read order, each at most kPiece
    size_t waited = 0;                                 // pieces this rank has seen published
  };
  void read_files(const std::string& dir, std::vector<std::string> files, Coordinator publisher);

  Coordinator& coord_;
  std::string key_prefix_;  // "prefetch/<this kernel>/": store keys of the readers' progress
  std::map<std::string, Reads> files_;
  std::thread reader_;
  std::atomic<bool> stop_{false};
};

/// `v` sorted, with overlapping or touching ranges merged.
std::vector<std::pair<int64_t, int64_t>> merged_ranges(std::vector<std::pair<int64_t, int64_t>> v);

/// This kernel's identity (its page cache): /proc/sys/kernel/random/boot_id, plus the host name.
std::string page_cache_domain();

}  // namespace fsdp::dcp::detail
