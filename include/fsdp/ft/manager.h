// Per-step fault tolerance across replica groups: fsdp::ft::Manager, after TorchFT's torchft.Manager.
//
// The job is R replica groups, each a whole FSDP job of its own (its own ranks 0..S-1, its own launcher:
// fully_shard over the replica's group); the replica groups hold the same model and optimizer state and
// average their gradients every step over a "replicate" group that the Manager forms and re-forms: HSDP
// whose replicate dimension survives the loss of a replica group. When a replica group fails, the others
// keep training from their in-memory state (they do not restart); a replica group that starts again (or a
// new one) joins at the next step and receives the current model and optimizer state from a live replica
// group by a broadcast over the replicate group, instead of reading a checkpoint. The protocol (who is
// live, which step is the truth, what happens when the donor dies during the copy):
// [Note: replica quorum] in src/ft/manager.cpp.
//
// A step, on every rank of every replica group:
//   manager.start_quorum();                 // joins this step's quorum; a joiner is healed here
//   auto loss = loss_fn(model->forward(x)); // the batch of (manager.current_step(), replica index)
//   loss.backward();
//   manager.allreduce(grads);               // averaged over the participating replica groups
//   if (manager.should_commit()) optimizer.step();   // else: the step is retried
//   optimizer.zero_grad();
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/types.h>

#include "fsdp/c10d/distributed.h"
#include "fsdp/checkpoint/state_dict.h"

namespace fsdp::ft {

/// Options of Manager. Mirrors the arguments of torchft.Manager (lighthouse -> store, replica_id,
/// min_replica_size, timeout, quorum_timeout, max_retries, state_dict/load_state_dict) and the
/// lighthouse's join timeout.
/// Example: `opts.store = tcp_store; opts.replica_group = pg; opts.replica_id = 1; opts.num_replica_groups = 2;`
struct ManagerOptions {
  /// The store every rank of every replica group shares (TorchFT's lighthouse): a c10d::TCPStore whose
  /// server outlives any replica group (e.g. one that a separate process or the launcher of a replica
  /// group that is not expected to fail hosts), or any c10d::Store the ranks share (a HashStore when the
  /// ranks are threads). Required.
  c10::intrusive_ptr<c10d::Store> store;
  /// This replica group's own group (size S, the ranks that shard the model together). Required; the
  /// Manager's rank in the replicate group is this group's rank; its rank 0 draws the incarnation id.
  ProcessGroupPtr replica_group;
  /// This replica group's id, 0 <= replica_id < num_replica_groups; a replica group that restarts keeps
  /// its id. Mirrors TorchFT's replica_id (REPLICA_GROUP_ID).
  int replica_id = 0;
  /// The most replica groups the job has (the ids are 0..num_replica_groups-1). Required (> 0).
  int num_replica_groups = 0;
  /// A step runs only with at least this many replica groups; with fewer, start_quorum waits (up to
  /// `quorum_timeout`) for replica groups to join. Mirrors torchft.Manager(min_replica_size=).
  int min_replica_size = 1;
  /// How long a quorum waits for the replica groups of the previous step before it goes on without the
  /// missing ones (they rejoin later and are healed). Mirrors TorchFT's join/quorum timeouts.
  std::chrono::milliseconds join_timeout{std::chrono::seconds(10)};
  /// Bound of start_quorum's waits: for min_replica_size replica groups (e.g. while a lost one restarts),
  /// and a joiner's wait to be admitted (the others may first have to finish a step and its vote).
  /// Mirrors torchft.Manager(quorum_timeout=).
  std::chrono::milliseconds quorum_timeout{std::chrono::minutes(15)};
  /// Bound of the step's waits: the commit vote (a rank that dies between its last collective and its
  /// vote is noticed after this), forming the replicate group, and its collectives (a peer that stops
  /// without dying). Mirrors torchft.Manager(timeout=).
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// The committed steps of the state this replica group starts from (e.g. the step of the checkpoint it
  /// resumed from; 0 for a new run). The first quorum takes the donor's (the lowest replica group's).
  int64_t initial_step = 0;
  /// start_quorum throws once this many steps in a row did not commit (a failure that repeats, e.g. a joiner
  /// that cannot be healed, must not retry forever), naming the last failure. Mirrors
  /// torchft.Manager(max_retries=).
  int max_retries = 10;
  /// The state a joiner receives: this rank's model and optimizer state (e.g. get_state_dict(model,
  /// optimizer)): sharded entries are sent as their local pieces, so the donor's and the joiner's
  /// replica groups must shard alike (same S, same fully_shard calls). Required.
  std::function<StateDict()> state_dict;
  /// Loads what state_dict() of the donor returned into this rank (e.g. set_state_dict). Called on a
  /// joiner only, after every byte arrived (never with a part of the state). Required.
  std::function<void(const StateDict&)> load_state_dict;
  /// Fault injection for tests: called on the donor after it sent each chunk of a heal (its index; a heal
  /// sends one flat buffer per dtype in 8 MiB chunks); a throw from it is that donor dying mid-copy (its
  /// replicate group is closed at once, and the throw leaves start_quorum).
  std::function<void(int64_t)> after_heal_send;
};

/// Thrown by start_quorum on a joiner when the job already finished (a replica group called shutdown()):
/// nothing is left to train; a launcher's restart that arrives late exits cleanly on it. (TorchFT has
/// no equivalent: its late joiners wait for a quorum.)
/// Example: `try { manager.start_quorum(); } catch (const fsdp::ft::JobFinished&) { return 0; }`
struct JobFinished : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What the last quorum decided (for logs and tests). Like the fields of TorchFT's quorum result
/// (replica ids, max step, heal), plus this rank's heal figures.
/// Example: `if (!m.last_quorum().joiners.empty()) log(m.last_quorum().heal_seconds);`
struct QuorumInfo {
  int64_t round = -1;          ///< the quorum's number (one per start_quorum, the same on every rank)
  int64_t step = 0;            ///< the step it runs (committed steps so far)
  std::vector<int> members;    ///< replica groups that held the state at its start
  std::vector<int> joiners;    ///< replica groups healed in it
  int donor = -1;              ///< the replica group the joiners received the state from
  bool new_group = false;      ///< whether it formed a new replicate group
  double heal_seconds = 0;     ///< this rank's time sending or receiving the state (0 without a heal)
  int64_t heal_bytes = 0;      ///< the bytes of tensor state moved by the heal (per rank)
  /// Set by should_commit() when the step did not commit: the first failure a rank reported (naming its
  /// replica group and rank), or that a rank did not vote within `timeout`.
  std::string failure;
};

/// One rank's participation in the replica quorum. Not thread-safe; one per rank.
/// Mirrors torchft.Manager (start_quorum, allreduce, report_error, errored, should_commit,
/// current_step, num_participants, is_participating).
/// Example: `fsdp::ft::Manager manager(opts); manager.start_quorum(); ... if (manager.should_commit()) opt.step();`
class Manager {
 public:
  /// Registers this rank as a joiner (its replica group's rank 0 draws an incarnation id and broadcasts
  /// it over replica_group). Throws c10::Error naming the option when an option is missing or out of range,
  /// and when replica_group's size differs from the job's other replica groups'. Sets SIGPIPE to ignored
  /// unless the program installed a handler (a write to a dead peer's socket would otherwise kill this
  /// process; Python ignores SIGPIPE from the start).
  explicit Manager(ManagerOptions options);
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  /// Begins a step: agrees with the other replica groups on who takes part, forms a new replicate group
  /// when that changed, and heals joiners (this rank receives the state if its replica group is joining,
  /// sends it if its replica group is the donor). Failures of the replicate group are recorded (errored())
  /// and fail the step at should_commit(), never thrown. Throws c10::Error only when no quorum is
  /// possible within `quorum_timeout` (fewer than min_replica_size replica groups, or this joiner not
  /// admitted), after `max_retries` steps in a row that did not commit, or when no live replica group
  /// holds the state any more (every holder died: resume from a checkpoint), naming the replica groups.
  void start_quorum();

