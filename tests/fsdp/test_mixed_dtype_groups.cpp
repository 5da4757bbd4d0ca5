// Groups whose parameters gather in several dtypes (CTest labels fully_shard, fsdp_api): a frozen int64
// index table and a frozen bf16 constant beside fp32 weights in one fully_shard group, all-gathered as
// bytes in one collective (FSDP2's uint8 all-gather). Trainable parameters share one dtype (refused
// otherwise, as in PyTorch: BadInput.FailedFullyShardLeavesTheModuleUnchanged). The training matches one
// process (fp32, 1e-5) and is bit-identical to the same model with the frozen parameters left unsharded
// (ignored_params), in fp32 and under bf16 mixed precision, on 2, 3 and 4 ranks (uneven rows, an empty
// shard, reshard_after_forward true, false and 2).
#include <gtest/gtest.h>

#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

// fc's input features permuted by a frozen int64 parameter, its output scaled by a frozen bf16 one.
struct MixedBodyImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale, perm, tag;
  torch::Tensor seen_tag;  // tag's unsharded value as the forward saw it
  MixedBodyImpl() {
    fc = register_module("fc", torch::nn::Linear(7, 5));
    scale = register_parameter("scale", (torch::arange(5) * 0.25 + 0.5).to(torch::kBFloat16), /*requires_grad=*/false);
    perm = register_parameter("perm", torch::tensor({3, 0, 6, 1, 5, 2, 4}, torch::kLong), /*requires_grad=*/false);
    // Values no float dtype holds exactly: a gather through a float buffer would change them.
    tag = register_parameter("tag", torch::arange(5, torch::kLong) * (int64_t{1} << 33) + (int64_t{1} << 40) + 1,
                             /*requires_grad=*/false);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = fc(x.index_select(1, perm));
    seen_tag = tag.clone();
    return y * scale.to(y.scalar_type());
  }
};
TORCH_MODULE(MixedBody);

struct MixedRootImpl : torch::nn::Module {
  MixedBody body;
  torch::nn::Linear head{nullptr};
  MixedRootImpl() {
    register_module("body", body);
    head = register_module("head", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::tanh(body(x))); }
};
TORCH_MODULE(MixedRoot);

constexpr int kMixedSteps = 4;
constexpr int64_t kRows = 12;  // global batch: divides by 2, 3 and 4

std::map<std::string, torch::Tensor> mixed_initial() {
  static auto w = [] {
    torch::manual_seed(11);
    MixedRoot m;
    std::map<std::string, torch::Tensor> out;
    for (const auto& p : m->named_parameters()) out[p.key()] = p.value().detach().clone();
    return out;
  }();
  return w;
}

MixedRoot make_model() {
  MixedRoot m;
  torch::NoGradGuard no_grad;
  for (auto& p : m->named_parameters()) p.value().copy_(mixed_initial().at(p.key()));
  return m;
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> mixed_batches() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  for (int i = 0; i < kMixedSteps; ++i) {
    out.emplace_back(torch::randn({kRows, 7}, gen), torch::randn({kRows, 3}, gen));
  }
  return out;
}

struct Trace {
  torch::Tensor seen_tag;                                   // the unsharded tag in the last forward
  std::vector<std::map<std::string, torch::Tensor>> grads;  // full gradients of the trainable parameters
  std::map<std::string, torch::Tensor> final_params;        // full values of every parameter
};

Trace reference() {
  auto m = make_model();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  Trace t;
  for (const auto& [x, y] : mixed_batches()) {
    opt.zero_grad();
    torch::mse_loss(m(x), y).backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : m->named_parameters()) {
      if (p.value().requires_grad()) g[p.key()] = p.value().grad().clone();
    }
    t.grads.push_back(std::move(g));
    opt.step();
  }
  for (const auto& p : m->named_parameters()) t.final_params[p.key()] = p.value().detach().clone();
  return t;
}

