// Optimizer state dicts of every torch::optim optimizer, of several optimizers over one model, of a user's
// optimizer registered with register_optimizer_adapter, in the flattened and the nested layout, and with
// cpu_offload alone (CTest label: checkpoint).
//
// The central check (reshard_and_continue): train 2 steps at 2 ranks, take the full state dict, load it at
// 3 ranks (uneven shards: wte [11, 6] is 4,4,3 rows, fc1 [5, 6] 2,2,1, head [2, 6] 1,1,0, scale [1] 1,0,0:
// empty shards) into a differently initialised model with fresh optimizers, and take one more step. Then
//   - the state loaded at 3 ranks equals the saved one exactly (bit for bit, every key);
//   - the parameters after that step equal a one-process reference (same global batches, no sharding)
//     within kTol = 2e-6: the sharded gradient is reduced in another order than the reference's, so the
//     rounding differs (max |diff| observed with kTol = 0: 3e-8 for SGD to 2e-7 for centered RMSprop; a
//     lost step count or state tensor moves parameters by 1e-4 or more);
//   - at 2 ranks, a sharded round trip into fresh optimizers then one step equals the source's step exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "checkpoint_test_util.h"
#include "error_message.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace optim = torch::optim;

using Opts = std::vector<std::unique_ptr<optim::Optimizer>>;
using MakeOpts = std::function<Opts(Net&)>;

constexpr double kTol = 2e-6;

/// `stmt` throws a c10::Error whose message contains `needle`.
#define EXPECT_THROW_MSG(stmt, needle)                                               \
  do {                                                                               \
    const std::string msg_ = error_message([&] { stmt; });                           \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "expected \"" << (needle) << "\" in: " << msg_; \
  } while (0)

std::vector<Batch> opt_batches() {
  static auto b = make_batches(3, kCkptBatch, kCkptSeq, 77);
  return b;
}

/// The test model sharded over `pg` (blocks, then the root) with the optimizers `make` builds.
struct OptRun {
  ProcessGroupPtr pg;
  Net net{nullptr};
  FSDPModule<Net> model{nullptr};
  Opts opts;

  OptRun(ProcessGroupPtr group, uint64_t seed, const MakeOpts& make) : pg(std::move(group)) {
    net = Net();
    model = FSDPModule<Net>(net);
    load_full(*net, seeded_weights(seed));
    auto mesh = init_device_mesh(torch::kCPU, {pg->size()}, {"shard"}, pg);
    auto o = FullyShardOptions().mesh(mesh);
    for (auto& b : net->blocks) fully_shard(b, o);
    fully_shard(net, o);
    opts = make(net);
  }
  std::vector<optim::Optimizer*> ptrs(bool reversed = false) const {
    std::vector<optim::Optimizer*> out;
    for (const auto& o : opts) out.push_back(o.get());
    if (reversed) std::reverse(out.begin(), out.end());
    return out;
  }
  std::vector<const optim::Optimizer*> cptrs() const {
    std::vector<const optim::Optimizer*> out;
    for (const auto& o : opts) out.push_back(o.get());
    return out;
  }
  void step(const Batch& global) {
    const int64_t local = kCkptBatch / pg->size();
    auto b = global.slice(pg->rank() * local, local);
    for (auto& o : opts) o->zero_grad();
    loss_fn(model(b.idx), b.targets).backward();
    for (auto& o : opts) o->step();
  }
};

/// Tensors (cloned) and Values of a state dict of full tensors.
FullState to_full_state(const StateDict& sd) {
  FullState s;
  for (const auto& [k, v] : sd) {
    if (const auto* t = std::get_if<torch::Tensor>(&v)) s.tensors[k] = t->clone();
    else if (const auto* val = std::get_if<Value>(&v)) s.values[k] = val->json;
  }
  return s;
}

/// The full state of a run in the flattened layout (independent of the optimizers' order). Collective.
FullState full_of(const OptRun& r) {
  return to_full_state(get_state_dict(r.net, r.cptrs(), StateDictOptions().full_state_dict(true)));
}

/// Parameters after each of `steps` steps of the unsharded model on the whole global batch.
std::vector<std::map<std::string, torch::Tensor>> reference(const MakeOpts& make, int steps) {
  Net net;
  load_full(*net, seeded_weights(7));
  auto opts = make(net);
  std::vector<std::map<std::string, torch::Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    for (auto& o : opts) o->zero_grad();
    loss_fn(net->forward(opt_batches()[s].idx), opt_batches()[s].targets).backward();
    for (auto& o : opts) o->step();
    out.push_back(snapshot(*net));
  }
  return out;
}

