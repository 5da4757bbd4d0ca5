// Regressions of [Note: validate, agree, apply] in the state-dict loads (issue 11): when one rank
// rejects its dict, every rank throws naming that rank and its problem, and no rank changes anything.
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

}  // namespace
}  // namespace fsdp::testing
