// Stateful objects in checkpoints (CTest label: checkpoint): a data loader with per-rank state, an
// RNG tensor and a replicated Value, saved with the model and optimizer in both formats and resumed at
// the same world size; on another world size resharded by the object (it gets every saving rank's
// position) or refused naming it, with nothing loaded; async_save capturing the state at the call.
#include <gtest/gtest.h>

#include <filesystem>

#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

/// A data loader over a global stream of samples: each rank consumed `position` of its own.
struct Loader : Stateful {
  int64_t position = 0;
  int64_t epoch = 0;
  torch::Tensor rng = torch::zeros({4}, torch::kInt64);  // loaded in place
  bool reshards = false;
  // What the checkpoint gave back through load_state_dict_resharded.
  int saved_world = -1, new_world = -1;
  nlohmann::json all_positions;

  StateDict state_dict() override {
    StateDict sd;
    sd.insert_or_assign("position", per_rank_value(position));
    sd.insert_or_assign("epoch", Value(epoch));
    sd.insert_or_assign("rng", rng);
    return sd;
  }
  void load_state_dict(const StateDict& sd) override {
    position = std::get<Value>(sd.at("position")).json.get<int64_t>();
    epoch = std::get<Value>(sd.at("epoch")).json.get<int64_t>();
    EXPECT_TRUE(std::get<torch::Tensor>(sd.at("rng")).is_same(rng));  // the object's own tensor, loaded in place
  }
  bool reshardable() const override { return reshards; }
  void load_state_dict_resharded(const StateDict& sd, int saved_world_size, int world_size, int rank) override {
    saved_world = saved_world_size;
    new_world = world_size;
    all_positions = std::get<Value>(sd.at("position")).json;
    int64_t total = 0;
    for (const auto& p : all_positions) total += p.get<int64_t>();
    // The samples consumed so far, split over the new ranks.
    position = total / world_size + (rank < total % world_size ? 1 : 0);
    epoch = std::get<Value>(sd.at("epoch")).json.get<int64_t>();
  }
};

std::vector<Batch> batches() {
  static auto b = make_batches(4, kCkptBatch, kCkptSeq, 97);
  return b;
}

/// Saves model, optimizer and a loader at `world` ranks (positions 10, 20, ...; epoch 3; rng 0, 7, 14, 21).
FullState save_with_loader(int world, const std::string& dir, dcp::StorageFormat format) {
  FullState saved;
  std::mutex mu;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7);
    t.step(batches()[0]);
    auto loader = std::make_shared<Loader>();
    loader->position = 10 * (pg->rank() + 1);
    loader->epoch = 3;
    loader->rng = torch::arange(4, torch::kInt64) * 7;
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("loader", loader);
    dcp::save(sd, dir, dcp::SaveOptions().storage_format(format));
    auto s = full_state(t);
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = s;
  });
  return saved;
}

class StatefulFormats : public ::testing::TestWithParam<dcp::StorageFormat> {};

TEST_P(StatefulFormats, LoaderResumesWithTheModelAtTheSameWorldSize) {
  auto dir = temp_dir("stateful_same") + "/ck";
  auto saved = save_with_loader(2, dir, GetParam());
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto loader = std::make_shared<Loader>();
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("loader", loader);
    dcp::load(sd, dir);
    set_state_dict(t.net, *t.opt, sd);
    EXPECT_EQ(diff_states(full_state(t), saved), "");
    EXPECT_EQ(loader->position, 10 * (pg->rank() + 1));
    EXPECT_EQ(loader->epoch, 3);
    EXPECT_TRUE(torch::equal(loader->rng, torch::arange(4, torch::kInt64) * 7));
    EXPECT_EQ(loader->saved_world, -1);  // load_state_dict, not the resharding one
  });
}

