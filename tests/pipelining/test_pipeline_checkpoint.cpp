// Checkpoints of a pipelined model (CTest label: pipeline): each stage's state dict has the unpipelined
// model's keys, so a DCP checkpoint saved at one (pp, dp) layout loads at another and into a plain model,
// bit for bit, in both formats.
#include <gtest/gtest.h>

#include <filesystem>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/fsdp/fully_shard.h"
#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/split.h"
#include "fsdp/tensor/device_mesh.h"
#include "multi_rank.h"
#include "pipeline_test_model.h"

namespace fsdp::testing::pipeline_test_model {
namespace {

using namespace fsdp::pipelining;
constexpr int kChildren = 9;

/// This rank's stages of the model at (pp, dp), sharded over dp when dp > 1; loaded with `w`.
struct Pipelined {
  std::vector<torch::nn::Sequential> mine;
  std::vector<std::unique_ptr<PipelineStage>> stages;
  std::unique_ptr<PipelineSchedule> schedule;
  StateDict state_dict() const {
    StateDict sd;
    for (const auto& part : mine)
      sd.update(get_model_state_dict(*part));
    return sd;
  }
};

Pipelined build(int pp, int dp, const std::string& schedule, int v, const Weights& w) {
  Pipelined p;
  std::vector<int64_t> shape{pp};
  std::vector<std::string> names{"pp"};
  if (dp > 1) shape.push_back(dp), names.push_back("dp");
  auto mesh = init_device_mesh(torch::kCPU, shape, names);
  auto model = make_model(kChildren);
  load(*model, w);
  const int num_stages = pp * v;
  auto parts = split_sequential(model, even_split_points(model, num_stages));
  std::vector<PipelineStage*> ptrs;
  for (int id : stage_ids_this_rank(schedule, mesh->get_group("pp")->rank(), pp, num_stages)) {
    auto part = parts[id];
    if (dp > 1) {
      for (auto& child : part->children()) fully_shard(child, FullyShardOptions().mesh((*mesh)["dp"]));
      fully_shard(part.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
    }
    p.mine.push_back(part);
    p.stages.push_back(std::make_unique<PipelineStage>(part, id, num_stages, torch::kCPU, mesh->get_group("pp")));
    ptrs.push_back(p.stages.back().get());
  }
  p.schedule = make_schedule(schedule, ptrs, 4, mse);
  return p;
}

/// The full values of a state dict's entries (gathered over dp: collective).
Weights full(const StateDict& sd) {
  Weights out;
  for (const auto& [k, v] : sd) {
    if (const auto* d = std::get_if<DTensor>(&v)) out[k] = d->full_tensor();
    if (const auto* t = std::get_if<torch::Tensor>(&v)) out[k] = t->clone();
  }
  return out;
}

struct Move {
  int pp, dp;
  std::string schedule;
  int v;
};

TEST(PipelineCheckpoint, SavedAtOneLayoutLoadsAtAnotherAndIntoAPlainModelBitForBit) {
  const auto w0 = initial_weights(kChildren);
  auto data = batches(1, 8);
  for (auto format : {dcp::StorageFormat::Safetensors, dcp::StorageFormat::Distcp}) {
    for (const auto& [from, to] : std::vector<std::pair<Move, Move>>{
             {{2, 2, "1f1b", 1}, {1, 4, "1f1b", 1}},
             {{2, 2, "1f1b", 1}, {4, 1, "1f1b", 1}},
             {{4, 1, "interleaved-1f1b", 2}, {2, 2, "zbv-zero-bubble", 2}},
             {{4, 1, "gpipe", 1}, {2, 2, "1f1b", 1}}}) {
      SCOPED_TRACE("pp" + std::to_string(from.pp) + " dp" + std::to_string(from.dp) + " -> pp" +
                   std::to_string(to.pp) + " dp" + std::to_string(to.dp));
      const auto dir = std::filesystem::temp_directory_path() /
                       ("pp_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(static_cast<int>(format)) + "_" +
                        std::to_string(from.pp) + std::to_string(from.dp) + std::to_string(to.pp) + std::to_string(to.dp));
      std::filesystem::remove_all(dir);
      // Save after one training step (so the weights are not the initial ones).
      std::map<int, Weights> saved;  // by rank: the full values of what it saved
      std::mutex mu;
      run_ranks(4, [&](ProcessGroupPtr pg) {
        auto p = build(from.pp, from.dp, from.schedule, from.v, w0);
        const int64_t local = 8 / from.dp;
        const int dp_rank = pg->rank() % from.dp;
        p.schedule->step(data[0].x.narrow(0, dp_rank * local, local), data[0].y.narrow(0, dp_rank * local, local));
        torch::NoGradGuard g;
        for (auto& part : p.mine)
          for (auto& prm : part->parameters()) prm.sub_(prm.grad(), 0.5);  // an SGD step on the shards
        auto sd = p.state_dict();
        dcp::save(sd, dir.string(), dcp::SaveOptions().storage_format(format));
        auto f = full(sd);
        std::lock_guard<std::mutex> lock(mu);
        saved[pg->rank()] = f;
      });
      Weights all;
      for (auto& [r, ws] : saved) all.insert(ws.begin(), ws.end());
      ASSERT_EQ(all.size(), w0.size()) << "the ranks saved " << all.size() << " of " << w0.size() << " entries";
      // Load at the other layout (starting from other weights) and into a plain model.
      run_ranks(4, [&](ProcessGroupPtr pg) {
        auto p = build(to.pp, to.dp, to.schedule, to.v, initial_weights(kChildren, 99));
        auto sd = p.state_dict();
        dcp::load(sd, dir.string());
        for (auto& [k, t] : full(p.state_dict())) {
          EXPECT_TRUE(torch::equal(t, all.at(k))) << k << " on rank " << pg->rank();
        }
        auto plain = make_model(kChildren);
        auto psd = get_model_state_dict(*plain);
        dcp::load(psd, dir.string());
        for (auto& prm : plain->named_parameters()) EXPECT_TRUE(torch::equal(prm.value(), all.at(prm.key()))) << prm.key();
      });
      std::filesystem::remove_all(dir);
    }
  }
}

}  // namespace
}  // namespace fsdp::testing::pipeline_test_model
