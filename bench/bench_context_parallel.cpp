// Context parallelism (issue 35): activation memory per rank against the sequence length, with and without CP,
// measured side by side in one invocation. Ranks are threads (tests/common/multi_rank.h) and every CPU
// allocation is counted per rank thread (tests/common/counting_allocator.h).
//
// Model: token + position embeddings, --layers attention blocks (causal SDPA, --heads heads of --dim / --heads,
// MLP 4 x --dim), a head over a 256-token vocabulary; batch 1, fp32. For each length T and each cp (1 = one
// process, plain SDPA on the whole sequence; > 1 = context_parallel over cp ranks): the bytes a rank holds after
// the forward beyond what it held before it (what is saved for backward, plus the loss), and the peak over forward
// and backward beyond the same baseline (this adds the transients and the parameters' gradients, the same at
// every cp). Largest over the ranks.
//
//   build/bin/bench_context_parallel --lengths 1024,2048,4096 --cps 1,2,4
#include <algorithm>
#include <cstdio>
#include <sstream>

#include <CLI/CLI.hpp>

#include "counting_allocator.h"
#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace {

using fsdp::testing::CountingAllocator;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads)
      : heads(heads),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
    auto parts = qkv(ln1(x)).split(D, 2);
    auto h = [&](const torch::Tensor& t) { return t.view({B, T, heads, D / heads}).transpose(1, 2); };
    auto y = torch::scaled_dot_product_attention(h(parts[0]), h(parts[1]), h(parts[2]), {}, 0.0, /*is_causal=*/true);
    x = x + proj(y.transpose(1, 2).reshape({B, T, D}));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln1, ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t layers, int64_t d, int64_t heads, int64_t max_t)
      : tok(register_module("tok", torch::nn::Embedding(256, d))),
        pos(register_module("pos", torch::nn::Embedding(max_t, d))),
        head(register_module("head", torch::nn::Linear(d, 256))) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(Block(d, heads));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions) {
    auto x = tok(ids) + pos(positions);
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::Embedding tok, pos;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoll(item));
  return out;
}

struct Measured {
  int64_t after_forward = 0, peak = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Activation memory per rank vs sequence length, with and without context parallelism");
  std::string lengths = "1024,2048,4096", cps = "1,2,4";
  int64_t layers = 2, dim = 128, heads = 8;
  app.add_option("--lengths", lengths, "Sequence lengths (multiples of 2 x every cp)");
  app.add_option("--cps", cps, "CP sizes (1: one process without CP)");
  app.add_option("--layers", layers, "Attention blocks");
  app.add_option("--dim", dim, "Model width");
  app.add_option("--heads", heads, "Attention heads");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  const auto Ts = parse_list(lengths), CPs = parse_list(cps);
  const int64_t max_t = *std::max_element(Ts.begin(), Ts.end());
  CountingAllocator counting;
  fsdp::testing::UseCountingAllocator use(counting);
  std::printf("model: %lld blocks, width %lld, %lld heads, batch 1, fp32, causal; bytes per rank beyond the "
              "parameters and inputs (largest over the ranks)\n",
              static_cast<long long>(layers), static_cast<long long>(dim), static_cast<long long>(heads));
  std::printf("%8s %4s %18s %12s %18s %12s\n", "T", "cp", "after forward MiB", "x cp 1", "peak fwd+bwd MiB", "x cp 1");
  for (const int64_t T : Ts) {
    Measured base;
    for (const int64_t cp : CPs) {
      std::vector<Measured> per_rank(cp);
      const auto errors = fsdp::testing::run_ranks_collect(static_cast<int>(cp), [&](fsdp::ProcessGroupPtr pg) {
        torch::manual_seed(0);  // (construction is under a lock below: one generator, same weights)
        static std::mutex build_mu;
        Net net{nullptr};
        {
          std::lock_guard<std::mutex> lock(build_mu);
          torch::manual_seed(0);
          net = Net(layers, dim, heads, max_t);
        }
        auto mesh = cp > 1 ? fsdp::init_device_mesh(torch::kCPU, {cp}, {"cp"}) : nullptr;
        auto ids = torch::arange(T, torch::kLong).remainder(256).unsqueeze(0);
        auto labels = (ids * 7 + 3).remainder(256);
        auto positions = torch::arange(T, torch::kLong).unsqueeze(0);
        CountingAllocator::Counter counter;
        CountingAllocator::current() = &counter;
        Measured m;
        {
          std::optional<fsdp::experimental::context_parallel> region;
          if (mesh) region.emplace(mesh, std::vector<torch::Tensor>{ids, labels, positions}, std::vector<int64_t>{1, 1, 1});
          const int64_t base_bytes = counter.now.load();
          counter.reset_peak();
          auto loss = torch::cross_entropy_loss(net(ids, positions).view({-1, 256}), labels.reshape({-1}));
          m.after_forward = counter.now.load() - base_bytes;
          loss.backward();
          m.peak = counter.peak.load() - base_bytes;
        }
        CountingAllocator::current() = nullptr;
        per_rank[pg->rank()] = m;
      });
      for (int64_t r = 0; r < cp; ++r) {
        if (!errors[r].empty()) {
          std::fprintf(stderr, "T %lld cp %lld rank %lld: %s\n", static_cast<long long>(T), static_cast<long long>(cp),
                       static_cast<long long>(r), errors[r].c_str());
          return 1;
        }
      }
      Measured worst;
      for (const auto& m : per_rank) {
        worst.after_forward = std::max(worst.after_forward, m.after_forward);
        worst.peak = std::max(worst.peak, m.peak);
      }
      if (cp == 1) base = worst;
      const double mib = 1024.0 * 1024.0;
      std::printf("%8lld %4lld %18.2f %12.3f %18.2f %12.3f\n", static_cast<long long>(T), static_cast<long long>(cp),
                  worst.after_forward / mib, base.after_forward ? double(worst.after_forward) / base.after_forward : 0.0,
                  worst.peak / mib, base.peak ? double(worst.peak) / base.peak : 0.0);
      std::fflush(stdout);
    }
  }
  return 0;
}