struct Case {
  MakeOpts make;
  bool flatten = true;          // the layout of the dicts saved and loaded
  bool reverse_on_load = false;  // pass the optimizers in the other order at 3 ranks
};

void reshard_and_continue(const Case& c) {
  const auto ref = reference(c.make, 3);
  const auto layout = StateDictOptions().flatten_optimizer_state_dict(c.flatten);
  std::mutex mu;
  StateDict saved;      // rank 0's full dict after 2 steps at 2 ranks, in the case's layout
  FullState saved_flat;  // the same, flattened: what the 3-rank load must reproduce
  run_ranks(2, [&](ProcessGroupPtr pg) {
    OptRun src(pg, 7, c.make);
    for (int i = 0; i < 2; ++i) src.step(opt_batches()[i]);
    // Sharded round trip at the same world size, into a differently initialised model: exact.
    OptRun dst(pg, 8, c.make);
    set_state_dict(dst.net, dst.ptrs(), get_state_dict(src.net, src.cptrs(), layout), layout);
    EXPECT_EQ(diff_states(full_of(dst), full_of(src)), "") << "rank " << pg->rank();
    auto full = get_state_dict(src.net, src.cptrs(), StateDictOptions(layout).full_state_dict(true));
    auto flat = full_of(src);
    if (pg->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [k, v] : full) {
        const auto* t = std::get_if<torch::Tensor>(&v);
        saved.insert_or_assign(k, t ? StateDictValue(t->clone()) : v);
      }
      saved_flat = flat;
    }
    src.step(opt_batches()[2]);
    dst.step(opt_batches()[2]);
    EXPECT_EQ(diff_states(full_of(dst), full_of(src)), "") << "after one more step, rank " << pg->rank();
  });
  ASSERT_FALSE(saved.empty());
  for (const auto& [k, w] : ref[1]) {
    EXPECT_LE(max_abs_diff(saved_flat.tensors.at("model." + k), w), kTol) << k << " after 2 steps at 2 ranks";
  }
  run_ranks(3, [&](ProcessGroupPtr pg) {
    OptRun r(pg, 8, c.make);
    // Every rank passes the full dict; each slices its own (uneven, possibly empty) pieces.
    auto result = set_state_dict(r.net, r.ptrs(c.reverse_on_load), saved, layout);
    EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
    EXPECT_EQ(diff_states(full_of(r), saved_flat), "") << "rank " << pg->rank();
    r.step(opt_batches()[2]);
    for (const auto& [k, v] : get_model_state_dict(r.net, StateDictOptions().full_state_dict(true))) {
      const auto& got = std::get<torch::Tensor>(v);
      EXPECT_LE(max_abs_diff(got, ref[2].at(k)), kTol) << k << " after the step at 3 ranks, rank " << pg->rank();
    }
  });
}

MakeOpts one(OptimKind kind) {
  return [kind](Net& net) {
    Opts o;
    o.push_back(make_ckpt_optimizer(net->parameters(), kind));
    return o;
  };
}

TEST(OptimizerStateDict, AdamAmsgradReshardsAndTrainsOn) { reshard_and_continue({one(OptimKind::ADAM)}); }
TEST(OptimizerStateDict, AdamWReshardsAndTrainsOn) { reshard_and_continue({one(OptimKind::ADAMW)}); }
TEST(OptimizerStateDict, SgdMomentumReshardsAndTrainsOn) { reshard_and_continue({one(OptimKind::SGD)}); }
TEST(OptimizerStateDict, AdagradReshardsAndTrainsOn) { reshard_and_continue({one(OptimKind::ADAGRAD)}); }
TEST(OptimizerStateDict, RmspropCenteredMomentumReshardsAndTrainsOn) { reshard_and_continue({one(OptimKind::RMSPROP)}); }
TEST(OptimizerStateDict, RmspropPlainReshardsAndTrainsOn) {
  reshard_and_continue({[](Net& net) {
    Opts o;
    o.push_back(std::make_unique<optim::RMSprop>(net->parameters(), optim::RMSpropOptions(1e-2)));
    return o;
  }});
}
TEST(OptimizerStateDict, AdamNestedLayoutReshardsAndTrainsOn) { reshard_and_continue({one(OptimKind::ADAM), false}); }
TEST(OptimizerStateDict, AdagradNestedLayoutReshardsAndTrainsOn) {
  reshard_and_continue({one(OptimKind::ADAGRAD), false});
}

