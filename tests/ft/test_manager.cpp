// fsdp::ft::Manager (include/fsdp/ft/manager.h, [Note: replica quorum]): replica groups of fully_shard ranks
// (threads here: each replica group is run_ranks_collect's group of S ranks, all sharing one in-memory store
// as TorchFT's lighthouse) that lose a replica group mid-run and heal its restarted incarnation from a live
// one, compared bit for bit with a run that lost nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include "error_message.h"
#include "fsdp/fsdp.h"
#include "fsdp_test_model.h"
#include "fully_shard_test_util.h"
#include "multi_rank.h"

namespace {

using namespace fsdp;
using namespace fsdp::testing;

constexpr int kS = 2;            // ranks per replica group
constexpr int kR = 2;            // replica groups
constexpr int kSteps = 6;
constexpr int64_t kRows = 2;     // rows of the global batch per rank

// Where a replica group's first incarnation stops (as if its host died).
enum class Death { kNone, kBeforeAllreduce, kBeforeVote, kAfterCommit };

struct Trace {
  std::mutex mu;
  std::map<std::tuple<int, int, int64_t>, float> losses;           // (replica, rank, step) -> loss
  std::map<std::pair<int, int>, std::map<std::string, torch::Tensor>> finals;  // (replica, rank) -> state
  std::map<std::pair<int, int>, std::vector<ft::QuorumInfo>> heals;          // quorums that healed
  std::map<std::pair<int, int>, std::string> notes;                          // free-form per rank
};

// A model with the initial weights of `seed`. Made under a lock: the global generator is shared by the rank
// threads, and a model built on one while another seeds it would take some of its numbers.
// `big`: an extra 16 MiB parameter the forward does not use, so that a heal's state spans several 8 MiB chunks.
Net make_net(uint64_t seed, int blocks = 2, bool big = false) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  Net net(blocks);
  if (big) net->register_parameter("big", torch::randn({1024, 4096}));
  return net;
}

// This rank's tensors of its state dict (local pieces), by key.
std::map<std::string, torch::Tensor> local_state(const StateDict& sd) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [k, v] : sd) {
    if (const auto* dt = std::get_if<DTensor>(&v)) out[k] = dt->to_local().detach().clone();
    else if (const auto* t = std::get_if<torch::Tensor>(&v)) out[k] = t->detach().clone();
  }
  return out;
}

// The options every test gives: the shared store, this replica group's group and id, kR replica groups, and
// the model's and optimizer's state as what a heal moves.
ft::ManagerOptions base_options(const c10::intrusive_ptr<c10d::Store>& store, const ProcessGroupPtr& group,
                                int replica, Net& net, torch::optim::AdamW& opt) {
  ft::ManagerOptions o;
  o.store = store;
  o.replica_group = group;
  o.replica_id = replica;
  o.num_replica_groups = kR;
  o.state_dict = [&net, &opt] { return get_state_dict(net, opt); };
  o.load_state_dict = [&net, &opt](const StateDict& sd) { set_state_dict(net, opt, sd); };
  return o;
}

struct RankPlan {
  int replica = 0;
  uint64_t seed = 7;                 // initial weights (a healed replica group's own are overwritten)
  Death death = Death::kNone;
  int64_t die_at = -1;               // the step at which the first incarnation stops
  int min_replica_size = kR;
  std::function<void(int64_t)> after_heal_send;  // on the donor
  int blocks = 2;
  bool big = false;  // see make_net
  std::function<void(int64_t)> before_step;  // called before each start_quorum with current_step()
  // With min_replica_size < kR a live replica group that arrives this much later than the other is left out
  // (and healed again): long enough for a loaded machine.
  std::chrono::milliseconds join_timeout{1500};
};

