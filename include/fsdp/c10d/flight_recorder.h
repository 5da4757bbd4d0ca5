// Flight recorder: the last N collectives of a process group, kept in a ring buffer and dumped as
// JSON on a timeout or on demand, so that a hang can be diagnosed after the fact.
//
// Mirrors c10d's FlightRecorder (TORCH_NCCL_TRACE_BUFFER_SIZE / dump_fr_trace) for our collectives.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp {

/// One collective as the recorder saw it.
struct FlightRecord {
  uint64_t seq = 0;             ///< sequence number on its group
  std::string op;               ///< "all_reduce", "all_gather_into_tensor", ...
  std::string shapes;           ///< "input [5] Float, output [15] Float"
  std::string state;            ///< "issued", "completed" or "failed: <reason>"
  double issued_s = 0;          ///< seconds since the epoch when issued
  double completed_s = 0;       ///< seconds since the epoch when waited successfully (0 if not)
};

class FlightRecorder {
 public:
  /// Keeps the last `capacity` records (Default: `FSDP_FLIGHT_RECORDER_SIZE` from the environment,
  /// else 256).
  explicit FlightRecorder(size_t capacity = 0);
  void issued(uint64_t seq, std::string op, std::string shapes);
  void completed(uint64_t seq);
  void failed(uint64_t seq, const std::string& reason);
  /// Oldest first.
  std::vector<FlightRecord> records() const;
  /// Writes {"group", "rank", "size", "records": [...]} to `dir`/fsdp_flight_recorder_<group>_rank<rank>.json
  /// (slashes in the group name become '_'); `dir` defaults to `FSDP_FLIGHT_RECORDER_DIR`.
  /// Returns the path written, or "" when no directory is given. Never throws.
  std::string dump(const std::string& group, int rank, int size, std::string dir = "") const;

 private:
  FlightRecord* find(uint64_t seq);
  mutable std::mutex mu_;
  std::vector<FlightRecord> ring_;
  size_t capacity_;
  size_t next_ = 0;  // slot of the next record
  size_t count_ = 0;
};

}  // namespace fsdp