/// Adam with two param groups (wte; the blocks) and RMSprop over the head: three groups, two optimizers.
Opts two_optimizers(Net& net) {
  std::vector<torch::Tensor> wte, blocks, head;
  for (const auto& p : net->named_parameters()) {
    const auto& k = p.key();
    (k.rfind("wte.", 0) == 0 ? wte : k.rfind("head.", 0) == 0 ? head : blocks).push_back(p.value());
  }
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(wte, std::make_unique<optim::AdamOptions>(optim::AdamOptions(1e-2)));
  groups.emplace_back(blocks, std::make_unique<optim::AdamOptions>(optim::AdamOptions(2e-2).betas({0.8, 0.99})));
  Opts o;
  o.push_back(std::make_unique<optim::Adam>(std::move(groups), optim::AdamOptions(1e-2)));
  o.push_back(std::make_unique<optim::RMSprop>(head, optim::RMSpropOptions(1e-2).momentum(0.5)));
  return o;
}

TEST(OptimizerStateDict, TwoOptimizersReshardAndTrainOn) { reshard_and_continue({two_optimizers}); }
TEST(OptimizerStateDict, TwoOptimizersNestedLoadInAnotherOrder) { reshard_and_continue({two_optimizers, false, true}); }

// The nested layout is what PyTorch's DCP writes for {"state": {fqn: {...}}, "param_groups": [{..., "params":
// [fqn...]}]}: _traverse.traverse_state_dict walks the list of groups by index.
TEST(OptimizerStateDict, NestedLayoutHasPyTorchsDcpKeys) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    OptRun r(pg, 7, two_optimizers);
    r.step(opt_batches()[0]);
    auto nested = get_state_dict(r.net, r.cptrs(), StateDictOptions().flatten_optimizer_state_dict(false));
    auto flat = get_state_dict(r.net, r.cptrs());
    auto value = [&](const std::string& k) { return std::get<Value>(nested.at(k)).json; };
    EXPECT_EQ(value("optim.param_groups.0.params"), nlohmann::json({"wte.weight"}));
    EXPECT_EQ(value("optim.param_groups.0.lr"), 1e-2);
    EXPECT_EQ(value("optim.param_groups.1.betas"), nlohmann::json({0.8, 0.99}));
    EXPECT_EQ(value("optim.param_groups.1.params").size(), 14u);  // 2 blocks x 7 parameters
    EXPECT_EQ(value("optim.param_groups.1.params")[0], "blocks.0.scale");  // named_parameters: own before submodules'
    EXPECT_EQ(value("optim.param_groups.2.params"), nlohmann::json({"head.weight", "head.bias"}));
    EXPECT_EQ(value("optim.param_groups.2.alpha"), 0.99);
    EXPECT_FALSE(nested.contains("optim.param_groups.wte.weight.lr"));
    EXPECT_EQ(std::get<Value>(flat.at("optim.param_groups.head.bias.momentum")).json, 0.5);
    // The state keys are the same in both layouts.
    std::vector<std::string> nested_state, flat_state;
    for (const auto& k : nested.keys()) if (k.rfind("optim.state.", 0) == 0) nested_state.push_back(k);
    for (const auto& k : flat.keys()) if (k.rfind("optim.state.", 0) == 0) flat_state.push_back(k);
    EXPECT_EQ(nested_state, flat_state);
    EXPECT_TRUE(nested.contains("optim.state.head.weight.momentum_buffer"));
    EXPECT_TRUE(nested.contains("optim.state.wte.weight.exp_avg_sq"));
    // A flattened dict given as nested (or the reverse) is an error naming what is missing, and loads nothing.
    const auto before = to_full_state(get_state_dict(r.net, r.cptrs(), StateDictOptions().full_state_dict(true)));
    EXPECT_THROW_MSG(set_state_dict(r.net, r.ptrs(), flat, StateDictOptions().flatten_optimizer_state_dict(false)),
                     "'optim.param_groups.0.params'");
    EXPECT_THROW_MSG(set_state_dict(r.net, r.ptrs(), nested), "'optim.param_groups.wte.weight.lr'");
    // Param groups built otherwise than at save: the group's FQNs differ from the saved group's.
    OptRun other(pg, 7, one(OptimKind::ADAM));
    EXPECT_THROW_MSG(set_optimizer_state_dict(other.net, other.ptrs(), nested.with_prefix(kOptimPrefix),
                                              StateDictOptions().flatten_optimizer_state_dict(false)),
                     "param group 0 of optimizer #0 (torch::optim::Adam) holds");
    const auto after = to_full_state(get_state_dict(r.net, r.cptrs(), StateDictOptions().full_state_dict(true)));
    EXPECT_EQ(diff_states(after, before), "");
  });
}

