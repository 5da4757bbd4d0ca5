// All-gather extensions (CTest labels fully_shard, fsdp_api): parameters that all-gather something else than
// their shard (FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather), with the shipped low-precision
// all-gather. bf16 and float8 (e4m3, a per-shard scale) training matches one process whose forward uses the
// same rounded weights (each rank's rows rounded with that rank's scale), on 2 and 3 ranks (uneven rows);
// a step's all-gather bytes are those of the low-precision pieces (half of fp32 for bf16; a quarter plus
// one scale per parameter and rank, with 16-byte alignment, for float8); bad extensions are refused.
#include <gtest/gtest.h>

#include "error_message.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

constexpr int kExtSteps = 4;

// What the forward computes with: `w` as rebuilt by LowPrecisionAllGather(dtype) over `ws` ranks, written
// independently of the library (row chunks of ceil(d0 / ws), each rank's scale from its own rows).
torch::Tensor rounded(const torch::Tensor& w, torch::ScalarType dtype, int ws) {
  if (dtype == torch::kBFloat16) return w.to(dtype).to(w.scalar_type());
  const double fmax = 448.0;  // e4m3fn
  const int64_t rows = (w.size(0) + ws - 1) / ws;
  auto out = torch::empty_like(w);
  for (int r = 0; r < ws; ++r) {
    const int64_t begin = std::min<int64_t>(r * rows, w.size(0)), end = std::min<int64_t>((r + 1) * rows, w.size(0));
    if (end <= begin) continue;
    auto x = w.narrow(0, begin, end - begin);
    auto scale = fmax / x.abs().max().clamp_min(1e-12);
    out.narrow(0, begin, end - begin).copy_((x * scale).clamp(-fmax, fmax).to(dtype).to(torch::kFloat32) / scale);
  }
  return out;
}

// One process whose forward uses the rounded weights of every parameter of >= 2 dims (the optimizer
// updates the fp32 weights with the gradients taken at the rounded ones).
Reference rounded_reference(const std::vector<Batch>& batches, torch::ScalarType dtype, int ws) {
  Net net;
  load_full(*net, initial_weights());
  auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
  Reference ref;
  for (const auto& b : batches) {
    opt->zero_grad();
    std::map<std::string, torch::Tensor> master;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->named_parameters()) {
        master[p.key()] = p.value().detach().clone();
        if (p.value().dim() >= 2) p.value().copy_(rounded(p.value().detach(), dtype, ws));
      }
    }
    auto loss = loss_fn(net->forward(b.idx), b.targets);
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->named_parameters()) {
        grads[p.key()] = p.value().grad().clone();
        p.value().copy_(master.at(p.key()));
      }
    }
    ref.grads.push_back(std::move(grads));
    opt->step();
    ref.losses.push_back(loss.item<float>());
  }
  ref.final_params = snapshot(*net);
  return ref;
}

void run_low_precision(torch::ScalarType dtype, int ws) {
  auto batches = make_batches(kExtSteps, kBatch, kSeq);
  auto ref = rounded_reference(batches, dtype, ws);
  const std::string what = std::string(c10::toString(dtype)) + " all-gather, " + std::to_string(ws) + " ranks";
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    auto opts = FullyShardOptions().mesh(mesh).all_gather_extension_fn(low_precision_all_gather(dtype));
    Net net;
    load_full(*net, initial_weights());
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    FSDPModule<Net> model(net);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    const int64_t local = kBatch / ws;
    for (size_t step = 0; step < batches.size(); ++step) {
      auto b = batches[step].slice(pg->rank() * local, local);
      opt->zero_grad();
      auto loss = loss_fn(model(b.idx), b.targets);
      loss.backward();
      auto global = loss.detach().clone();
      all_reduce(global, *pg, ReduceOp::AVG);
      EXPECT_NEAR(global.item<double>(), ref.losses[step], kRtol * std::abs(ref.losses[step])) << what;
      expect_gradients_match(*net, ref, step, what);
      opt->step();
    }
    expect_params_match(*net, ref.final_params, what);
    for (const auto& p : net->named_parameters()) EXPECT_EQ(p.value().scalar_type(), torch::kFloat32) << "the shards stay fp32";
  });
}

TEST(AllGatherExtension, Bf16AllGatherTrainsLikeOneProcessWithRoundedWeights) {
  for (int ws : {2, 3}) run_low_precision(torch::kBFloat16, ws);
}

TEST(AllGatherExtension, Float8AllGatherTrainsLikeOneProcessWithPerShardScales) {
  for (int ws : {2, 3}) run_low_precision(torch::kFloat8_e4m3fn, ws);
}

