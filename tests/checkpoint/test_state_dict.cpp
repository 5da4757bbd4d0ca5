// State dicts of sharded models and optimizers (CTest label: checkpoint).
//
// Sharded entries alias the local shards without communication; full entries gather; loading slices
// full tensors locally, broadcasts from rank 0 on request, validates everything before copying, and
// initialises optimizer state that torch::optim has not created yet.
#include <gtest/gtest.h>

#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

std::vector<Batch> batches() {
  static auto b = make_batches(4, kCkptBatch, kCkptSeq, 99);
  return b;
}

TEST(StateDict, ShardedEntriesAliasTheLocalShardsWithoutCommunication) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    auto ag_before = pg->collective_count("all_gather_into_tensor");
    auto sd = get_model_state_dict(t.net);
    EXPECT_EQ(pg->collective_count("all_gather_into_tensor"), ag_before);
    std::vector<std::string> expect;
    for (const auto& p : t.net->named_parameters()) expect.push_back(p.key());
    EXPECT_EQ(sd.keys(), expect);
    for (const auto& p : t.net->named_parameters()) {
      const auto& d = std::get<DTensor>(sd.at(p.key()));
      EXPECT_EQ(d.to_local().data_ptr(), p.value().data_ptr()) << p.key();
      EXPECT_EQ(d.sizes(), seeded_weights(7).at(p.key()).sizes().vec()) << p.key();
    }
    // Writing through the dict writes the model.
    {
      torch::NoGradGuard g;
      std::get<DTensor>(sd.at("head.bias")).to_local().fill_(3.0);
    }
    if (t.net->head->bias.numel() > 0) EXPECT_EQ(t.net->head->bias[0].item<float>(), 3.0f);
  });
}

TEST(StateDict, FullStateDictGathersAndCpuOffloadKeepsOnlyRank0) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    auto full = get_model_state_dict(t.net, StateDictOptions().full_state_dict(true));
    for (const auto& [k, w] : seeded_weights(7)) {
      EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(full.at(k)), w)) << k;
    }
    auto off = get_model_state_dict(t.net, StateDictOptions().full_state_dict(true).cpu_offload(true));
    EXPECT_EQ(off.size(), pg->rank() == 0 ? seeded_weights(7).size() : 0u);
  });
}

TEST(StateDict, FullTensorsAreSlicedLocallyOnLoad) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    Trainer t(pg, /*seed=*/7);
    const auto other = seeded_weights(8);
    StateDict sd;
    for (const auto& [k, w] : other) sd.insert_or_assign(k, w);
    auto r = set_model_state_dict(t.net, sd);
    EXPECT_TRUE(r.missing_keys.empty() && r.unexpected_keys.empty());
    auto full = get_model_state_dict(t.net, StateDictOptions().full_state_dict(true));
    for (const auto& [k, w] : other) EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(full.at(k)), w)) << k;
  });
}

TEST(StateDict, BroadcastFromRank0LoadsWhatOnlyRank0Holds) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    Trainer t(pg, /*seed=*/7);
    Trainer src(pg, /*seed=*/8);
    for (int i = 0; i < 2; ++i) src.step(batches()[i]);
    auto opts = StateDictOptions().full_state_dict(true).cpu_offload(true);
    auto sd = get_state_dict(src.net, *src.opt, opts);  // only rank 0 holds it
    EXPECT_EQ(sd.empty(), pg->rank() != 0);
    set_state_dict(t.net, *t.opt, sd, StateDictOptions().broadcast_from_rank0(true));
    auto diff = diff_states(full_state(t), full_state(src));
    EXPECT_EQ(diff, "") << "rank " << pg->rank();
    // Training on continues identically.
    EXPECT_EQ(t.step(batches()[2]), src.step(batches()[2]));
  });
}

TEST(StateDict, OptimizerStateIsKeyedByFqnAndShardedLikeItsParameter) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    for (int i = 0; i < 2; ++i) t.step(batches()[i]);
    auto osd = get_optimizer_state_dict(t.net, *t.opt);
    const auto& p = t.net->blocks[0]->fc1->weight;
    auto* st = dynamic_cast<torch::optim::AdamWParamState*>(t.opt->state().at(p.unsafeGetTensorImpl()).get());
    ASSERT_TRUE(st);
    const auto& exp_avg = std::get<DTensor>(osd.at("state.blocks.0.fc1.weight.exp_avg"));
    EXPECT_EQ(exp_avg.to_local().data_ptr(), st->exp_avg().data_ptr());  // aliases the optimizer's tensor
    EXPECT_EQ(exp_avg.sizes(), (std::vector<int64_t>{kHidden, kDim}));
    EXPECT_EQ(exp_avg.placements(), std::vector<Placement>{Shard(0)});
    EXPECT_EQ(std::get<Value>(osd.at("state.blocks.0.fc1.weight.step")).json, 2);
    EXPECT_EQ(std::get<Value>(osd.at("param_groups.wte.weight.lr")).json, 1e-2);
    EXPECT_EQ(std::get<Value>(osd.at("param_groups.wte.weight.betas")).json, nlohmann::json({0.9, 0.999}));
    EXPECT_FALSE(osd.contains("state.wte.weight.max_exp_avg_sq"));  // amsgrad off
    auto sd = get_state_dict(t.net, *t.opt);
    EXPECT_TRUE(sd.contains("model.wte.weight"));
    EXPECT_TRUE(sd.contains("optim.state.wte.weight.exp_avg_sq"));
  });
}

