// [Note: one reader per file region]
// A resharded load makes several ranks read interleaved pieces of one file at once, and each one's
// page faults cut the kernel's read-around short where the other's pages begin: more, smaller disk
// requests, 1.3-1.9x a same-size load (docs/BENCHMARKS.md "Checkpoint I/O"). Ranks that share a page
// cache (one kernel: the same boot_id) need not each go to the disk:
// 1. Before reading, they exchange (through the store) the byte ranges of each file they need; rank 0
//    names one reader per (kernel, file) among the ranks needing that file (the one needing the most of
//    it, net of what it already reads) and broadcasts the plan.
// 2. A reader's thread reads the union of the ranges with large sequential preads (kPiece), in file
//    order, and after each piece publishes "piece i of this file is in the page cache" (a store key per
//    piece: a rank waits for the key of the piece holding its last byte, and pieces are read in order).
// 3. Every rank reads and verifies its own pieces as before, in file order, each only once its reader
//    has published it: the ranks follow behind the reader, so the checksum pass and the copies overlap
//    the disk instead of starting after a barrier (which made three ranks on two cores pay the second
//    pass in full: 1.26-1.56x a same-size load, docs/BENCHMARKS.md).
// Off by default (detail::set_cooperative_prefetch): on this project's VM disk, every rank faulting its
// own pieces in was faster in every side-by-side invocation (the disk serves several concurrent streams
// faster than one sequential reader per file), although it makes 2x the requests; a disk where requests
// cost more than streams (spinning disks, some network filesystems) is where this design pays.
// Files only one rank of a kernel needs (every same-size load) are left alone, and ranks on other
// machines each get their own reader. A failed prefetch read is only a lost hint: the reader publishes
// the rest of its pieces at once and the rank's own read reports the error. A reader that is stopped
// (its rank's load failed) also publishes the rest at once, so that no other rank waits for it; a reader
// whose rank died leaves the others waiting until the group's timeout, which names it.
#include "checkpoint/cooperative_prefetch.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <cstdio>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"

namespace fsdp::dcp::detail {

namespace fs = std::filesystem;

std::string page_cache_domain() {
  std::string id;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof buf, f)) id = buf;
    std::fclose(f);
  }
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();  // the plan's keys are "domain\nfile"
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return id + "@" + host;
}

std::vector<std::pair<int64_t, int64_t>> merged_ranges(std::vector<std::pair<int64_t, int64_t>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<int64_t, int64_t>> m;
  for (const auto& r : v) {
    if (!m.empty() && r.first <= m.back().second) m.back().second = std::max(m.back().second, r.second);
    else m.push_back(r);
  }
  return m;
}

namespace {

/// Rank 0's plan: file -> {reader, the union of the ranges} for every (kernel, file) two or more ranks
/// need, as JSON {"rank": {"file": [[b, e], ...]}} (one reader's files; the waiters find theirs by file).
std::string plan_readers(const std::vector<std::string>& reports) {
  // (domain, file) -> rank -> ranges
  std::map<std::pair<std::string, std::string>, std::map<int, std::vector<std::pair<int64_t, int64_t>>>> by;
  for (size_t r = 0; r < reports.size(); ++r) {
    const auto j = nlohmann::json::parse(reports[r]);
    for (const auto& [file, ranges] : j["files"].items()) {
      by[{j["domain"].get<std::string>(), file}][static_cast<int>(r)] =
          ranges.get<std::vector<std::pair<int64_t, int64_t>>>();
    }
  }
  nlohmann::json assign = nlohmann::json::object();  // rank -> file -> ranges
  std::map<int, int64_t> load;
  for (auto& [key, ranks] : by) {
    if (ranks.size() < 2) continue;
    std::vector<std::pair<int64_t, int64_t>> all_ranges;
    int reader = -1;
    int64_t best = std::numeric_limits<int64_t>::min();  // every file gets a reader, however loaded the ranks
    for (const auto& [r, ranges] : ranks) {
      int64_t bytes = 0;
      for (const auto& [b, e] : ranges) bytes += e - b;
      all_ranges.insert(all_ranges.end(), ranges.begin(), ranges.end());
      if (bytes - load[r] > best) {
        best = bytes - load[r];
        reader = r;
      }
    }
    auto u = merged_ranges(std::move(all_ranges));
    for (const auto& [b, e] : u) load[reader] += e - b;
    // Every rank of the domain waits on this file's keys, so the file's name must be unique across
    // domains in the plan: key it by domain too.
    assign[std::to_string(reader)][key.first + "\n" + key.second] = u;
  }
  return assign.dump();
}

}  // namespace

