// The one shape of every load that writes into several ranks' state: validate, agree, apply.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include <c10/util/Exception.h>

#include "util.h"

namespace fsdp::detail {

// [Note: validate, agree, apply]
// set_model_state_dict, set_optimizer_state_dict, set_state_dict and dcp::load write into the state of
// every rank of a job. They must change all ranks or none: a rank that applied a load another rank
// rejected would train on from a different step, its replicas silently diverged, or hang the next
// collective. So each runs in three phases:
//   1. validate: every rank checks its whole input against its destinations and stages what it will
//      copy (closures, or views of verified file bytes), changing nothing. An exception here becomes
//      this rank's problem, a message.
//   2. agree: the ranks exchange their problems, so that every rank learns the lowest failing rank
//      and its message. Every rank takes part whether or not it failed (it runs the same
//      communication in the same order: no rank waits for one that gave up). The state dicts agree
//      through collectives on the model's group (one all-reduce when nothing failed); dcp::load through
//      the group's store (see checkpoint/coordinator.h), which is also what its async save uses.
//   3. apply: when no rank failed, every rank copies what it staged (under NoGradGuard). Otherwise
//      every rank throws: a failing rank its own message, the others the first failing rank's, named
//      ("<api>: rank 1 failed: ..."); both end "(nothing was loaded on any rank)".
// validate_agree_apply() below is that sequence; each load supplies the phases.

/// The first failing rank of a load and its message.
struct Failure {
  int rank = 0;
  std::string message;
};

/// Phase 2: every rank passes its problem ("" when it validated); every rank gets the first failure,
/// or nullopt when every rank validated. A collective call: every rank of the group makes it.
using Agree = std::function<std::optional<Failure>(const std::string& problem)>;

/// Runs validate(), agrees through `agree`, then runs apply() on every rank, or throws c10::Error on
/// every rank (see [Note: validate, agree, apply]). `api` prefixes messages, e.g. "dcp::load".
template <typename Validate, typename Apply>
void validate_agree_apply(const char* api, Validate&& validate, const Agree& agree, Apply&& apply) {
  std::string problem;
  try {
    validate();
  } catch (const c10::Error& e) {
    problem = message_of(e);
  } catch (const std::exception& e) {
    problem = std::string(api) + ": " + e.what();
  } catch (...) {
    problem = std::string(api) + ": an unknown exception";
  }
  const std::optional<Failure> failure = agree(problem);
  TORCH_CHECK(problem.empty(), problem, " (nothing was loaded on any rank)");
  if (failure) {
    TORCH_CHECK(false, api, ": rank ", failure->rank, " failed: ", failure->message,
                " (nothing was loaded on any rank)");
  }
  apply();
}

}  // namespace fsdp::detail