// The bytes of one training step's all-gathers (forward: root and 2 blocks; backward: 2 blocks) with every
// parameter extended (min_dim 1), from the padded shard sizes: fp32 4 bytes per element, bf16 2, float8 1
// plus a 4-byte scale, each piece aligned to 16 bytes (float8 and its fp32 scale gather as bytes).
TEST(AllGatherExtension, StepAllGatherBytesAreThoseOfTheLowPrecisionPieces) {
  auto batches = make_batches(1, kBatch, kSeq);
  for (int ws : {2, 3}) {
    std::map<std::string, uint64_t> bytes;
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat8_e4m3fn}) {
      run_ranks(ws, [&](ProcessGroupPtr pg) {
        auto mesh = init_device_mesh(torch::kCPU, {ws});
        auto opts = FullyShardOptions().mesh(mesh);
        if (dtype != torch::kFloat32) opts.all_gather_extension_fn(low_precision_all_gather(dtype, /*min_dim=*/1));
        Net net;
        load_full(*net, initial_weights());
        for (auto& b : net->blocks) fully_shard(b, opts);
        fully_shard(net, opts);
        FSDPModule<Net> model(net);
        auto& g = *mesh->get_group(0);
        const auto b0 = g.collective_bytes("all_gather_into_tensor");
        auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
        loss_fn(model(b.idx), b.targets).backward();
        // Expected: per group, world x the sum of its pieces; blocks twice (forward and backward).
        auto piece = [&](int64_t numel) -> uint64_t {
          if (dtype == torch::kFloat32) return numel * 4;
          if (dtype == torch::kBFloat16) return numel * 2;
          return (numel + 15) / 16 * 16 + 16;
        };
        uint64_t expect = 0;
        for (const auto& [name, w] : initial_weights()) {
          const int64_t d0 = w.dim() ? w.size(0) : 1;
          const uint64_t per_rank = piece((d0 + ws - 1) / ws * (w.numel() / d0));
          expect += ws * per_rank * (name.rfind("blocks.", 0) == 0 ? 2 : 1);
        }
        EXPECT_EQ(g.collective_bytes("all_gather_into_tensor") - b0, expect) << c10::toString(dtype) << ", " << ws
                                                                              << " ranks";
        if (pg->rank() == 0) bytes[c10::toString(dtype)] = g.collective_bytes("all_gather_into_tensor") - b0;
      });
    }
    std::printf("[all-gather bytes per step] %d ranks: fp32 %llu, bf16 %llu (%.3f), float8 %llu (%.3f)\n", ws,
                static_cast<unsigned long long>(bytes["Float"]), static_cast<unsigned long long>(bytes["BFloat16"]),
                static_cast<double>(bytes["BFloat16"]) / bytes["Float"],
                static_cast<unsigned long long>(bytes["Float8_e4m3fn"]),
                static_cast<double>(bytes["Float8_e4m3fn"]) / bytes["Float"]);
    EXPECT_EQ(bytes["BFloat16"] * 2, bytes["Float"]);
  }
}

struct GrowingExtension : AllGatherExtension {
  int calls = 0;
  std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, torch::ScalarType) override {
    return {torch::cat({shard.reshape({-1}), torch::zeros({calls++ > 0 ? 1 : 0}, shard.options())})};
  }
  void post_all_gather(const std::vector<torch::Tensor>& outputs, const torch::Tensor& out) override {}
};

TEST(AllGatherExtension, BadExtensionsAreRefusedNamingTheParameter) {
  auto msg = error_message([] { LowPrecisionAllGather(torch::kInt); });
  EXPECT_NE(msg.find("expected kBFloat16, kHalf, kFloat8_e4m3fn or kFloat8_e5m2, got Int"), std::string::npos) << msg;
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    // An extension whose inputs change size after fully_shard: refused before the collective.
    auto lin = torch::nn::Linear(4, 3);
    fully_shard(lin.ptr(), FullyShardOptions().mesh(mesh).all_gather_extension_fn(
                               [](const std::string& name, const torch::Tensor&) -> std::shared_ptr<AllGatherExtension> {
                                 if (name == "weight") return std::make_shared<GrowingExtension>();
                                 return nullptr;
                               }));
    auto m = error_message([&] { lin(torch::ones({2, 4})); });
    EXPECT_NE(m.find("parameter 'weight'"), std::string::npos) << m;
    EXPECT_NE(m.find("must keep their number, dtypes and numels"), std::string::npos) << m;
    // An extension that returns nothing: refused at fully_shard, the module left unsharded.
    auto lin2 = torch::nn::Linear(4, 3);
    struct Empty : AllGatherExtension {
      std::vector<torch::Tensor> pre_all_gather(const torch::Tensor&, torch::ScalarType) override { return {}; }
      void post_all_gather(const std::vector<torch::Tensor>&, const torch::Tensor&) override {}
    };
    m = error_message([&] {
      fully_shard(lin2.ptr(), FullyShardOptions().mesh(mesh).all_gather_extension_fn(
                                  [](const std::string&, const torch::Tensor&) { return std::make_shared<Empty>(); }));
    });
    EXPECT_NE(m.find("returned no tensor from pre_all_gather"), std::string::npos) << m;
    EXPECT_EQ(lin2->weight.sizes(), (std::vector<int64_t>{3, 4})) << "a refused fully_shard shards nothing";
  });
}

}  // namespace
}  // namespace fsdp::testing
