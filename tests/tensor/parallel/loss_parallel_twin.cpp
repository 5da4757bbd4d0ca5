// The C++ side of tests/python/test_loss_parallel_vs_pytorch.py (issue 35): a ColwiseParallel head (bias-free
// Linear(16, V)) on a TP mesh of every rank, vocab_parallel_cross_entropy on its local output, backward; each rank
// writes <out>/rank<r>.safetensors with the loss, the local logits' gradient, the head weight's (local rows) and
// the input's gradient. The inputs are formulas (sin/cos of arange) that the Python side evaluates alike.
// Usage: fsdprun --standalone --nproc-per-node 2 -- loss_parallel_twin OUT V ROWS SMOOTHING REDUCTION
#include <iostream>
#include <string>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/fsdp.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: loss_parallel_twin OUT VOCAB ROWS LABEL_SMOOTHING REDUCTION" << std::endl;
    return 2;
  }
  const std::string out = argv[1];
  const int64_t vocab = std::stoll(argv[2]), rows = std::stoll(argv[3]), d = 16;
  const double smoothing = std::stod(argv[4]);
  const std::string reduction = argv[5];
  auto pg = fsdp::init_process_group();
  auto mesh = fsdp::init_device_mesh(torch::kCPU, {pg->size()}, {"tp"});
  torch::nn::Linear head(torch::nn::LinearOptions(d, vocab).bias(false));
  {
    torch::NoGradGuard no_grad;
    head->weight.copy_((torch::arange(vocab * d, torch::kFloat32).view({vocab, d}) * 0.31).sin());
  }
  fsdp::tp::parallelize_module(head, mesh, fsdp::tp::ColwiseParallel());
  auto x = (torch::arange(rows * d, torch::kFloat32).view({rows, d}) * 0.13).cos().requires_grad_(true);
  auto target = (torch::arange(rows, torch::kInt64) * 7 + 3).remainder(vocab);
  target.index_put_({1}, -100);
  auto logits = head(x);  // [rows, V / tp]
  logits.retain_grad();
  auto loss = fsdp::tp::vocab_parallel_cross_entropy(
      logits, target, mesh, fsdp::tp::LossParallelOptions().set_reduction(reduction).set_label_smoothing(smoothing));
  (reduction == "none" ? loss.sum() : loss).backward();
  fsdp::dcp::save_file({{"loss", loss.detach().contiguous()},
                        {"logits_grad", logits.grad().contiguous()},
                        {"weight_grad", head->weight.grad().contiguous()},
                        {"x_grad", x.grad().contiguous()}},
                       out + "/rank" + std::to_string(pg->rank()) + ".safetensors");
  std::cout << "rank " << pg->rank() << " loss " << loss.sum().item<double>() << std::endl;
  return 0;
}