// Through a distributed checkpoint: the nested layout's Values (the groups' FQN lists among them) are saved
// in the metadata and come back with dcp::load, on another world size. (The optimizers must come in the
// order of the save here: dcp::load fills the destination dict's keys, which number the groups.)
TEST(OptimizerStateDict, NestedLayoutThroughDcpReshards) {
  const auto dir = temp_dir("nested_dcp") + "/ck";
  const auto nested = StateDictOptions().flatten_optimizer_state_dict(false);
  std::mutex mu;
  FullState saved;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    OptRun r(pg, 7, two_optimizers);
    for (int i = 0; i < 2; ++i) r.step(opt_batches()[i]);
    dcp::save(get_state_dict(r.net, r.cptrs(), nested), dir);
    auto full = full_of(r);
    if (pg->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      saved = full;
    }
  });
  run_ranks(3, [&](ProcessGroupPtr pg) {
    OptRun r(pg, 8, two_optimizers);
    auto sd = get_state_dict(r.net, r.cptrs(), nested);
    dcp::load(sd, dir);
    EXPECT_EQ(std::get<Value>(sd.at("optim.param_groups.2.params")).json, nlohmann::json({"head.weight", "head.bias"}));
    set_state_dict(r.net, r.ptrs(), sd, nested);
    EXPECT_EQ(diff_states(full_of(r), saved), "") << "rank " << pg->rank();
  });
}

// ignore_frozen_params in the nested layout: a group whose parameters are all frozen lists none, and loads
// without missing or unexpected keys.
TEST(OptimizerStateDict, NestedLayoutWithAFrozenGroup) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    OptRun r(pg, 7, two_optimizers);
    r.net->wte->weight.requires_grad_(false);
    r.step(opt_batches()[0]);
    const auto o = StateDictOptions().flatten_optimizer_state_dict(false).ignore_frozen_params(true);
    auto sd = get_optimizer_state_dict(r.net, r.cptrs(), o);
    EXPECT_EQ(std::get<Value>(sd.at("param_groups.0.params")).json, nlohmann::json::array());
    EXPECT_FALSE(sd.contains("state.wte.weight.exp_avg"));
    OptRun dst(pg, 8, two_optimizers);
    dst.net->wte->weight.requires_grad_(false);
    auto result = set_optimizer_state_dict(dst.net, dst.ptrs(), sd, o);
    EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
    EXPECT_EQ(diff_states(to_full_state(get_optimizer_state_dict(dst.net, dst.cptrs(), StateDictOptions(o).full_state_dict(true))),
                          to_full_state(get_optimizer_state_dict(r.net, r.cptrs(), StateDictOptions(o).full_state_dict(true)))),
              "");
  });
}

TEST(OptimizerStateDict, BadHyperParameterNamesTheKeyAndTheOptimizer) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Trainer t(pg, 7, OptimKind::RMSPROP);
    auto sd = get_optimizer_state_dict(t.net, *t.opt);
    sd.insert_or_assign("param_groups.head.bias.centered", Value(1));
    EXPECT_THROW_MSG(set_optimizer_state_dict(t.net, *t.opt, sd),
                     "'param_groups.head.bias.centered' = 1 in the state dict: expected a boolean (torch::optim::RMSprop, rank");
  });
}

TEST(OptimizerStateDict, ParameterInTwoOptimizersIsAnErrorNamingIt) {
  run_ranks(1, [](ProcessGroupPtr pg) {
    OptRun r(pg, 7, [](Net& net) {
      Opts o;
      o.push_back(std::make_unique<optim::SGD>(net->parameters(), optim::SGDOptions(0.1)));
      o.push_back(std::make_unique<optim::Adagrad>(std::vector<torch::Tensor>{net->head->weight}, optim::AdagradOptions()));
      return o;
    });
    EXPECT_THROW_MSG(get_optimizer_state_dict(r.net, r.cptrs()),
                     "parameter 'head.weight' is in param group 0 of optimizer #0 and in param group 0 of optimizer #1");
  });
}

