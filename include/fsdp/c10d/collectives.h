// The collectives libfsdp issues, over a ProcessGroup, each with an async handle.
//
// Mirrors torch.distributed.{all_gather_into_tensor, reduce_scatter_tensor, all_reduce, broadcast,
// barrier}. Every collective of the library goes through these functions, so a failure names the
// collective, its sequence number on the group, the shapes and the rank.
//
// Averages are always computed as a SUM plus our own division: Gloo's ReduceOp::AVG has silently
// been a SUM in some PyTorch releases (PyTorch issue 162338).
#pragma once

#include <functional>
#include <string>

#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "fsdp/c10d/distributed.h"

namespace fsdp {

/// Reduction of all_reduce and reduce_scatter_tensor. AVG = SUM, then divide by the group size.
enum class ReduceOp { SUM, AVG, MAX, MIN, PRODUCT };

/// Handle of an issued collective. wait() blocks until it is done, runs the completion step (e.g. the
/// AVG division) once, and rethrows a failure as c10::Error with the collective's description.
/// A default-constructed Work is already complete (used when no communication is needed).
/// Mirrors torch.distributed.Work.
class Work {
 public:
  Work() = default;
  /// `group` and `seq` (optional) let a failure name the ranks that never reached the collective and
  /// dump the group's flight recorder.
  Work(c10::intrusive_ptr<c10d::Work> work, std::string description, std::function<void()> on_done = {},
       ProcessGroup* group = nullptr, uint64_t seq = 0);
  /// Blocks until complete; idempotent. Throws c10::Error "<description> failed: <cause>; ranks that
  /// have not reached it: [...]; not completed within the group timeout of T ms; flight recorder
  /// written to <path>" (the parts that apply).
  void wait();
  /// True once complete (does not run the completion step).
  bool is_completed() const;
  /// "all_gather_into_tensor #7 on ProcessGroup(...): input [5] Float, output [15] Float".
  const std::string& description() const { return description_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string description_;
  std::function<void()> on_done_;
  ProcessGroup* group_ = nullptr;
  uint64_t seq_ = 0;
  bool done_ = true;
};

/// Gathers `input` (any shape, contiguous) of every rank into `output`, rank-major along dim 0.
/// Requires output.numel() == group.size() * input.numel() and equal dtypes; `input` may be a view
/// of `output` (in-place all-gather). Throws c10::Error naming the shapes otherwise.
/// On a Gloo group whose ranks share one host the bytes go through shared memory instead of Gloo's
/// sockets (the same result; `FSDP_SHM_TRANSPORT=0` turns it off; see make_gloo_group). Mirrors
/// torch.distributed.all_gather_into_tensor.
Work all_gather_into_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                            bool async_op = false);

/// Reduces `input` over the group and leaves chunk `rank` (of size output.numel()) in `output`.
/// Requires input.numel() == group.size() * output.numel(), equal dtypes, contiguous tensors.
/// On Gloo, each rank sends and receives (N-1)/N of `input` (Gloo's all-to-all, then a local reduction
/// in wait(), in the order of Gloo's ring all-reduce: results identical bit for bit to Gloo's own
/// _reduce_scatter_base, which all-reduces the whole input and moves twice as many bytes). `input` must
/// stay unchanged until wait(); a scratch buffer of input's size lives from the call to the end of
/// wait(). `FSDP_GLOO_REDUCE_SCATTER=allreduce` selects Gloo's _reduce_scatter_base
/// instead (read once per process). On one host the all-to-all goes through shared memory, as
/// all_gather_into_tensor's bytes. NCCL and MPI run their own reduce-scatter. Mirrors
/// torch.distributed.reduce_scatter_tensor.
Work reduce_scatter_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                           ReduceOp op = ReduceOp::SUM, bool async_op = false);

/// Reduces `tensor` in place over the group.
Work all_reduce(const torch::Tensor& tensor, ProcessGroup& group, ReduceOp op = ReduceOp::SUM,
                bool async_op = false);

/// Copies `tensor` of group rank `src` to every rank, in place.
Work broadcast(const torch::Tensor& tensor, int src, ProcessGroup& group, bool async_op = false);

/// Blocks until every rank of the group has reached it.
Work barrier(ProcessGroup& group, bool async_op = false);

/// "[5, 3] Float" — used in error messages.
std::string describe(const torch::Tensor& t);

}  // namespace fsdp