// One rank of one replica group: fully_shard over `group`, AdamW, the Manager's step loop.
// Returns normally at kSteps, or early where the plan says it dies.
void train_rank(const ProcessGroupPtr& group, const c10::intrusive_ptr<c10d::Store>& lighthouse,
                const std::vector<Batch>& batches, const RankPlan& plan, Trace& trace) {
  Net net = make_net(plan.seed, plan.blocks, plan.big);
  auto mesh = init_device_mesh(torch::kCPU, {group->size()});
  auto opts = FullyShardOptions().mesh(mesh);
  for (auto& b : net->blocks) fully_shard(b, opts);
  fully_shard(net, opts);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  ft::ManagerOptions o = base_options(lighthouse, group, plan.replica, net, opt);
  o.min_replica_size = plan.min_replica_size;
  o.join_timeout = plan.join_timeout;
  // Also how long a vote waits for a rank that died after its last collective (Death::kBeforeVote).
  o.timeout = std::chrono::seconds(8);
  o.quorum_timeout = std::chrono::seconds(40);
  o.after_heal_send = plan.after_heal_send;
  ft::Manager manager(o);
  const int s = group->rank();
  while (manager.current_step() < kSteps) {
    if (plan.before_step) plan.before_step(manager.current_step());
    manager.start_quorum();
    const int64_t step = manager.current_step();
    if (!manager.last_quorum().joiners.empty()) {
      std::lock_guard<std::mutex> lock(trace.mu);
      trace.heals[{plan.replica, s}].push_back(manager.last_quorum());
    }
    if (plan.death == Death::kBeforeAllreduce && step == plan.die_at) return;
    // This replica group's part of the global batch, then this rank's rows of it.
    const int64_t p = manager.participant_index(), n = manager.num_participants();
    const auto& b = batches[static_cast<size_t>(step)];
    const int64_t per_replica = b.idx.size(0) / n;
    auto mine = b.slice(p * per_replica + s * kRows, kRows);
    auto loss = loss_fn(net->forward(mine.idx), mine.targets);
    loss.backward();
    std::vector<torch::Tensor> grads;
    for (auto& q : net->parameters())
      if (q.grad().defined()) grads.push_back(q.grad());
    manager.allreduce(grads);
    if (plan.death == Death::kBeforeVote && step == plan.die_at) return;
    if (manager.should_commit()) {
      opt.step();
      std::lock_guard<std::mutex> lock(trace.mu);
      trace.losses[{plan.replica, s, step}] = loss.item<float>();
    }
    opt.zero_grad();
    // Between steps: no step of the others fails; they find it missing at their next quorum.
    if (plan.death == Death::kAfterCommit && step == plan.die_at) return;
  }
  auto final_state = local_state(get_state_dict(net, opt));
  std::lock_guard<std::mutex> lock(trace.mu);
  trace.finals[{plan.replica, s}] = std::move(final_state);
}

// Runs one replica group (S ranks as threads) on a thread of its own; its ranks' errors land in `errors`.
std::thread start_replica(const c10::intrusive_ptr<c10d::Store>& lighthouse, const std::vector<Batch>& batches,
                          RankPlan plan, Trace& trace, std::vector<std::string>& errors) {
  return std::thread([&, plan] {
    errors = run_ranks_collect(kS, [&](ProcessGroupPtr g) { train_rank(g, lighthouse, batches, plan, trace); },
                               std::chrono::seconds(150));
  });
}

c10::intrusive_ptr<c10d::Store> lighthouse() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(30));
  return store;
}

void expect_no_errors(const std::vector<std::string>& errors, const std::string& who) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << who << ", rank " << r;
}

void expect_same_state(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [k, t] : a) {
    ASSERT_TRUE(b.count(k)) << what << ": " << k;
    EXPECT_TRUE(torch::equal(t, b.at(k))) << what << ": " << k << " differs (max |diff| "
                                          << max_abs_diff(t.to(torch::kDouble), b.at(k).to(torch::kDouble)) << ")";
  }
}

// The uninterrupted run: both replica groups from the start (replica group 1 initialised differently and
// healed at round 0), kSteps steps.
Trace& uninterrupted(const std::vector<Batch>& batches) {
  static Trace trace;
  static bool done = false;
  if (done) return trace;
  auto store = lighthouse();
  std::vector<std::string> e0, e1;
  auto t0 = start_replica(store, batches, RankPlan{.replica = 0, .seed = 7}, trace, e0);
  auto t1 = start_replica(store, batches, RankPlan{.replica = 1, .seed = 8}, trace, e1);
  t0.join();
  t1.join();
  expect_no_errors(e0, "uninterrupted replica group 0");
  expect_no_errors(e1, "uninterrupted replica group 1");
  done = true;
  return trace;
}

