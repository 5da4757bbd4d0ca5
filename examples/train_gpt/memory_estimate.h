// --estimate-memory (issue 14): the memory fsdp::estimate_memory predicts for this run.
#pragma once

#include "options.h"

namespace train_gpt {

/// Prints fsdp::estimate_memory's breakdown for this run (rank 0) without building anything but meta
/// tensors: the same groups parallelize() makes (every block, then the root, which keeps its parameters
/// unsharded from forward to backward). Every rank computes the same prediction; only rank 0 prints.
/// Example: print_memory_estimate(setup, /*world=*/2, /*rank=*/0, /*cuda=*/false);
void print_memory_estimate(const RunSetup& s, int world, int rank, bool cuda);

}  // namespace train_gpt
