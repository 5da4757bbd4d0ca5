// The zero-bubble schedules' split backward: I (the input's gradient now) and W (the weights' gradients
// later) without running the input's part of the backward twice. Internal (schedules.cpp).
// See [Note: zero-bubble backward].
#pragma once

#include <memory>
#include <vector>

#include <torch/types.h>

namespace fsdp::pipelining::detail {

/// What I leaves for W: the gradients that entered the graph's nodes on the input's path which also lead
/// to weights, or, when the graph does not allow the split, nothing (W then runs a full backward).
struct WeightGradWork;

/// I: returns the gradient of `input` (undefined if the output does not depend on it) of `output`
/// (`grad_output` undefined for a scalar loss), keeping the graph, and prepares W over `weights` (the
/// stage's trainable parameters, which must be the graph's leaves: not for fully_shard'ed stages).
/// `split` false: only the input's gradient; W will be a full backward.
std::shared_ptr<WeightGradWork> backward_input(const torch::Tensor& output, const torch::Tensor& grad_output,
                                               const torch::Tensor& input, const std::vector<torch::Tensor>& weights,
                                               bool split, torch::Tensor* input_grad);

/// Whether I prepared a split W (false: W will be a full backward).
bool is_split(const std::shared_ptr<WeightGradWork>& work);

/// W: accumulates the weights' gradients into their .grad, then releases the graph.
void backward_weight(const std::shared_ptr<WeightGradWork>& work, const torch::Tensor& output,
                     const torch::Tensor& grad_output);

}  // namespace fsdp::pipelining::detail