// cpu_offload without full_state_dict: every rank keeps its sharded dict, the locals are CPU tensors holding
// the same values, and the dict loads back.
TEST(OptimizerStateDict, CpuOffloadAloneGivesShardedDictsWithCpuLocals) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Trainer t(pg, 7, OptimKind::RMSPROP);
    t.step(opt_batches()[0]);
    auto plain = get_state_dict(t.net, *t.opt);
    auto off = get_state_dict(t.net, *t.opt, StateDictOptions().cpu_offload(true));
    ASSERT_EQ(off.keys(), plain.keys());
    size_t dtensors = 0;
    for (const auto& [k, v] : off) {
      const auto& p = plain.at(k);
      ASSERT_STREQ(kind_name(v), kind_name(p)) << k;
      if (const auto* d = std::get_if<DTensor>(&v)) {
        ++dtensors;
        const auto& pd = std::get<DTensor>(p);
        EXPECT_TRUE(d->to_local().device().is_cpu()) << k;
        EXPECT_EQ(d->placements(), pd.placements()) << k;
        EXPECT_EQ(d->sizes(), pd.sizes()) << k;
        EXPECT_TRUE(torch::equal(d->to_local(), pd.to_local())) << k;
      } else if (const auto* x = std::get_if<torch::Tensor>(&v)) {
        EXPECT_TRUE(x->device().is_cpu() && torch::equal(*x, std::get<torch::Tensor>(p))) << k;
      } else {
        EXPECT_EQ(std::get<Value>(v).json, std::get<Value>(p).json) << k;
      }
    }
    EXPECT_GT(dtensors, 0u);
    EXPECT_TRUE(off.contains("optim.state.blocks.0.fc1.weight.grad_avg"));
    auto model_only = get_model_state_dict(t.net, StateDictOptions().cpu_offload(true));
    EXPECT_EQ(model_only.size(), get_model_state_dict(t.net).size());
    Trainer dst(pg, 8, OptimKind::RMSPROP);
    set_state_dict(dst.net, *dst.opt, off);
    EXPECT_EQ(diff_states(full_state(dst), full_state(t)), "");
  });
}

// ---------------------------------------------------------------------------------------------
// A user's optimizer: momentum whose step size decays with the step count (so "step" matters).

struct VelocityOptions : optim::OptimizerCloneableOptions<VelocityOptions> {
  explicit VelocityOptions(double lr = 0.05) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta) = 0.9;
  double get_lr() const override { return lr(); }
  void set_lr(const double v) override { lr(v); }
};

struct VelocityState : optim::OptimizerCloneableParamState<VelocityState> {
  TORCH_ARG(torch::Tensor, velocity);
  TORCH_ARG(int64_t, step) = 0;
};

struct Velocity : optim::Optimizer {
  Velocity(std::vector<torch::Tensor> params, const VelocityOptions& o)
      : Optimizer(std::move(params), std::make_unique<VelocityOptions>(o)) {}
  torch::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard g;
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const VelocityOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& st = state_[p.unsafeGetTensorImpl()];
        if (!st) {
          auto s = std::make_unique<VelocityState>();
          s->velocity(torch::zeros_like(p));
          st = std::move(s);
        }
        auto& s = static_cast<VelocityState&>(*st);
        s.step(s.step() + 1);
        s.velocity().mul_(o.beta()).add_(p.grad());
        p.add_(s.velocity(), -o.lr() / std::sqrt(static_cast<double>(s.step())));
      }
    }
    return {};
  }
};

struct Unregistered : Velocity {
  using Velocity::Velocity;
};