  /// Averages `tensors` (e.g. the local gradient shards, in place) over the participating replica
  /// groups: summed in the group's ring order, divided by num_participants(); one collective per dtype.
  /// Does nothing after an error in this step; a failure of the group is recorded, not thrown. Throws
  /// c10::Error outside a step (before start_quorum) or for a tensor that is not floating point.
  void allreduce(const std::vector<torch::Tensor>& tensors);
  /// Records a failure of this step (e.g. an exception the caller caught): should_commit() returns false,
  /// and the replicate group is closed at once (the other replica groups' collectives of the step fail now
  /// rather than after `timeout`; the next step forms a new group).
  void report_error(const std::string& what);
  /// The first error recorded in this step, if any.
  const std::optional<std::string>& errored() const { return error_; }

  /// Ends a step: every rank of every participating replica group votes; true when all voted that their
  /// step succeeded (the caller then steps its optimizer), false when any failed or did not vote within
  /// `timeout` (the caller zeroes its gradients and retries the same batch: current_step() is unchanged).
  /// The same answer on every rank. Throws c10::Error when called without start_quorum.
  bool should_commit();

  /// This replica group finished training (call it on every rank after the last step): marks the job
  /// finished at current_step() in the store, so that a replica group joining later is told so
  /// (JobFinished) instead of waiting for a quorum that will not come, and closes the replicate group.
  /// One lighthouse serves one job. Mirrors torchft.Manager.shutdown().
  void shutdown();

  /// Committed steps (a joiner takes the donor's count).
  int64_t current_step() const { return step_; }
  /// Replica groups in this step (the divisor of allreduce).
  int64_t num_participants() const;
  /// This replica group's index among them (which part of the global batch it takes).
  int64_t participant_index() const;
  /// Whether this rank takes part in the current step (false before start_quorum).
  bool is_participating() const { return participating_; }
  /// The last quorum's decision.
  const QuorumInfo& last_quorum() const { return quorum_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::optional<std::string> error_;
  int64_t step_ = 0;
  bool participating_ = false;
  int failed_in_a_row_ = 0;
  QuorumInfo quorum_;
};

}  // namespace fsdp::ft
