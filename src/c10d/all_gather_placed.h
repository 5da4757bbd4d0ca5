// An all-gather with no output buffer: each rank's bytes go straight where the caller places them (issue 37
// item 1: FSDP's all-gather into the unsharded parameters on one host, fsdp/fsdp_collectives.cpp).
//
// all_gather_into_tensor fills a [world x input] output that FSDP then copies out, piece by piece, into the
// unsharded parameters: on the shared-memory transport that is two copies of every gathered byte (slot ->
// output -> parameter) and an output as large as the unsharded group beside the parameters at the copy-out.
// all_gather_placed hands each round of each rank's bytes, still in the transport's slot, to a caller's
// function that copies them to their final place: one copy, no output. Numbered, counted, recorded, timed
// out and failing exactly as all_gather_into_tensor (the transport compares it as an all-gather, so ranks
// on either path agree); only groups with the shared-memory transport and no debug-mode fingerprints take it.
#pragma once

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

}  // namespace fsdp::detail