CooperativePrefetch::CooperativePrefetch(Coordinator& coord, const std::string& dir, const FileRanges& needed)
    : coord_(coord) {
  const std::string domain = page_cache_domain();
  // Per kernel: ranks on other machines number their file's pieces differently.
  key_prefix_ = "prefetch/" + std::to_string(std::hash<std::string>{}(domain)) + "/";
  nlohmann::json mine = {{"domain", domain}, {"files", needed}};
  auto all = coord.gather("prefetch_need", mine.dump(), "to report the bytes it needs");
  const auto assign = nlohmann::json::parse(
      coord.broadcast("prefetch_plan", coord.rank() == 0 ? plan_readers(all) : std::string(), "to plan the reads"));
  std::vector<std::string> my_files;
  for (const auto& [reader, files] : assign.items()) {
    for (const auto& [key, ranges] : files.items()) {
      const size_t nl = key.find('\n');
      if (key.substr(0, nl) != domain) continue;
      const std::string file = key.substr(nl + 1);
      Reads& r = files_[file];
      r.reader = std::stoi(reader);
      for (const auto& range : ranges) {
        for (int64_t at = range[0].get<int64_t>(), end = range[1].get<int64_t>(); at < end; at += kPiece) {
          r.pieces.emplace_back(at, std::min(at + kPiece, end));
        }
      }
      if (r.reader == coord.rank()) my_files.push_back(file);
    }
  }
  if (!my_files.empty()) reader_ = std::thread(&CooperativePrefetch::read_files, this, dir, my_files, coord.for_thread());
}

CooperativePrefetch::~CooperativePrefetch() {
  stop_ = true;
  finish();
}

void CooperativePrefetch::finish() {
  if (reader_.joinable()) reader_.join();
}

void CooperativePrefetch::read_files(const std::string& dir, std::vector<std::string> files, Coordinator publisher) {
  // Runs on the reader thread: only the disk and the store, never anything that waits for another rank.
  std::vector<char> buf;
  try {
    buf.resize(static_cast<size_t>(kPiece));
  } catch (const std::exception&) {
    stop_ = true;  // no memory for the buffer: publish everything unread below
  }
  for (const auto& name : files) {
    const auto& pieces = files_.at(name).pieces;
    std::optional<File> f;
    try {
      f.emplace(File::open_read((fs::path(dir) / name).string(), "dcp::load"));
    } catch (const std::exception&) {
      // A hint only: the ranks' own reads report what is wrong with the file.
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (f && !stop_) {
        // Synchronous preads: a piece is in the page cache when it is published. Not readahead(2) or
        // posix_fadvise(WILLNEED): their I/O is asynchronous, and ranks faulting pages still in flight
        // made the disk's requests smaller again (measured: docs/BENCHMARKS.md).
        try {
          f->pread_exact(buf.data(), static_cast<size_t>(pieces[i].second - pieces[i].first), pieces[i].first,
                         "prefetch");
        } catch (const std::exception&) {
          f.reset();  // the rest of this file is published unread
        }
      }
      try {
        publisher.set(key_prefix_ + name + "/" + std::to_string(i), "");
      } catch (const std::exception&) {
        // The store is gone: the waiters' own timeouts name this rank.
        return;
      }
    }
  }
}

void CooperativePrefetch::wait_for(const std::string& file, int64_t end) {
  auto it = files_.find(file);
  if (it == files_.end()) return;
  Reads& r = it->second;
  // The piece holding the byte before `end` (pieces are sorted and cover every rank's ranges).
  const auto p = std::lower_bound(r.pieces.begin(), r.pieces.end(), end,
                                  [](const std::pair<int64_t, int64_t>& piece, int64_t e) { return piece.second < e; });
  const size_t k = static_cast<size_t>(p - r.pieces.begin());
  if (k >= r.pieces.size() || k < r.waited) return;
  coord_.get(key_prefix_ + file + "/" + std::to_string(k),
             "rank " + std::to_string(r.reader) + " to read " + file + " up to byte " + std::to_string(p->second));
  r.waited = k + 1;
}

}  // namespace fsdp::dcp::detail
