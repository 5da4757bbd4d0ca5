// loss_parallel's memory (issue 35): the peak memory of a TP head's logits, their loss and gradient per rank,
// with the logits gathered (ColwiseParallel().output_layouts(Replicate()) + cross_entropy: what TP did before)
// and with loss_parallel (ColwiseParallel()'s Shard(-1) output + fsdp::tp::vocab_parallel_cross_entropy), side
// by side in one run. Measured as the rise of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs
// before each measurement) over its RSS before the forward; the max over ranks. The two losses and the input
// gradients are compared (they must agree to fp32 rounding).
// Usage: fsdprun --standalone --nproc-per-node 2 -- bench_loss_parallel --vocab 50304,128256 --tokens 1024
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "fsdp/fsdp.h"

namespace {

double status_mib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / 1024.0;  // kB
  }
  return -1;
}

void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

struct Result {
  double peak_mib;
  torch::Tensor loss, x_grad;
};

Result measure(torch::nn::Linear head, const torch::Tensor& x_in, const torch::Tensor& target,
               const fsdp::DeviceMeshPtr& loss_mesh) {
  auto x = x_in.clone().requires_grad_(true);
  reset_peak();
  const double before = status_mib("VmRSS");
  auto logits = head(x);
  auto loss = loss_mesh ? fsdp::tp::vocab_parallel_cross_entropy(logits, target, loss_mesh)
                        : torch::nn::functional::cross_entropy(logits, target);
  loss.backward();
  const double peak = status_mib("VmHWM") - before;
  return {peak, loss.detach(), x.grad()};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"peak memory of the logits with and without loss_parallel"};
  std::vector<int64_t> vocabs{50304, 128256};
  int64_t tokens = 1024, dim = 256;
  app.add_option("--vocab", vocabs, "vocabulary sizes")->delimiter(',');
  app.add_option("--tokens", tokens, "batch x sequence (rows of the logits)");
  app.add_option("--dim", dim, "hidden size");
  CLI11_PARSE(app, argc, argv);
  auto pg = fsdp::init_process_group();
  const int tp = pg->size();
  auto mesh = fsdp::init_device_mesh(torch::kCPU, {tp}, {"tp"});
  if (pg->rank() == 0) {
    std::cout << "| vocab | tokens | tp | logits [N, V] fp32 | gathered: peak MiB/rank | loss_parallel: peak MiB/rank | "
                 "ratio | max |loss diff| | max |grad diff| |\n|---|---|---|---|---|---|---|---|---|" << std::endl;
  }
  for (int64_t vocab : vocabs) {
    torch::manual_seed(0);
    auto w = torch::randn({vocab, dim}) * 0.02;
    auto x = torch::randn({tokens, dim});
    auto target = torch::randint(vocab, {tokens}, torch::kLong);
    torch::nn::Linear gathered(torch::nn::LinearOptions(dim, vocab).bias(false));
    torch::nn::Linear sharded(torch::nn::LinearOptions(dim, vocab).bias(false));
    {
      torch::NoGradGuard no_grad;
      gathered->weight.copy_(w);
      sharded->weight.copy_(w);
    }
    w = torch::Tensor();
    fsdp::tp::parallelize_module(gathered, mesh, fsdp::tp::ColwiseParallel().output_layouts(fsdp::Replicate()));
    fsdp::tp::parallelize_module(sharded, mesh, fsdp::tp::ColwiseParallel());
    // Once each to warm up (first-touch of the allocator's arenas), then measured.
    measure(gathered, x, target, nullptr);
    measure(sharded, x, target, mesh);
    auto a = measure(gathered, x, target, nullptr);
    auto b = measure(sharded, x, target, mesh);
    auto peaks = torch::tensor({a.peak_mib, b.peak_mib}, torch::kDouble);
    fsdp::all_reduce(peaks, *pg, fsdp::ReduceOp::MAX);
    const double loss_diff = (a.loss - b.loss).abs().item<double>();
    const double grad_diff = (a.x_grad - b.x_grad).abs().max().item<double>();
    if (pg->rank() == 0) {
      std::ostringstream os;
      os.precision(4);
      const double logits_mib = static_cast<double>(tokens) * vocab * 4 / (1 << 20);
      os << "| " << vocab << " | " << tokens << " | " << tp << " | " << logits_mib << " MiB | "
         << peaks[0].item<double>() << " | " << peaks[1].item<double>() << " | "
         << peaks[1].item<double>() / peaks[0].item<double>() << " | " << loss_diff << " | " << grad_diff << " |";
      std::cout << os.str() << std::endl;
    }
  }
  return 0;
}