// Loading into a fresh optimizer (no state yet) creates the state; training then continues bit-exactly.
void fresh_optimizer_round_trip(OptimKind kind) {
  run_ranks(2, [kind](ProcessGroupPtr pg) {
    Trainer src(pg, 7, kind);
    for (int i = 0; i < 2; ++i) src.step(batches()[i]);
    Trainer dst(pg, 8, kind);
    EXPECT_TRUE(dst.opt->state().empty());
    // Sharded dict of the source (DTensors with the same layout), loaded into the fresh pair.
    set_state_dict(dst.net, *dst.opt, get_state_dict(src.net, *src.opt));
    EXPECT_EQ(diff_states(full_state(dst), full_state(src)), "");
    for (int i = 2; i < 4; ++i) EXPECT_EQ(dst.step(batches()[i]), src.step(batches()[i])) << "step " << i;
    EXPECT_EQ(diff_states(full_state(dst), full_state(src)), "");
  });
}

TEST(StateDict, FreshAdamWOptimizerIsInitialisedOnLoad) { fresh_optimizer_round_trip(OptimKind::ADAMW); }
TEST(StateDict, FreshAdamAmsgradOptimizerIsInitialisedOnLoad) { fresh_optimizer_round_trip(OptimKind::ADAM); }
TEST(StateDict, FreshSgdMomentumOptimizerIsInitialisedOnLoad) { fresh_optimizer_round_trip(OptimKind::SGD); }

TEST(StateDict, HyperParametersAreRestored) {
  run_ranks(1, [](ProcessGroupPtr pg) {
    Trainer src(pg);
    static_cast<torch::optim::AdamWOptions&>(src.opt->param_groups()[0].options()).lr(0.123).betas({0.5, 0.6});
    Trainer dst(pg);
    set_optimizer_state_dict(dst.net, *dst.opt, get_optimizer_state_dict(src.net, *src.opt));
    auto& o = static_cast<torch::optim::AdamWOptions&>(dst.opt->param_groups()[0].options());
    EXPECT_EQ(o.lr(), 0.123);
    EXPECT_EQ(std::get<0>(o.betas()), 0.5);
    EXPECT_EQ(std::get<1>(o.betas()), 0.6);
  });
}

// Every invalid input fails with a message naming the key and the rank, and changes nothing.
TEST(StateDict, InvalidInputsChangeNothing) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    t.step(batches()[0]);
    const auto before = local_state(t);
    auto expect_error = [&](const StateDict& sd, const std::string& needle, StateDictOptions o = {}) {
      try {
        set_state_dict(t.net, *t.opt, sd, o);
        ADD_FAILURE() << "expected an error containing \"" << needle << "\"";
      } catch (const c10::Error& e) {
        std::string msg = e.what_without_backtrace();
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
        EXPECT_NE(msg.find("rank"), std::string::npos) << msg;
      }
      EXPECT_EQ(diff_states(local_state(t), before), "") << "after the failed load expecting " << needle;
    };
    auto good = [&] {
      auto sd = get_state_dict(t.net, *t.opt, StateDictOptions().full_state_dict(true));
      for (auto& [k, v] : sd)
        if (auto* x = std::get_if<torch::Tensor>(&v)) v = x->clone() + 1;  // values to load
      return sd;
    };
    {  // shape
      auto sd = good();
      sd.insert_or_assign("model.blocks.0.fc1.weight", torch::zeros({4, kDim}));
      expect_error(sd, "'blocks.0.fc1.weight' has shape [4, 6] in the state dict but [5, 6]");
    }
    {  // dtype
      auto sd = good();
      sd.insert_or_assign("optim.state.head.weight.exp_avg", torch::zeros({kClasses, kDim}, torch::kFloat64));
      expect_error(sd, "'state.head.weight.exp_avg' has dtype Double");
    }
    {  // missing key (strict)
      auto sd = good();
      sd.erase("model.wte.weight");
      expect_error(sd, "'model.wte.weight'");
    }
    {  // unexpected key (strict)
      auto sd = good();
      sd.insert_or_assign("model.not_a_param", torch::zeros({1}));
      expect_error(sd, "'model.not_a_param'");
    }
    {  // a Value where a tensor belongs
      auto sd = good();
      sd.insert_or_assign("optim.state.wte.weight.exp_avg", Value(3));
      expect_error(sd, "'state.wte.weight.exp_avg' is a Value");
    }
    {  // hyper-parameters of one group that disagree
      auto sd = good();
      sd.insert_or_assign("optim.param_groups.head.bias.lr", Value(0.5));
      expect_error(sd, "param group 0 of optimizer #0 gets lr");
    }
    // Non-strict: the rest loads, the missing and unexpected keys are reported.
    auto sd = good();
    sd.erase("model.wte.weight");
    sd.insert_or_assign("extra", Value(1));
    auto r = set_state_dict(t.net, *t.opt, sd, StateDictOptions().strict(false));
    EXPECT_EQ(r.missing_keys, std::vector<std::string>{"model.wte.weight"});
    EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"extra"});
  });
}

TEST(StateDict, UnsupportedOptimizerIsRejected) {
  run_ranks(1, [](ProcessGroupPtr pg) {
    Trainer t(pg);
    torch::optim::LBFGS lbfgs(t.net->parameters(), torch::optim::LBFGSOptions(0.1));
    try {
      get_optimizer_state_dict(t.net, lbfgs);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("torch::optim::LBFGS has no state dict"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
