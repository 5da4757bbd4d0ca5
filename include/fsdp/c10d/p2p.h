// Point-to-point communication over a ProcessGroup: what pipeline parallelism's stages send each other.
//
// Mirrors torch.distributed.isend / irecv (with `group_dst` / `group_src`: ranks are the group's, not
// global ranks). Unlike the collectives (collectives.h), point-to-point messages are not sequenced on the
// group: a receive is matched with the sender's message of the same `tag` (Gloo), so the pipeline's
// messages may be received in another order than they were sent. NCCL ignores tags and matches the
// messages of a pair of ranks in the order they were posted; libfsdp's pipeline schedules have only been
// run on Gloo (see docs/PIPELINING.md).
#pragma once

#include <string>

#include <torch/types.h>

#include "fsdp/c10d/collectives.h"

namespace fsdp {

/// Starts sending `tensor` (contiguous; kept alive until the returned Work completes) to group rank
/// `group_dst` with `tag` (0 <= tag < 2^31). Returns at once; Work::wait() blocks until the receiver has
/// taken the data. `what` names the message in errors ("activations of stage 1, microbatch 3").
/// Throws c10::Error naming the message, the ranks and the shape: for a rank out of range, the own
/// rank, a non-contiguous tensor, or (at wait) a transport failure or the group timeout.
/// Mirrors torch.distributed.isend(tensor, group=group, group_dst=group_dst, tag=tag).
/// Example: `auto w = fsdp::isend(act, 1, *pp_group, 7); ...; w.wait();`
Work isend(const torch::Tensor& tensor, int group_dst, ProcessGroup& group, int tag = 0, const std::string& what = "");

/// Starts receiving into `tensor` (contiguous, of the sender's shape and dtype) from group rank
/// `group_src`, the message sent with `tag`. Work::wait() blocks until it arrived, at most the group's
/// timeout, then throws c10::Error naming the message, both ranks, the shape and the cause.
/// Mirrors torch.distributed.irecv(tensor, group=group, group_src=group_src, tag=tag).
/// Example: `torch::Tensor x = torch::empty({4, 16}); fsdp::irecv(x, 0, *pp_group, 7).wait();`
Work irecv(const torch::Tensor& tensor, int group_src, ProcessGroup& group, int tag = 0, const std::string& what = "");

}  // namespace fsdp