OptimizerAdapter velocity_adapter() {
  OptimizerAdapter a;
  a.name = "Velocity";
  a.hparam_names = {"lr", "beta"};
  a.get_hparams = [](const optim::OptimizerOptions& o) -> nlohmann::json {
    const auto& x = static_cast<const VelocityOptions&>(o);
    return {{"lr", x.lr()}, {"beta", x.beta()}};
  };
  a.set_hparams = [](optim::OptimizerOptions& o, const nlohmann::json& hp) {
    static_cast<VelocityOptions&>(o).lr(hp["lr"].get<double>()).beta(hp["beta"].get<double>());
  };
  // No check_hparam: any JSON passes the check, and set_hparams decides (on a copy, during validation).
  a.state_names = [](const nlohmann::json&) { return std::vector<std::string>{"velocity"}; };
  a.state_tensor = [](optim::OptimizerParamState& s, const std::string& n) -> torch::Tensor* {
    return n == "velocity" ? &static_cast<VelocityState&>(s).velocity() : nullptr;
  };
  a.has_step = true;
  a.get_step = [](const optim::OptimizerParamState& s) { return static_cast<const VelocityState&>(s).step(); };
  a.set_step = [](optim::OptimizerParamState& s, int64_t n) { static_cast<VelocityState&>(s).step(n); };
  a.init_state = [](const nlohmann::json&, const torch::Tensor& like) -> std::unique_ptr<optim::OptimizerParamState> {
    auto s = std::make_unique<VelocityState>();
    s->velocity(torch::zeros_like(like));
    return s;
  };
  return a;
}

TEST(OptimizerStateDict, RegisteredUserOptimizerReshardsAndTrainsOn) {
  register_optimizer_adapter<Velocity>(velocity_adapter());
  reshard_and_continue({[](Net& net) {
    Opts o;
    o.push_back(std::make_unique<Velocity>(net->parameters(), VelocityOptions(0.05).beta(0.8)));
    return o;
  }});
  run_ranks(1, [](ProcessGroupPtr pg) {
    OptRun r(pg, 7, [](Net& net) {
      Opts o;
      o.push_back(std::make_unique<Velocity>(net->parameters(), VelocityOptions()));
      return o;
    });
    r.step(opt_batches()[0]);
    auto osd = get_optimizer_state_dict(r.net, r.cptrs());
    EXPECT_EQ(std::get<Value>(osd.at("state.head.weight.step")).json, 1);
    EXPECT_TRUE(osd.contains("state.wte.weight.velocity"));
    EXPECT_EQ(std::get<Value>(osd.at("param_groups.head.weight.beta")).json, 0.9);
    // A value set_hparams cannot take fails the validation, and nothing is loaded.
    auto bad = osd;
    for (auto& [k, v] : bad) {
      if (k.size() > 3 && k.compare(k.size() - 3, 3, ".lr") == 0) v = Value("fast");
      if (auto* d = std::get_if<DTensor>(&v)) v = DTensor(d->to_local() + 1, d->device_mesh(), d->placements(), d->sizes());
    }
    const auto before = get_optimizer_state_dict(r.net, r.cptrs(), StateDictOptions().full_state_dict(true));
    EXPECT_THROW_MSG(set_optimizer_state_dict(r.net, r.ptrs(), bad), "of param group 0 of optimizer #0 (Velocity) cannot be set");
    const auto after = get_optimizer_state_dict(r.net, r.cptrs(), StateDictOptions().full_state_dict(true));
    EXPECT_EQ(diff_states(to_full_state(after), to_full_state(before)), "");
  });
}

TEST(OptimizerStateDict, UnregisteredOptimizerIsAnErrorNamingTypeAndFix) {
  run_ranks(1, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    Unregistered u(t.net->parameters(), VelocityOptions());
    EXPECT_THROW_MSG(get_optimizer_state_dict(t.net, u), "Unregistered is not supported: no optimizer adapter");
    EXPECT_THROW_MSG(set_optimizer_state_dict(t.net, u, StateDict()), "fsdp::register_optimizer_adapter<");
  });
}

// [Note: LBFGS has no sharded state dict] (src/checkpoint/optimizer_adapters.cpp).
TEST(OptimizerStateDict, LbfgsIsRefusedWithTheReason) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    optim::LBFGS lbfgs(t.net->parameters(), optim::LBFGSOptions(0.1));
    EXPECT_THROW_MSG(get_optimizer_state_dict(t.net, lbfgs), "torch::optim::LBFGS has no state dict");
    EXPECT_THROW_MSG(get_state_dict(t.net, lbfgs), "not per parameter");
    EXPECT_THROW_MSG(set_state_dict(t.net, lbfgs, get_model_state_dict(t.net)), "flat over all the optimizer's parameters");
  });
}

}  // namespace
}  // namespace fsdp::testing