// Trains on this rank's rows of each global batch; the frozen parameters are sharded with the others
// (`ignore_frozen` = false: the group gathers bytes) or left whole (ignored_params: one dtype).
Trace train_sharded(int ws, int rank, const MixedPrecisionPolicy& mp, const ReshardAfterForward& raf,
                    bool ignore_frozen) {
  auto m = make_model();
  auto mesh = init_device_mesh(torch::kCPU, {ws});
  auto opts = FullyShardOptions().mesh(mesh).mp_policy(mp);
  if (ignore_frozen) opts.ignored_params({m->body->scale, m->body->perm, m->body->tag});
  fully_shard(m->body.ptr(), FullyShardOptions(opts).reshard_after_forward(raf));
  fully_shard(m.ptr(), opts);
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  const int64_t local = kRows / ws;
  Trace t;
  for (const auto& [x, y] : mixed_batches()) {
    opt.zero_grad();
    auto out = m(x.narrow(0, rank * local, local));
    torch::mse_loss(out.to(torch::kFloat32), y.narrow(0, rank * local, local)).backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : m->named_parameters()) {
      if (p.value().requires_grad()) g[p.key()] = sharded_grad(p.value())->full_tensor();
    }
    t.grads.push_back(std::move(g));
    opt.step();
  }
  t.seen_tag = m->body->seen_tag;
  for (const auto& p : m->named_parameters()) {
    const bool sharded = !(ignore_frozen && !p.value().requires_grad() && p.key().rfind("body.", 0) == 0);
    t.final_params[p.key()] = sharded ? sharded_param(p.value()).full_tensor() : p.value().detach().clone();
  }
  return t;
}

void expect_bitwise(const Trace& a, const Trace& b, const std::string& what) {
  for (size_t s = 0; s < a.grads.size(); ++s) {
    for (const auto& [k, g] : a.grads[s]) {
      EXPECT_TRUE(torch::equal(g, b.grads[s].at(k))) << "gradient of " << k << " at step " << s << " (" << what << ")";
    }
  }
  for (const auto& [k, v] : a.final_params) EXPECT_TRUE(torch::equal(v, b.final_params.at(k))) << k << " (" << what << ")";
}

TEST(MixedDtypeGroups, FrozenInt64AndBf16BesideFp32TrainLikeOneProcessAndLikeIgnoredParams) {
  const auto ref = reference();
  struct Case {
    int ws;
    ReshardAfterForward raf;
  };
  for (const auto& c : {Case{2, true}, Case{3, false}, Case{4, 2}}) {
    for (bool bf16 : {false, true}) {
      const auto mp = bf16 ? MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32)
                           : MixedPrecisionPolicy();
      const std::string what = std::to_string(c.ws) + " ranks" + (bf16 ? ", bf16" : ", fp32") + ", reshard_after_forward " +
                               std::visit([](auto v) { return std::to_string(v); }, c.raf);
      run_ranks(c.ws, [&](ProcessGroupPtr pg) {
        auto bytes = train_sharded(c.ws, pg->rank(), mp, c.raf, /*ignore_frozen=*/false);
        auto whole = train_sharded(c.ws, pg->rank(), mp, c.raf, /*ignore_frozen=*/true);
        expect_bitwise(bytes, whole, what + " on rank " + std::to_string(pg->rank()));
        // The frozen parameters come back exactly, in their own dtypes.
        EXPECT_TRUE(torch::equal(bytes.seen_tag, ref.final_params.at("body.tag")))
            << "the all-gathered int64 values changed (" << what << "): " << bytes.seen_tag;
        EXPECT_EQ(bytes.final_params.at("body.perm").scalar_type(), torch::kLong);
        EXPECT_EQ(bytes.final_params.at("body.scale").scalar_type(), torch::kBFloat16);
        EXPECT_TRUE(torch::equal(bytes.final_params.at("body.perm"), ref.final_params.at("body.perm"))) << what;
        EXPECT_TRUE(torch::equal(bytes.final_params.at("body.scale"), ref.final_params.at("body.scale"))) << what;
        if (bf16) return;  // bf16 compute: compared with the fp32 reference only through the bitwise check
        for (size_t s = 0; s < ref.grads.size(); ++s) {
          for (const auto& [k, g] : ref.grads[s]) {
            EXPECT_TRUE(torch::allclose(bytes.grads[s].at(k), g, kRtol, kAtol))
                << "gradient of " << k << " at step " << s << " (" << what << "): max |diff| "
                << max_abs_diff(bytes.grads[s].at(k), g);
          }
        }
        for (const auto& [k, v] : ref.final_params) {
          EXPECT_TRUE(torch::allclose(bytes.final_params.at(k).to(v.scalar_type()), v, kRtol, kAtol)) << k << " (" << what << ")";
        }
      });
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
