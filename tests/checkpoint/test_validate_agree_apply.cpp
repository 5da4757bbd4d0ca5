// [Note: validate, agree, apply] (issue 11; CTest labels: checkpoint, regressions): when one rank rejects its
// state dict (set_model_state_dict, set_optimizer_state_dict, set_state_dict) or cannot read its part of a
// checkpoint (dcp::load), every rank throws naming that rank and its problem, also when it is rank 0 (whose
// message the others used to get unnamed), and no rank changes anything.
#include <gtest/gtest.h>

#include "agreed_failure.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

enum class Api { MODEL, OPTIMIZER, BOTH };

/// On 3 ranks, only rank `bad` gets a dict with a wrong shape; the others' dicts are valid.
void one_rank_rejects(Api api, int bad) {
  const auto b = make_batches(1, kCkptBatch, kCkptSeq, 5);
  auto errors = run_ranks_collect(3, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    t.step(b[0]);
    const auto before = local_state(t);
    const auto full = StateDictOptions().full_state_dict(true);
    auto sd = api == Api::MODEL       ? get_model_state_dict(t.net, full)
              : api == Api::OPTIMIZER ? get_optimizer_state_dict(t.net, *t.opt, full)
                                      : get_state_dict(t.net, *t.opt, full);
    for (auto& [k, v] : sd)
      if (auto* x = std::get_if<torch::Tensor>(&v)) v = x->clone() + 1;  // a load that would change state
    const std::string key = api == Api::MODEL       ? "blocks.0.fc1.weight"
                            : api == Api::OPTIMIZER ? "state.blocks.0.fc1.weight.exp_avg"
                                                    : "model.blocks.0.fc1.weight";
    if (pg->rank() == bad) sd.insert_or_assign(key, torch::zeros({4, kDim}));
    try {
      if (api == Api::MODEL) set_model_state_dict(t.net, sd);
      else if (api == Api::OPTIMIZER) set_optimizer_state_dict(t.net, *t.opt, sd);
      else set_state_dict(t.net, *t.opt, sd);
    } catch (...) {
      EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank() << ": the failed load changed state";
      throw;
    }
  });
  expect_agreed_failure(errors, bad, {"has shape [4, 6] in the state dict but [5, 6]"});
}

TEST(RegressionsValidateAgreeApply, SetModelStateDictOtherRanksNameTheRankThatRejected) {
  one_rank_rejects(Api::MODEL, 2);
}
TEST(RegressionsValidateAgreeApply, SetOptimizerStateDictOtherRanksNameTheRankThatRejected) {
  one_rank_rejects(Api::OPTIMIZER, 1);
}
TEST(RegressionsValidateAgreeApply, SetStateDictOtherRanksNameTheRankThatRejected) {
  one_rank_rejects(Api::BOTH, 0);
}

/// A checkpoint saved on 2 ranks, loaded on 3 where only rank `bad` asks for a key it lacks.
void one_rank_rejects(int bad) {
  const auto b = make_batches(1, kCkptBatch, kCkptSeq, 5);
  const std::string dir = temp_dir("agree_" + std::to_string(bad)) + "/ck";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    t.step(b[0]);
    dcp::save(get_state_dict(t.net, *t.opt), dir);
  });
  auto errors = run_ranks_collect(3, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    t.step(b[0]);
    const auto before = local_state(t);
    auto sd = get_state_dict(t.net, *t.opt);
    if (pg->rank() == bad) sd.insert_or_assign("model.extra", torch::zeros({2}));
    try {
      dcp::load(sd, dir);
    } catch (...) {
      EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank() << ": the failed load changed state";
      throw;
    }
  });
  expect_agreed_failure(errors, bad, {"key(s) of the state dict are not in", "'model.extra'"});
}

TEST(RegressionsValidateAgreeApply, DcpLoadOtherRanksNameRank0WhenItFails) { one_rank_rejects(0); }

}  // namespace
}  // namespace fsdp::testing