std::vector<Batch> global_batches() { return make_batches(kSteps, kR * kS * kRows, 4, 99); }

// Parity with one process: the uninterrupted run (2 replica groups x 2 ranks, each rank 2 of the global batch's 8
// rows; wte [11, 6] sharded 6/5 and scale [1] 1/0 over a replica group's 2 ranks) ends with the parameters one
// process gets training on the whole batches (run_reference: same initial weights, same AdamW), within 1e-5.
TEST(FtManager, ReplicaGroupsTrainAsOneProcess) {
  const auto batches = global_batches();
  Trace& trace = uninterrupted(batches);
  const Reference ref = run_reference(batches);
  for (int r = 0; r < kR; ++r) {
    for (const auto& [name, full] : ref.final_params) {
      const std::string key = "model." + name;
      ASSERT_TRUE(trace.finals[std::make_pair(r, 0)].count(key)) << key;
      auto mine = torch::cat({trace.finals[std::make_pair(r, 0)].at(key), trace.finals[std::make_pair(r, 1)].at(key)});
      EXPECT_LT(max_abs_diff(mine, full), 1e-5) << "replica group " << r << ": " << name;
    }
  }
}

class FtManagerDeath : public ::testing::TestWithParam<Death> {};

// Replica group 1 dies at step 3: before its gradients are averaged (the survivor's average fails), after
// it (the survivor's vote times out), or once step 3 committed (no step fails: the survivor finds it missing
// at the next quorum, and the restarted one, with the same id, must not be taken for it). Replica group 0
// keeps its state and waits (min_replica_size 2); replica group 1 starts again with other initial weights,
// is healed from replica group 0, and the run goes on: every loss and the final state of every rank equal
// the uninterrupted run's bit for bit.
TEST_P(FtManagerDeath, LostReplicaGroupIsHealedFromALiveOneAndTrainsAsAnUninterruptedRun) {
  const auto batches = global_batches();
  Trace& ref = uninterrupted(batches);
  ASSERT_EQ(ref.finals.size(), static_cast<size_t>(kR * kS));
  // Round 0 healed replica group 1 from replica group 0: the two hold the same state from the start.
  for (int s = 0; s < kS; ++s) {
    ASSERT_EQ(ref.heals[std::make_pair(1, s)].size(), 1u);
    EXPECT_EQ(ref.heals[std::make_pair(1, s)][0].round, 0);
    EXPECT_EQ(ref.heals[std::make_pair(1, s)][0].donor, 0);
    expect_same_state(ref.finals[{0, s}], ref.finals[{1, s}], "uninterrupted: replica groups 0 and 1, rank " + std::to_string(s));
  }

  Trace trace;
  auto store = lighthouse();
  std::vector<std::string> e0, e1a, e1b;
  auto t0 = start_replica(store, batches, RankPlan{.replica = 0, .seed = 7}, trace, e0);
  auto t1 = start_replica(store, batches, RankPlan{.replica = 1, .seed = 8, .death = GetParam(), .die_at = 3}, trace, e1a);
  t1.join();  // the first incarnation of replica group 1 is gone
  expect_no_errors(e1a, "replica group 1 before its death");
  auto t1b = start_replica(store, batches, RankPlan{.replica = 1, .seed = 9}, trace, e1b);
  t0.join();
  t1b.join();
  expect_no_errors(e0, "replica group 0 (the survivor)");
  expect_no_errors(e1b, "replica group 1 (restarted)");

  for (int s = 0; s < kS; ++s) {
    // The restart's heal: at the step it died in, from replica group 0, with every byte of the state.
    const auto& heals = trace.heals[{1, s}];
    ASSERT_EQ(heals.size(), 2u) << "rank " << s << ": round 0's heal and the restart's";
    EXPECT_EQ(heals[1].step, GetParam() == Death::kAfterCommit ? 4 : 3);
    EXPECT_EQ(heals[1].donor, 0);
    EXPECT_EQ(heals[1].joiners, std::vector<int>{1});
    EXPECT_TRUE(heals[1].new_group);
    EXPECT_GT(heals[1].heal_bytes, 0);
    for (int r = 0; r < kR; ++r) {
      expect_same_state(trace.finals[{r, s}], ref.finals[{r, s}],
                        "replica group " + std::to_string(r) + ", rank " + std::to_string(s) + " vs the uninterrupted run");
      for (int64_t t = 0; t < kSteps; ++t) {
        ASSERT_TRUE(trace.losses.count(std::make_tuple(r, s, t))) << "no committed loss at step " << t << ", replica group " << r;
        EXPECT_EQ(trace.losses[std::make_tuple(r, s, t)], ref.losses[std::make_tuple(r, s, t)]) << "step " << t << ", replica group " << r << ", rank " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Deaths, FtManagerDeath,
                         ::testing::Values(Death::kBeforeAllreduce, Death::kBeforeVote, Death::kAfterCommit),
                         [](const auto& info) {
                           switch (info.param) {
                             case Death::kBeforeAllreduce: return std::string("BeforeAllreduce");
                             case Death::kBeforeVote: return std::string("BeforeVote");
                             default: return std::string("AfterCommit");
                           }
                         });

// The registration of replica group 1's first incarnation (set by the test below once it is gone; read by
// the survivor's threads).
struct FirstRegistration {
  std::mutex mu;
  std::string reg;
  void set(std::string r) {
    std::lock_guard<std::mutex> lock(mu);
    reg = std::move(r);
  }
  std::string get() {
    std::lock_guard<std::mutex> lock(mu);
    return reg;
  }
};

// min_replica_size 1: replica group 0 trains on alone once replica group 1 is lost (after join_timeout), and
// replica group 1, started again later, joins mid-run, is healed, and ends with the same state bit for bit.
TEST(FtManager, SurvivorTrainsAloneAndTheLostReplicaGroupRejoinsMidRun) {
  const auto batches = global_batches();
  Trace trace;
  auto store = lighthouse();
  std::vector<std::string> e0, e1a, e1b;
  // Replica group 0 holds before step 4 until the restarted replica group 1 has registered (on a loaded
  // machine it could otherwise finish first), so that it is admitted at step 4 or 5.
  FirstRegistration first;
  RankPlan survivor{.replica = 0, .seed = 7, .min_replica_size = 1, .join_timeout = std::chrono::seconds(4)};
  survivor.before_step = [&](int64_t step) {
    if (step != 4) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
      if (store->check({"ft/joining/1"})) {
        const auto v = store->get("ft/joining/1");
        const std::string reg(v.begin(), v.end());
        const std::string old = first.get();
        if (!old.empty() && reg != old && store->add("ft/join/1/" + reg + "/n", 0) == kS) return;
      }
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "the restarted replica group 1 never registered");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  auto t0 = start_replica(store, batches, survivor, trace, e0);
  auto t1 = start_replica(store, batches,
                          RankPlan{.replica = 1, .seed = 8, .death = Death::kBeforeAllreduce, .die_at = 1,
                                   .min_replica_size = 1, .join_timeout = std::chrono::seconds(4)},
                          trace, e1a);
  t1.join();
  {
    const auto v = store->get("ft/joining/1");  // the first incarnation's registration (it took part in round 0)
    first.set(std::string(v.begin(), v.end()));
  }
  // Replica group 0 alone commits steps 1-3 before replica group 1 comes back.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(trace.mu);
      if (trace.losses.count(std::make_tuple(0, 0, int64_t{3}))) break;
    }
    if (std::chrono::steady_clock::now() > deadline) {  // (not ASSERT: the threads must still be joined)
      ADD_FAILURE() << "replica group 0 did not train on alone";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto t1b = start_replica(store, batches,
                           RankPlan{.replica = 1, .seed = 9, .min_replica_size = 1, .join_timeout = std::chrono::seconds(4)},
                           trace, e1b);
  t0.join();
  t1b.join();
  expect_no_errors(e0, "replica group 0");
  expect_no_errors(e1a, "replica group 1 before its death");
  expect_no_errors(e1b, "replica group 1 (restarted)");
  for (int s = 0; s < kS; ++s) {
    const auto& heals = trace.heals[std::make_pair(1, s)];
    ASSERT_EQ(heals.size(), 2u) << "rank " << s << ": round 0's heal and the rejoin's";
    EXPECT_GE(heals[1].step, 4);
    EXPECT_LT(heals[1].step, kSteps);
    expect_same_state(trace.finals[std::make_pair(1, s)], trace.finals[std::make_pair(0, s)],
                      "replica groups 1 (rejoined) and 0, rank " + std::to_string(s));
    for (int64_t t = 0; t < kSteps; ++t) EXPECT_TRUE(trace.losses.count(std::make_tuple(0, s, t))) << "step " << t;
  }
}

// The donor dies after sending 2 of the heal's 3 chunks (24 MiB per rank: the big parameter and its AdamW
// state): the joiner never loads a part of the state (its parameters are still its own initial ones), and
// with no holder of the state left every rank of it reports the state lost, naming the fix (a checkpoint).
TEST(FtManager, DonorDyingMidCopyLeavesTheJoinerUntouchedAndReportsTheStateLost) {
  const auto batches = global_batches();
  Trace trace;
  auto store = lighthouse();
  std::vector<std::string> e0, e1a, e1b;
  RankPlan donor{.replica = 0, .seed = 7, .big = true};
  std::atomic<int> chunks{0};
  donor.after_heal_send = [&](int64_t i) {
    chunks = std::max<int>(chunks, static_cast<int>(i) + 1);
    if (i == 1) throw std::runtime_error("donor killed mid-copy");
  };
  auto t0 = start_replica(store, batches, donor, trace, e0);
  // Replica group 1 is the round-0 joiner: the donor dies while healing it.
  auto t1 = std::thread([&] {
    e1a = run_ranks_collect(kS, [&](ProcessGroupPtr g) {
      Net net = make_net(8, 2, /*big=*/true);
      auto mesh = init_device_mesh(torch::kCPU, {g->size()});
      for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
      fully_shard(net, FullyShardOptions().mesh(mesh));
      torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
      const auto before = local_state(get_state_dict(net, opt));
      ft::ManagerOptions o = base_options(store, g, 1, net, opt);
      o.min_replica_size = 1;
      o.join_timeout = std::chrono::milliseconds(1500);
      o.timeout = std::chrono::seconds(8);
      o.quorum_timeout = std::chrono::seconds(4);  // how long the lost state is waited for
      ft::Manager manager(o);
      manager.start_quorum();
      EXPECT_TRUE(manager.errored().has_value());
      EXPECT_NE(manager.errored().value_or("").find("healing in round 0 (donor replica group 0)"), std::string::npos)
          << manager.errored().value_or("");
      EXPECT_FALSE(manager.should_commit());
      expect_same_state(local_state(get_state_dict(net, opt)), before, "the joiner after a failed heal (model and optimizer)");
      manager.start_quorum();  // throws: the state is lost
    });
  });
  t0.join();
  t1.join();
  EXPECT_EQ(chunks, 2);  // the death came mid-copy, after the 2nd chunk
  for (int s = 0; s < kS; ++s) {
    EXPECT_NE(e0[s].find("donor killed mid-copy"), std::string::npos) << e0[s];
    EXPECT_NE(e1a[s].find("the state is lost: no replica group that holds the state of step 0 reached round 1"),
              std::string::npos)
        << e1a[s];
    EXPECT_NE(e1a[s].find("Resume every replica group from a checkpoint"), std::string::npos) << e1a[s];
  }
}

// A joiner whose model differs from the donor's is not loaded: the heal names the first entry that differs;
// the failure repeats at every step, and after max_retries (3) steps in a row every rank of both replica
// groups stops, naming it (never an endless retry).
TEST(FtManager, JoinerWithAnotherModelIsRefusedNamingTheEntryAndRetriesStop) {
  auto store = lighthouse();
  std::vector<std::string> e0, e1;
  std::vector<std::string> why(kS);
  auto run = [&](int replica, int blocks, std::vector<std::string>& errors) {
    return std::thread([&, replica, blocks] {
      errors = run_ranks_collect(kS, [&](ProcessGroupPtr g) {
        Net net = make_net(7 + replica, blocks);
        auto mesh = init_device_mesh(torch::kCPU, {g->size()});
        fully_shard(net, FullyShardOptions().mesh(mesh));
        torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
        ft::ManagerOptions o = base_options(store, g, replica, net, opt);
        o.min_replica_size = 2;
        o.max_retries = 3;
        ft::Manager manager(o);
        for (;;) {
          manager.start_quorum();  // throws after 3 failed steps
          if (replica == 1 && why[static_cast<size_t>(g->rank())].empty()) {
            why[static_cast<size_t>(g->rank())] = manager.errored().value_or("");
          }
          EXPECT_FALSE(manager.should_commit());
        }
      });
    });
  };
  auto t0 = run(0, 2, e0);
  auto t1 = run(1, 3, e1);
  t0.join();
  t1.join();
  for (int s = 0; s < kS; ++s) {
    EXPECT_NE(why[s].find("every replica group must build the same model and optimizer"), std::string::npos) << why[s];
    EXPECT_NE(why[s].find("on the donor (replica group 0)"), std::string::npos) << why[s];
    for (const auto* e : {&e0[s], &e1[s]}) {
      EXPECT_NE(e->find("3 steps in a row did not commit (max_retries); the last failure: "), std::string::npos) << *e;
      EXPECT_NE(e->find("every replica group must build the same model"), std::string::npos) << *e;
    }
  }
}

TEST(FtManager, BadOptionsAreRefused) {
  run_ranks(1, [](ProcessGroupPtr g) {
    ft::ManagerOptions o;
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("ManagerOptions::store is required"), std::string::npos);
    o.store = lighthouse();
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("ManagerOptions::replica_group is required"), std::string::npos);
    o.replica_group = g;
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("num_replica_groups must be positive, got 0"), std::string::npos);
    o.num_replica_groups = 2;
    o.replica_id = 2;
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("replica_id 2 is outside [0, 2)"), std::string::npos);
    o.replica_id = 0;
    o.min_replica_size = 3;
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("min_replica_size 3 is outside [1, num_replica_groups = 2]"),
              std::string::npos);
    o.min_replica_size = 1;
    o.max_retries = 0;
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("max_retries must be positive, got 0"), std::string::npos);
    o.max_retries = 1;
    EXPECT_NE(error_message([&] { ft::Manager m(o); }).find("state_dict and load_state_dict are required"), std::string::npos);
  });
}

