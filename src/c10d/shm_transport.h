// Shared-memory transport for the bulk collectives of a Gloo group whose ranks share one host (issue 16).
//
// [Note: shared-memory transport]
// On one host Gloo moves every byte through loopback TCP: per byte a copy into the kernel, a copy out, and the
// protocol's work, on CPUs that FSDP's compute also needs. On the `wide` benchmark config (76 MB sent per rank per
// step) ranks spent ~100 ms of a ~300 ms step blocked in collectives. Here the ranks of a group map one shared-memory
// segment instead: a collective is a copy of this rank's bytes into its slot and a copy of the other ranks' slots out,
// done by one worker thread per group, in issue order, as Gloo's own worker does. It carries all_gather_into_tensor,
// libfsdp's reduce-scatter ([Note: Gloo reduce-scatter] in collectives.cpp: its all-to-all, or for the dtypes
// all_reduce takes the whole reduce-scatter, each round reduced straight out of the slots), all_reduce and broadcast
// (issue 37: the loss's and clip_grad_norm_'s all-reduces, HSDP's replicate all-reduce, Join's), with the same bytes as
// Gloo's: an all-gather, an all-to-all and a broadcast only move bytes, and an all-reduce (and such a reduce-scatter)
// reduces each round straight out of the slots in the order of Gloo's ring ([Note: Gloo ring order] in
// collectives.cpp), every rank the whole buffer (its chunk). That takes no scratch (the slots are the only buffer,
// whatever the tensor's size) and reads N x the tensor per rank where Gloo's ring reduces (N-1)/N of it: measured
// 3.5-3.9x faster than Gloo on 64 MiB at 2 ranks and 2.0-2.2x at 4 (docs/BENCHMARKS.md, issue 37 item 2), so large
// tensors are not sent back to Gloo. all_reduce and broadcast of dtypes other than float, double, half, bfloat16, int8,
// uint8, int32 and int64, and of non-contiguous tensors, stay on Gloo (they fail or succeed as before); so do barrier
// and the debug fingerprints. CommStats counts the bytes of Gloo's algorithms either way. FSDP's all-gathers
// on one host skip the output too: all_gather_placed hands each round of each rank's bytes to the caller, which
// copies them straight into the unsharded parameters (c10d/placed_collectives.h, [Note: placed all-gather]).
//
// When: make_gloo_group() sets it up for groups of 2+ ranks that all run on one host in one set of
// namespaces (same boot id, hostname, and ipc/mnt/net/pid namespaces: network-namespace "hosts" in the
// tests are separate hosts), unless FSDP_SHM_TRANSPORT=0. Every rank reaches the same decision (rank 0
// decides and publishes it in the store); when a segment cannot be created or mapped on any rank, the
// whole group stays on Gloo, with a warning. Cost: each group holds 4 MiB x its size of /dev/shm (two 2 MiB
// slots per rank, reserved at creation) and one thread per rank; a 64 MiB /dev/shm (Docker's default)
// holds the world group of 8 ranks and its sub-groups, and groups beyond it fall back. Groups of more than
// 256 ranks stay on Gloo.
//
// Protocol: the segment holds, per rank, a control block (rounds written, rounds read, pid, failed flag,
// and what each buffer's round belongs to) and two slot buffers of kSlotBytes. A collective is cut into
// rounds of at most kSlotBytes per rank (every rank cuts it the same way: the sizes are the same on every
// rank). Round c writes into buffer c % 2 once every rank has read round c - 2 out of it, and reads once
// every rank has written round c; before reading, each rank compares every rank's kind, collective number,
// bytes and argument (an all-reduce's op and dtype, a broadcast's source) with its own, so a rank that
// skipped, reordered or changed a collective fails every rank at once, naming both sides. A broadcast's
// source takes part in every round like the others (only it writes): it fails on a mismatch too.
// Waiting is a futex on one shared counter that every state change increments (the wake-up syscall only when a
// waiter sleeps on it).
//
// Failures never hang: a wait gives up after the group timeout ("timed out"), at once when a peer's
// process is gone (its pid no longer runs, or is a zombie) or a peer's transport has failed. After a
// failure the transport refuses every later collective, naming the first cause. Work::wait in
// collectives.cpp adds the lagging ranks and the flight recorder as for Gloo's failures.
//
// No PyTorch counterpart: ProcessGroupGloo has no shared-memory transport (NCCL has one inside a node).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <sys/types.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fsdp::detail {