// Saved on 2 ranks (positions 10 and 20), loaded on 3: the loader reshards (30 samples: 10 each).
TEST_P(StatefulFormats, ReshardingLoaderGetsEveryRanksStateOnAnotherWorldSize) {
  auto dir = temp_dir("stateful_reshard") + "/ck";
  auto saved = save_with_loader(2, dir, GetParam());
  run_ranks(3, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto loader = std::make_shared<Loader>();
    loader->reshards = true;
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("loader", loader);
    dcp::load(sd, dir);
    set_state_dict(t.net, *t.opt, sd);
    EXPECT_EQ(diff_states(full_state(t), saved), "");
    EXPECT_EQ(loader->saved_world, 2);
    EXPECT_EQ(loader->new_world, 3);
    EXPECT_EQ(loader->all_positions, nlohmann::json({10, 20}));
    EXPECT_EQ(loader->position, 10);
    EXPECT_EQ(loader->epoch, 3);
    EXPECT_TRUE(torch::equal(loader->rng, torch::arange(4, torch::kInt64) * 7));
  });
}

// An object that does not reshard: refused on another world size, naming it; nothing loaded anywhere.
TEST_P(StatefulFormats, NonReshardingObjectOnAnotherWorldSizeIsRefusedByName) {
  auto dir = temp_dir("stateful_refuse") + "/ck";
  save_with_loader(2, dir, GetParam());
  auto errors = run_ranks_collect(3, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    t.step(batches()[1]);
    auto before = local_state(t);
    auto loader = std::make_shared<Loader>();
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("loader", loader);
    try {
      dcp::load(sd, dir);
    } catch (...) {
      EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank();
      EXPECT_EQ(loader->position, 0);
      throw;
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("'loader.position' is per-rank state of the Stateful 'loader', saved by 2 ranks"), std::string::npos)
        << e;
    EXPECT_NE(e.find("Fix: load on 2 ranks, or implement Stateful::reshardable"), std::string::npos) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, StatefulFormats,
                         ::testing::Values(dcp::StorageFormat::Safetensors, dcp::StorageFormat::Distcp),
                         [](const auto& info) {
                           return info.param == dcp::StorageFormat::Distcp ? std::string("Distcp")
                                                                           : std::string("Safetensors");
                         });

// async_save takes the object's state at the call: a change right after is not in the checkpoint.
TEST(Stateful, AsyncSaveCapturesTheStateAtTheCall) {
  auto dir = temp_dir("stateful_async") + "/ck";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto loader = std::make_shared<Loader>();
    loader->position = 5;
    loader->rng = torch::full({4}, 1, torch::kInt64);
    StateDict sd;
    sd.insert_or_assign("loader", loader);
    auto fut = dcp::async_save(sd, dir, dcp::SaveOptions().group(pg));
    loader->position = 6;
    loader->rng.fill_(2);
    fut.get();
    auto back = std::make_shared<Loader>();
    StateDict sd2;
    sd2.insert_or_assign("loader", back);
    dcp::load(sd2, dir, dcp::LoadOptions().group(pg));
    EXPECT_EQ(back->position, 5);
    EXPECT_TRUE(torch::equal(back->rng, torch::full({4}, 1, torch::kInt64)));
  });
}

TEST(Stateful, KeysThatCollideAreRefused) {
  auto dir = temp_dir("stateful_collide") + "/ck";
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    StateDict sd;
    sd.insert_or_assign("loader.epoch", Value(1));
    sd.insert_or_assign("loader", std::make_shared<Loader>());
    dcp::save(sd, dir, dcp::SaveOptions().group(pg));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("the Stateful 'loader' returns 'epoch', but the state dict already holds 'loader.epoch'"),
              std::string::npos) << e;
  }
  EXPECT_FALSE(fs::exists(dir));
}

// The object's load_state_dict throws on rank 1 only: every rank raises the same error, naming the rank
// and the object, instead of rank 0 returning as if the load had worked.
TEST(Stateful, AnObjectThatFailsOnOneRankFailsTheLoadOnEveryRank) {
  struct Picky : Loader {
    int rank = 0;
    void load_state_dict(const StateDict& sd) override {
      if (rank == 1) throw std::runtime_error("position 20 is past the end of the data");
      Loader::load_state_dict(sd);
    }
  };
  auto dir = temp_dir("stateful_fails") + "/ck";
  save_with_loader(2, dir, dcp::StorageFormat::Safetensors);
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto picky = std::make_shared<Picky>();
    picky->rank = pg->rank();
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("loader", picky);
    dcp::load(sd, dir);
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 1: the Stateful 'loader' failed to load its state: position 20 is past the end of the data"),
              std::string::npos) << e;
  }
}

}  // namespace
}  // namespace fsdp::testing
