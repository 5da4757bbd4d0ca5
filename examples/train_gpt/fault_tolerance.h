// --ft-replica-id, --ft-group-size, --ft-lighthouse: train_gpt as one replica group of a fault-tolerant job
// (fsdp::ft::Manager, after TorchFT; [Note: replica quorum] in src/ft/manager.cpp). Each replica group is a
// job of its own (its own fsdprun, its own ranks, fully_shard over them) training the same model; every step,
// the replica groups average their gradient shards, so they hold the same state. A replica group that fails
// does not stop the others; when it starts again it receives the current model, optimizer and data position
// from a live one (a heal) and training goes on from the current step, with no checkpoint read.
//   fsdp_lighthouse --port 29510 &
//   fsdprun --standalone --nproc-per-node 2 -- train_gpt --ft-replica-id 0 --ft-group-size 2
//       --ft-lighthouse HOST:29510 ...        (one line; the same with --ft-replica-id 1, on another host)
// The data: replica group r's rank s is data rank r * S + s of --ft-group-size * S, so the global batch is
// --ft-group-size * S * --batch-size sequences; in a step without some replica group, its part is skipped.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "options.h"

namespace train_gpt {

/// The Manager of this rank: connects to the lighthouse (--ft-lighthouse, else TORCHFT_LIGHTHOUSE: HOST:PORT)
/// and registers this replica group, whose state is that of step `initial_step` (a resumed checkpoint's,
/// else 0). Throws UsageError when no lighthouse is given, c10::Error when it cannot be reached within
/// --ft-quorum-timeout.
std::unique_ptr<fsdp::ft::Manager> make_ft_manager(const Options& o, const fsdp::ProcessGroupPtr& pg, int64_t initial_step,
                                                   std::function<fsdp::StateDict()> state_dict,
                                                   std::function<void(const fsdp::StateDict&)> load_state_dict);

/// Averages the local gradient shards of `params` and `loss_sum` over the replica groups of the step.
void average_over_replica_groups(fsdp::ft::Manager& ft, const std::vector<torch::Tensor>& params,
                                 const torch::Tensor& loss_sum);

/// One line about a quorum that healed replica groups (round, step, donor, bytes, seconds), for the log.
std::string describe_heal(const fsdp::ft::QuorumInfo& q);

}  // namespace train_gpt
