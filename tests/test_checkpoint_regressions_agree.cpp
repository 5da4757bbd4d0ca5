// Regressions of [Note: validate, agree, apply] in dcp::load (issue 11): when one rank cannot read its
// part, every rank throws naming that rank and its problem, also when it is rank 0 (whose message the
// others used to get unnamed), and nothing changes.
#include <gtest/gtest.h>

#include "agreed_failure.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

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
