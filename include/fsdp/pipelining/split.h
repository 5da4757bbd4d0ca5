// Splitting a model into pipeline stages without tracing.
//
// torchtitan's pipeline_module_split keeps, in each stage, the modules named for it and removes the
// others (its models' forward skips missing parts). LibTorch's torch::nn::Sequential runs its children in
// order, so a Sequential splits the same way with no change to any module: each stage is a Sequential of
// the children from one split point to the next, under their original names, so the stage's parameter
// names (and state-dict keys) are the unsplit model's ("3.weight" stays "3.weight") and a checkpoint
// moves between pipelined and plain models. Other models split by building their stages' modules
// themselves (as examples/train_gpt does).
#pragma once

#include <string>
#include <vector>

#include <torch/nn/modules/container/sequential.h>

namespace fsdp::pipelining {

/// Splits `model` at `split_points`: the names of the children that begin a new stage (PyTorch's
/// SplitPoint.BEGINNING), in order. Returns split_points.size() + 1 Sequentials sharing the model's
/// modules (not copies), each child under its original name. Throws c10::Error naming the point for an
/// unknown child name, points out of order or repeated, a point at the first child (an empty stage).
/// Mirrors torch.distributed.pipelining's pipeline(..., split_spec={name: SplitPoint.BEGINNING}) and
/// torchtitan's pipeline_module_split, for Sequential models.
/// Example: `auto stages = fsdp::pipelining::split_sequential(model, {"2", "4"});  // 3 stages`
std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<std::string>& split_points);

/// Split points that cut `model`'s n children into `num_stages` contiguous stages as evenly as
/// possible (the first n % num_stages stages get one more child). Throws c10::Error when num_stages
/// exceeds the number of children. Example: `auto points = even_split_points(model, 4);`
std::vector<std::string> even_split_points(const torch::nn::Sequential& model, int num_stages);

}  // namespace fsdp::pipelining