class ShmTransport {
 public:
  /// Bytes per rank per round (each rank has two such buffers in the segment).
  static constexpr uint64_t kSlotBytes = 2ull << 20;
  /// The largest group (a round splits a slot into `size` regions of whole cache lines: all_to_all and
  /// reduce_scatter).
  static constexpr int kMaxRanks = 256;
  /// The kinds of rounds, compared across ranks (and named in errors).
  static constexpr uint64_t kAllGather = 1, kAllToAll = 2, kAllReduce = 3, kBroadcast = 4, kReduceScatter = 5;

  /// Collective over `store` (all ranks of the group call it, after the group's Gloo rendezvous): returns
  /// the transport, or null on every rank when the ranks are not on one host, FSDP_SHM_TRANSPORT=0, or a
  /// rank could not create or map the segment. `name` is the group's, for messages.
  static std::shared_ptr<ShmTransport> create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              std::chrono::milliseconds timeout, const std::string& name);
  /// Runs the collectives still queued (each within the group timeout, as ProcessGroupGloo drains its
  /// queue), stops the worker thread and unmaps the segment. In a process forked after creation it only
  /// unmaps: the worker and the peers belong to the parent.
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  /// Queues an all-gather: `output` (contiguous CPU, size x input's bytes) gets rank r's `input` at byte
  /// r * input.nbytes() (`input` may be this rank's part of `output`). `seq` is the collective's number in
  /// the group (the same on every rank: compared, so a rank that skipped or reordered a collective fails
  /// the others at once); `what` names the collective in errors. Returns a Work that completes (or fails)
  /// when this rank's output is written.
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor output, at::Tensor input, uint64_t seq, std::string what);
  /// Places one round of an all-gather: `slot` holds rank `r`'s bytes [offset, offset + length) of its input;
  /// the function copies them wherever they belong (FSDP: straight into the unsharded parameters).
  using PlaceRound = std::function<void(int r, uint64_t offset, uint64_t length, const char* slot)>;
  /// Visits bytes [offset, offset + length) of row `j` of this rank's data (a reduce-scatter's input: the chunk
  /// for rank j; an all-gather's: this rank's only row, j = its rank) in order, as contiguous pieces:
  /// `piece(src, len)` for each, src null for len bytes of zeros. Called on the transport's worker, possibly
  /// more than once per round; a reduce-scatter's pieces must hold whole elements.
  using Piece = std::function<void(const char* src, uint64_t len)>;
  using RowPieces = std::function<void(int j, uint64_t offset, uint64_t length, const Piece& piece)>;
  /// Queues an all-gather with no output buffer: every rank's `input` (contiguous CPU, the same bytes on every
  /// rank) goes through the slots round by round and `place` puts each round of each rank, this rank's own
  /// included (from its slot, the same bytes), where it belongs. Compared across ranks as all_gather (the same
  /// kind), so a rank on this path and one on all_gather agree (all_gather is this with a copy into `output`).
  /// `seq` and `what` as for all_gather.
  c10::intrusive_ptr<c10d::Work> all_gather_placed(at::Tensor input, PlaceRound place, uint64_t seq, std::string what);
  /// all_gather_placed with no input tensor either: this rank's `bytes` come from `source` (j = this rank), copied
  /// piece by piece into its slot (FSDP: straight from the sharded parameters, no copy-in).
  c10::intrusive_ptr<c10d::Work> all_gather_placed(uint64_t bytes, RowPieces source, PlaceRound place, uint64_t seq,
                                                   std::string what);
  /// Queues an all-to-all of equal splits: `input` (contiguous CPU) is `size` chunks; chunk j goes to rank j;
  /// `output` (same bytes as input) gets rank r's chunk for this rank at chunk r. As Gloo's alltoall_base.
  /// `seq` and `what` as for all_gather.
  c10::intrusive_ptr<c10d::Work> all_to_all(at::Tensor output, at::Tensor input, uint64_t seq, std::string what);
  /// Reduces one round of an all-reduce: `slots[r]` holds rank r's bytes [offset, offset + length) of its
  /// tensor (whole elements); the function writes their reduction into this rank's tensor at the same bytes.
  /// Runs on the transport's worker, with the other ranks' slots mapped read-only for its duration.
  using ReduceRound = std::function<void(uint64_t offset, uint64_t length, const char* const* slots)>;
  /// Queues an all-reduce of `tensor` (contiguous CPU, in place): every rank's bytes go through the slots round
  /// by round (kSlotBytes per rank a round, no scratch of N x the tensor) and `reduce` combines each round.
  /// `arg` identifies the reduction ((fsdp::ReduceOp << 8) | dtype): compared across ranks with `seq`, so
  /// that ranks that disagree on the op or dtype fail instead of combining unlike bytes.
  c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor tensor, uint32_t arg, ReduceRound reduce, uint64_t seq,
                                            std::string what);
  /// Queues a reduce-scatter of equal chunks of `row_bytes` (output's bytes): row j of every rank goes to rank j,
  /// round by round, and `reduce` combines each round straight out of the slots into `output` (contiguous CPU):
  /// `offset` and `length` are bytes of this rank's chunk, `slots[r]` rank r's bytes of it. The rows come from
  /// `rows`: other ranks' rows are copied piece by piece into this rank's slot, and this rank's own row is reduced
  /// straight from its pieces when they are large (at least 64 KiB on average), else gathered into a scratch of
  /// one round first. So the input need not exist as one tensor (FSDP: the rows are read straight from the
  /// gradients). No piece may overlap `output` (it is written while they are read: pass a copy for an in-place
  /// one). No scratch of N x output: the all-to-all then reduction it replaces gathered N x output's bytes
  /// first. `arg` as for all_reduce.
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor output, uint64_t row_bytes, RowPieces rows, uint32_t arg,
                                                ReduceRound reduce, uint64_t seq, std::string what);
  /// Queues a broadcast: rank `src`'s `tensor` (contiguous CPU) is copied into every rank's `tensor`.
  c10::intrusive_ptr<c10d::Work> broadcast(at::Tensor tensor, int src, uint64_t seq, std::string what);

 private:
  struct Segment;
  ShmTransport(void* base, uint64_t bytes, int rank, int size, std::chrono::milliseconds timeout);
  using Task = std::function<void()>;
  c10::intrusive_ptr<c10d::Work> enqueue(std::function<void()> run);
  void worker_loop();
  // One round of collective `seq` of `kind` (all-gather, all-to-all, all-reduce, broadcast) with argument
  // `arg`, moving `bytes` per rank: copy-in by `write` into this rank's slot, then (every rank written, and
  // agreeing on the collective) `read` from the slots (slots[r] = rank r's).
  void round(uint64_t kind, uint64_t seq, uint64_t bytes, uint32_t arg, const std::function<void(char* my_slot)>& write,
             const std::function<void(const char* const* slots)>& read,
             std::chrono::steady_clock::time_point deadline, const std::string& what);
  // Waits until `ready(r)` holds for every rank; throws on timeout, a dead peer or a failed peer. `stage`
  // (a gerund: "writing its part of") and `what` (the collective) name what is waited for in errors.
  void wait_all(const std::function<bool(int r)>& ready, std::chrono::steady_clock::time_point deadline,
                const std::string& what, const char* stage);
  void ring_bell();
  char* slot(int r, uint64_t round) const;

  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  Segment* seg_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_;
  uint64_t rounds_ = 0;       // rounds this rank has completed (worker thread only)
  std::unique_ptr<char[]> scratch_;  // one round of this rank's own reduce-scatter row (worker thread only)
  std::unique_ptr<char[]> zeros_;    // one round of zeros (worker thread only)
  std::string broken_;   // the first failure's cause (worker thread only)

  // The worker and its queue, on the heap so that a forked child can leave them alone (their destructors
  // would wait for the parent's worker, which does not exist in the child).
  struct Queue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Task> tasks;
    bool stop = false;
    std::thread worker;
  };
  std::unique_ptr<Queue> q_ = std::make_unique<Queue>();
  pid_t owner_pid_;  // the process that created the transport (a forked child must not use it)
};

}  // namespace fsdp::detail
