// libfsdp's own bookkeeping on a ProcessGroup: sequence numbers, collective counters, wait time,
// sub-group ids, the debug side backend and the progress marks lagging_ranks() reads. Users read
// these through ProcessGroup's getters (seq(), collective_count(), wait_seconds(), ...); only the
// library writes them, through this accessor (a friend of ProcessGroup).
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/c10d/distributed.h"

namespace fsdp::detail {

struct ProcessGroupAccess {
  /// The sequence number of the collective being issued (then counts it). See [Note: collective order].
  static uint64_t next_seq(ProcessGroup& g) { return g.seq_++; }
  /// Adds `s` seconds blocked in Work::wait().
  static void add_wait_seconds(ProcessGroup& g, double s) { g.wait_seconds_ += s; }
  /// Counts one collective of kind `op` of `bytes` that reached the backend.
  static void count_collective(ProcessGroup& g, const std::string& op, uint64_t bytes) {
    ++g.counts_[op];
    g.bytes_[op] += bytes;
  }
  /// The transport-bytes counters of `g` (see CommStats), written by the collectives layer.
  static CommStats& comm_stats(ProcessGroup& g) { return g.comm_stats_; }
  /// Counter that names sub-groups (identical on every rank when they build groups in one order).
  static uint64_t next_subgroup_id(ProcessGroup& g) { return g.subgroups_++; }
  /// Installs the side Gloo backend that compares collective fingerprints in debug mode.
  static void set_debug_backend(ProcessGroup& g, c10::intrusive_ptr<c10d::Backend> b) {
    g.debug_backend_ = std::move(b);
  }
  /// The shared-memory transport of a one-host Gloo group (null otherwise): src/c10d/shm_transport.h.
  static ShmTransport* shm(ProcessGroup& g) { return g.shm_.get(); }
  static void set_shm(ProcessGroup& g, std::shared_ptr<ShmTransport> t) { g.shm_ = std::move(t); }
  /// Publishes in the store that this rank reached collective `seq` (read by lagging_ranks()).
  static void note_progress(ProcessGroup& g, uint64_t seq) { g.note_progress(seq); }
};

}  // namespace fsdp::detail
