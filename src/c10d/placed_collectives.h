// Collectives without their big buffer, on one host (issue 37 item 1): an all-gather with no output, each rank's
// bytes going straight where the caller places them (FSDP: into the unsharded parameters), and a reduce-scatter
// with no input, each rank's rows read straight from where they are (FSDP: the gradients). Implemented in
// collectives.cpp, used by fsdp/fsdp_collectives.cpp.
//
// all_gather_into_tensor fills a [world x input] output that FSDP then copies out, piece by piece, into the
// unsharded parameters: on the shared-memory transport that is two copies of every gathered byte (slot ->
// output -> parameter) and an output as large as the unsharded group beside the parameters at the copy-out.
// all_gather_placed hands each round of each rank's bytes, still in the transport's slot, to a caller's
// function that copies them to their final place: one copy, no output. Numbered, counted, recorded, timed
// out and failing exactly as all_gather_into_tensor (the transport compares it as an all-gather, so ranks
// on either path agree); only groups with the shared-memory transport and no debug-mode fingerprints take it.
//
// reduce_scatter_tensor needs its [world x output] input: FSDP copies every gradient into it (the copy-in) and
// the transport copies the other ranks' rows from it into its slot. reduce_scatter_placed takes the rows as
// pieces (a gradient's chunk, zero padding, the presence flags) that the transport copies straight into its
// slot, and reduces this rank's own row from the pieces themselves: one copy of the gradients fewer, and no
// input as large as the unsharded group.
//
// [Note: borrowed sources]
// The pieces are raw pointers, read by the transport's worker thread after the call returns. Their tensors
// (`held`) are therefore kept by both the worker's function, which the transport drops when the collective
// is done, and the Work, which drops them at the wait: whichever ends last frees them. So a Work destroyed
// unwaited (an aborted backward, a model destroyed with a collective in flight) never leaves the worker
// reading freed memory, and a waited one frees them at the wait, as the estimator counts. The values are
// read while the collective runs, not at its issue: a source changed between the issue and the wait changes
// what is sent (FSDP changes no shard or gradient then; a user's unshard(async_op=true) must be waited before
// the optimizer steps, as on CUDA, where the copy-in runs on its own stream).
#pragma once

#include <utility>
#include <vector>

#include <torch/torch.h>

#include "c10d/shm_transport.h"
#include "fsdp/c10d/collectives.h"

namespace fsdp::detail {

/// Whether all_gather_placed can run on `group`: a one-host Gloo group of 2+ ranks with the shared-memory
/// transport, not in debug mode (whose fingerprints compare the output's shape).
bool can_all_gather_placed(ProcessGroup& group);

/// Gathers every rank's `input` (contiguous CPU, the same bytes on every rank): for each rank r (this one's
/// included) and each round of at most ShmTransport::kSlotBytes, `place(r, offset, length, src)` gets rank
/// r's bytes [offset, offset + length) of its input at `src`, valid only during the call, on the transport's
/// worker thread. Returns the Work, described and failing as all_gather_into_tensor's. Requires
/// can_all_gather_placed(group). No PyTorch counterpart (FSDP2 copies out of its all-gather output).
Work all_gather_placed(const torch::Tensor& input, ShmTransport::PlaceRound place, ProcessGroup& group,
                       bool async_op);

/// all_gather_placed with no input tensor: this rank's `numel` elements of `dtype` come from `source(rank, offset,
/// length, piece)` (bytes, as contiguous pieces, on the transport's worker; FSDP: straight from the sharded
/// parameters, no copy-in). `held` (the pieces' tensors) is kept alive until the wait.
Work all_gather_placed(int64_t numel, torch::ScalarType dtype, ShmTransport::RowPieces source,
                       std::vector<torch::Tensor> held, ShmTransport::PlaceRound place, ProcessGroup& group,
                       bool async_op);

/// A row as contiguous pieces in order: (source, or null for that many bytes of zeros; bytes).
using PieceList = std::vector<std::pair<const char*, uint64_t>>;

/// Hands bytes [offset, offset + length) of `list` to `piece`, cut at the pieces' boundaries: the body of a
/// ShmTransport::RowPieces over a fixed list (zero-length pieces skipped).
void visit_pieces(const PieceList& list, uint64_t offset, uint64_t length, const ShmTransport::Piece& piece);

/// Whether reduce_scatter_placed can run on `group` into an output of `numel` elements of `dtype` (contiguous
/// CPU): a one-host Gloo group of 2+ ranks with the shared-memory transport, not in debug mode, not sent back to
/// Gloo's _reduce_scatter_base (FSDP_GLOO_REDUCE_SCATTER=allreduce), a dtype the transport reduces (all_reduce's),
/// at least one element.
bool can_reduce_scatter_placed(ProcessGroup& group, torch::ScalarType dtype, int64_t numel);

/// reduce_scatter_tensor(output, input, group, op) with no `input` tensor: `rows(j, offset, length, piece)` hands
/// out bytes [offset, offset + length) of this rank's row j (the input's chunk j, output's bytes long) as
/// contiguous pieces, on the transport's worker thread, possibly more than once per round. `held` (the pieces'
/// tensors) is kept alive until the wait. The same bits as reduce_scatter_tensor of the input those rows make
/// (Gloo's ring order); counted, recorded, timed out and failing as it (the transport compares it as a
/// reduce-scatter, so ranks on either path agree). Requires can_reduce_scatter_placed(group, output). No
/// PyTorch counterpart (FSDP2 copies the gradients into its reduce-scatter input).
Work reduce_scatter_placed(const torch::Tensor& output, ShmTransport::RowPieces rows, std::vector<torch::Tensor> held,
                           ProcessGroup& group, ReduceOp op, bool async_op);

}  // namespace fsdp::detail