// One replica group alone (min_replica_size 1): no heal, no collective, steps commit. Once it shut down, a
// replica group that joins is told the job finished (JobFinished) instead of waiting for a quorum.
TEST(FtManager, OneReplicaGroupTrainsAloneAndALateJoinerIsToldTheJobFinished) {
  const auto batches = global_batches();
  auto store = lighthouse();
  run_ranks(kS, [&](ProcessGroupPtr g) {
    Net net = make_net(7);
    auto mesh = init_device_mesh(torch::kCPU, {g->size()});
    fully_shard(net, FullyShardOptions().mesh(mesh));
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    ft::ManagerOptions o = base_options(store, g, 0, net, opt);
    o.join_timeout = std::chrono::milliseconds(200);
    ft::Manager manager(o);
    for (int i = 0; i < 2; ++i) {
      manager.start_quorum();
      EXPECT_EQ(manager.num_participants(), 1);
      EXPECT_TRUE(manager.last_quorum().joiners.empty());
      EXPECT_TRUE(manager.should_commit());
    }
    EXPECT_EQ(manager.current_step(), 2);
    manager.shutdown();
  });
  run_ranks(kS, [&](ProcessGroupPtr g) {
    Net net = make_net(8);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    ft::ManagerOptions o = base_options(store, g, 1, net, opt);
    ft::Manager manager(o);
    try {
      manager.start_quorum();
      ADD_FAILURE() << "a joiner of a finished job was admitted";
    } catch (const ft::JobFinished& e) {
      EXPECT_NE(std::string(e.what()).find("the job finished at step 2 before this replica group was admitted"),
                std::string::npos) << e.what();
    }
  });
}

}  // namespace
