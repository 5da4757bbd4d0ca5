// fully_shard on unchanged LibTorch models (issue 13; CTest label: unchanged_models), the features the
// other two files of this binary do not cover: Join with uneven inputs, debug mode with ranks that
// disagree, explicit forward/backward prefetch, HSDP and CPUOffloadPolicy, reshard_after_forward as an
// int, and the outside-forward semantics (a full read between steps; SGD with momentum and weight
// decay, Adam with weight decay stepping the shards). Each on the plain-LibTorch PlainNet
// (unchanged_models.h) against the single-process reference and, where the holder path runs the same
// collectives, bit-identically against the same model declared with holders (fsdp_test_model.h's Net).
// RegressionsZeroGrad: zero_grad() after a read or an evaluation forward clears the gradient (a bug of
// both paths found here, fixed with issue 13).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "fsdp/algorithms/join.h"
#include "unchanged_models.h"

namespace fsdp::testing {
namespace {

using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
using OptFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<torch::Tensor>&)>;

OptFactory adamw() {
  return [](const std::vector<torch::Tensor>& p) { return make_optimizer(p, Opt::ADAMW); };
}

// ---- Builders --------------------------------------------------------------------------------------

struct Config {
  std::vector<int64_t> mesh;  // empty: 1-D over every rank; {2, 2}: HSDP (replicate, shard)
  std::optional<ReshardAfterForward> block_raf;
  bool offload = false;
  OptFactory opt = adamw();
};

FullyShardOptions options_of(const ProcessGroupPtr& pg, const Config& s) {
  auto mesh = s.mesh.size() == 2 ? init_device_mesh(torch::kCPU, s.mesh, {"replicate", "shard"})
                                 : init_device_mesh(torch::kCPU, {pg->size()});
  auto o = FullyShardOptions().mesh(mesh);
  if (s.offload) o.offload_policy(CPUOffloadPolicy().pin_memory(false));
  return o;
}

// The unchanged model (initial_weights(): the parameter names of Net), blocks then the root.
Model plain_sharded(const ProcessGroupPtr& pg, const Config& s, PlainNet* out = nullptr) {
  PlainNet net;
  load_full(*net, initial_weights());
  auto opts = options_of(pg, s);
  for (size_t i = 0; i < net->blocks->size(); ++i) {
    fully_shard(net->blocks[i], FullyShardOptions(opts).reshard_after_forward(s.block_raf));
  }
  fully_shard(net, opts);
  if (out) *out = net;
  return as_model(net);
}

// The same model with holders, sharded the same way.
Model holder_sharded(const ProcessGroupPtr& pg, const Config& s, Net* out = nullptr) {
  Net net;
  load_full(*net, initial_weights());
  FSDPModule<Net> model(net);
  auto opts = options_of(pg, s);
  for (auto& b : net->blocks) fully_shard(b, FullyShardOptions(opts).reshard_after_forward(s.block_raf));
  fully_shard(net, opts);
  if (out) *out = net;
  return {net.ptr(), [model](const torch::Tensor& x) mutable { return model(x); }};
}

Model plain_reference() {
  PlainNet net;
  load_full(*net, initial_weights());
  return as_model(net);
}

/// Single-process run with `opt`; also the full parameters after every step.
struct RefRun {
  Reference ref;
  std::vector<std::map<std::string, torch::Tensor>> params_after;
};
RefRun reference_with(const OptFactory& make_opt, const std::vector<Batch>& batches) {
  Model m = plain_reference();
  auto opt = make_opt(m.module->parameters());
  RefRun out;
  for (const auto& b : batches) {
    opt->zero_grad();
    auto loss = loss_fn(m.forward(b.idx), b.targets);
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    for (const auto& p : m.module->named_parameters()) grads[p.key()] = p.value().grad().clone();
    out.ref.grads.push_back(std::move(grads));
    opt->step();
    out.ref.losses.push_back(loss.item<float>());
    out.params_after.push_back(snapshot(*m.module));
  }
  out.ref.final_params = snapshot(*m.module);
  return out;
}

/// train_sharded with any optimizer and a callback after every step (every rank, same order).
Trace train_with(const Model& m, const ProcessGroupPtr& pg, const std::vector<Batch>& batches,
                 const OptFactory& make_opt,
                 const std::function<void(size_t)>& after_step = nullptr) {
  const int64_t local = batches.at(0).idx.size(0) / pg->size();
  auto opt = make_opt(m.module->parameters());
  Trace t;
  for (size_t s = 0; s < batches.size(); ++s) {
    auto b = batches[s].slice(pg->rank() * local, local);
    opt->zero_grad();
    auto loss = loss_fn(m.forward(b.idx), b.targets);
    loss.backward();
    t.grads.push_back(full_grads(*m.module));
    opt->step();
    t.losses.push_back(global_loss(loss, *pg));
    if (after_step) after_step(s);
  }
  t.final_params = full_params(*m.module);
  return t;
}

/// Both paths on `ws` ranks with setup `s`: bit-identical traces, and the unchanged one matches the
/// reference. Every group of the unchanged model is implicit, none of the holder model's.
void plain_vs_holder_vs_reference(int ws, const Config& s, const std::string& what, int steps = 3) {
  auto batches = make_batches(steps, kBatch, kSeq);
  auto ref = reference_with(s.opt, batches);
  std::vector<Trace> plain(ws), holder(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net hnet{nullptr};
    Model h = holder_sharded(pg, s, &hnet);
    EXPECT_FALSE(is_implicit(fsdp_api(hnet->blocks[0])));
    holder[pg->rank()] = train_with(h, pg, batches, s.opt);
    PlainNet pnet{nullptr};
    Model p = plain_sharded(pg, s, &pnet);
    EXPECT_TRUE(is_implicit(fsdp_api(*pnet->blocks[0])));
    EXPECT_TRUE(is_implicit(fsdp_api(pnet)));
    plain[pg->rank()] = train_with(p, pg, batches, s.opt);
  });
  for (int r = 0; r < ws; ++r) {
    EXPECT_EQ(plain[r].losses.size(), static_cast<size_t>(steps)) << what << ", rank " << r;
    EXPECT_EQ(diff_traces(plain[r], holder[r]), "") << what << ": unchanged vs holder path, rank " << r;
    expect_parity(plain[r], ref.ref, what + ", rank " + std::to_string(r));
  }
}

class UnchangedMore : public ::testing::TestWithParam<int> {};  // world size

// ---- 1. Join with uneven inputs ----------------------------------------------------------------------
// Rank r trains on its slice of the first n(r) global batches (2 ranks: 3, 2; 3 ranks: 3, 1, 0 -- the
// last rank never trains and shadows from the start, lazy init included); SGD (its update keeps the
// gradient's scale, which tells the divide factor apart). Reference: each step sums the losses of the
// ranks still training and divides by the initial world size or by those ranks.

int join_batches(int rank, int ws) {
  static const std::vector<int> two{3, 2}, three{3, 1, 0};
  return (ws == 2 ? two : three).at(rank);
}

struct JoinRun {
  std::vector<std::map<std::string, torch::Tensor>> local_grads;  // this rank's steps
  std::map<std::string, torch::Tensor> final_params;
};

void run_join_case(int ws, bool divide_by_initial) {
  const std::string what =
      std::to_string(ws) + " ranks, divide_by_initial_world_size " + std::to_string(divide_by_initial);
  auto batches = make_batches(3, kBatch, kSeq);
  const int64_t local = kBatch / ws;
  // Reference.
  Model ref = plain_reference();
  torch::optim::SGD ref_opt(ref.module->parameters(), 0.1);
  std::vector<std::map<std::string, torch::Tensor>> ref_grads;
  for (int s = 0; s < 3; ++s) {
    ref_opt.zero_grad();
    torch::Tensor sum;
    int active = 0;
    for (int r = 0; r < ws; ++r) {
      if (s >= join_batches(r, ws)) continue;
      ++active;
      auto b = batches[s].slice(r * local, local);
      auto l = loss_fn(ref.forward(b.idx), b.targets);
      sum = sum.defined() ? sum + l : l;
    }
    (sum / (divide_by_initial ? ws : active)).backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : ref.module->named_parameters()) g[p.key()] = p.value().grad().clone();
    ref_grads.push_back(g);
    ref_opt.step();
  }
  const auto ref_final = snapshot(*ref.module);

  std::vector<JoinRun> plain(ws), holder(ws);
  std::vector<uint64_t> plain_ag(ws), holder_ag(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    auto run = [&](const Model& m, JoinRun& out, uint64_t& ag) {
      torch::optim::SGD opt(m.module->parameters(), 0.1);
      auto sample = batches[0].slice(rank * local, local);
      FSDPJoinable joinable(m.module, opt, [&] { return loss_fn(m.forward(sample.idx), sample.targets); });
      const auto ag0 = pg->collective_count("all_gather_into_tensor");
      {
        Join join({&joinable}, JoinOptions().divide_by_initial_world_size(divide_by_initial));
        for (int s = 0; s < join_batches(rank, ws); ++s) {
          join.notify_join_context(joinable);
          auto b = batches[s].slice(rank * local, local);
          opt.zero_grad();
          loss_fn(m.forward(b.idx), b.targets).backward();
          std::map<std::string, torch::Tensor> g;
          for (const auto& p : m.module->named_parameters()) {
            if (p.value().grad().defined()) g[p.key()] = p.value().grad().clone();
          }
          out.local_grads.push_back(g);
          opt.step();
        }
      }
      ag = pg->collective_count("all_gather_into_tensor") - ag0;
      out.final_params = full_params(*m.module);
    };
    Net hnet{nullptr};
    run(holder_sharded(pg, {}, &hnet), holder[rank], holder_ag[rank]);
    PlainNet pnet{nullptr};
    run(plain_sharded(pg, {}, &pnet), plain[rank], plain_ag[rank]);
    // This rank's gradient shards of the steps it trained itself: the reference's.
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (size_t s = 0; s < plain[rank].local_grads.size(); ++s) {
      EXPECT_EQ(plain[rank].local_grads[s].size(), ref_grads[s].size()) << what << ": gradients at step " << s;
      for (const auto& [k, g] : plain[rank].local_grads[s]) {
        auto expect = distribute_tensor(ref_grads[s].at(k), mesh, {Shard(0)}).to_local();
        EXPECT_TRUE(torch::allclose(g, expect, kGradRtol, kGradAtol))
            << what << ": gradient of " << k << " at step " << s << " on rank " << rank << ": max |diff| "
            << max_abs_diff(g, expect);
      }
    }
  });
  for (int r = 0; r < ws; ++r) {
    EXPECT_EQ(plain[r].local_grads.size(), static_cast<size_t>(join_batches(r, ws))) << what;
    EXPECT_EQ(plain_ag[r], holder_ag[r]) << what << ": all-gathers (joined ranks shadow the same), rank " << r;
    for (size_t s = 0; s < plain[r].local_grads.size(); ++s) {
      Trace a, b;
      a.final_params = plain[r].local_grads[s];
      b.final_params = holder[r].local_grads.at(s);
      EXPECT_EQ(diff_traces(a, b), "") << what << ": gradient shards at step " << s << " vs holder path, rank " << r;
    }
    Trace a, b;
    a.final_params = plain[r].final_params;
    b.final_params = holder[r].final_params;
    EXPECT_EQ(diff_traces(a, b), "") << what << ": final parameters vs holder path, rank " << r;
    EXPECT_EQ(a.final_params.size(), ref_final.size()) << what;
    for (const auto& [k, p] : ref_final) {
      auto it = a.final_params.find(k);
      if (it == a.final_params.end()) continue;
      EXPECT_TRUE(torch::allclose(it->second, p, kRtol, kAtol))
          << what << ": final " << k << " rank " << r << ": max |diff| " << max_abs_diff(it->second, p);
    }
  }
}

TEST_P(UnchangedMore, JoinUnevenInputsMatchesReferenceAndHolderPath) {
  run_join_case(GetParam(), /*divide_by_initial=*/true);
  run_join_case(GetParam(), /*divide_by_initial=*/false);
}

// ---- 3. Explicit prefetch ------------------------------------------------------------------------------
// All-gathers seen at the taps (after wte and after each block in forward; when the gradient of those
// activations arrives in backward) with explicit prefetch lists. Forward prefetch is implicit from the
// second iteration on (the recorded order) and backward prefetch implicit always, so an empty list is
// a real setting ("no prefetch").

enum class Prefetch { NONE, ROOT_ALL, CHAIN };

struct PrefetchCounts {
  std::vector<uint64_t> forward;   // all-gathers at tap(-1), tap(0), tap(1)
  std::vector<uint64_t> backward;  // all-gathers when the gradients of tap(1), tap(0), tap(-1) arrive
  uint64_t forward_total = 0, backward_total = 0;
};

template <typename Blocks>
void set_prefetch(FSDPModuleAPI root, const Blocks& blocks, Prefetch p) {
  auto api = [&](size_t i) { return fsdp_api(*blocks[i]); };
  switch (p) {
    case Prefetch::NONE:
      root.set_modules_to_forward_prefetch({});
      root.set_modules_to_backward_prefetch({});
      for (size_t i = 0; i < 2; ++i) {
        api(i).set_modules_to_forward_prefetch({});
        api(i).set_modules_to_backward_prefetch({});
      }
      break;
    case Prefetch::ROOT_ALL:  // the root's pre-forward gathers both blocks, its pre-backward both too
      root.set_modules_to_forward_prefetch(Modules{blocks[0], blocks[1]});
      root.set_modules_to_backward_prefetch(Modules{blocks[1], blocks[0]});
      for (size_t i = 0; i < 2; ++i) {
        api(i).set_modules_to_forward_prefetch({});
        api(i).set_modules_to_backward_prefetch({});
      }
      break;
    case Prefetch::CHAIN:  // block 0 prefetches block 1 in forward, block 1 block 0 in backward; root none
      root.set_modules_to_forward_prefetch({});
      root.set_modules_to_backward_prefetch({});
      api(0).set_modules_to_forward_prefetch(Modules{blocks[1]});
      api(0).set_modules_to_backward_prefetch({});
      api(1).set_modules_to_forward_prefetch({});
      api(1).set_modules_to_backward_prefetch(Modules{blocks[0]});
      break;
  }
}

PrefetchCounts expected_counts(Prefetch p) {
  switch (p) {
    case Prefetch::NONE: return {{1, 2, 3}, {0, 1, 2}, 3, 2};
    case Prefetch::ROOT_ALL: return {{3, 3, 3}, {2, 2, 2}, 3, 2};
    case Prefetch::CHAIN: return {{1, 3, 3}, {0, 2, 2}, 3, 2};
  }
  return {};
}

TEST_P(UnchangedMore, ExplicitPrefetchIssuesAllGathersWhereSetAndMatchesHolderPath) {
  const int ws = GetParam();
  for (Prefetch p : {Prefetch::NONE, Prefetch::ROOT_ALL, Prefetch::CHAIN}) {
    const std::string what =
        "prefetch case " + std::to_string(static_cast<int>(p)) + " on " + std::to_string(ws) + " ranks";
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      // Where the all-gathers are issued (unchanged model: the taps see them).
      PlainNet net{nullptr};
      Model m = plain_sharded(pg, {}, &net);
      Modules blocks(net->blocks->begin(), net->blocks->end());
      set_prefetch(fsdp_api(net), blocks, p);
      auto b = make_batches(1, kBatch, kSeq)[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
      std::vector<uint64_t> holder_totals;
      for (int it = 0; it < 2; ++it) {
        PrefetchCounts c;
        const auto ag0 = pg->collective_count("all_gather_into_tensor");
        uint64_t ag1 = 0;
        net->tap = [&](int i, torch::Tensor x) {
          c.forward.push_back(pg->collective_count("all_gather_into_tensor") - ag0);
          x.register_hook([&](torch::Tensor g) {
            c.backward.push_back(pg->collective_count("all_gather_into_tensor") - ag1);
            return g;
          });
          return x;
        };
        auto loss = loss_fn(m.forward(b.idx), b.targets);
        ag1 = pg->collective_count("all_gather_into_tensor");
        c.forward_total = ag1 - ag0;
        loss.backward();
        c.backward_total = pg->collective_count("all_gather_into_tensor") - ag1;
        net->tap = nullptr;
        const auto e = expected_counts(p);
        EXPECT_EQ(c.forward, e.forward) << what << ", iteration " << it << ", rank " << pg->rank();
        EXPECT_EQ(c.backward, e.backward) << what << ", iteration " << it << ", rank " << pg->rank();
        EXPECT_EQ(c.forward_total, e.forward_total) << what;
        EXPECT_EQ(c.backward_total, e.backward_total) << what;
      }
      // The holder path with the same lists: the same totals.
      Net hnet{nullptr};
      Model h = holder_sharded(pg, {}, &hnet);
      Modules hblocks{hnet->blocks[0].ptr(), hnet->blocks[1].ptr()};
      set_prefetch(fsdp_api(hnet), hblocks, p);
      for (int it = 0; it < 2; ++it) {
        const auto ag0 = pg->collective_count("all_gather_into_tensor");
        auto loss = loss_fn(h.forward(b.idx), b.targets);
        const auto ag1 = pg->collective_count("all_gather_into_tensor");
        loss.backward();
        const auto e = expected_counts(p);
        EXPECT_EQ(ag1 - ag0, e.forward_total) << what << ": holder path, iteration " << it;
        EXPECT_EQ(pg->collective_count("all_gather_into_tensor") - ag1, e.backward_total)
            << what << ": holder path, iteration " << it;
      }
    });
  }
}

// Training with the lists set: bit-identical to the holder path with the same lists, and the reference.
TEST_P(UnchangedMore, ExplicitPrefetchTrainingParity) {
  const int ws = GetParam();
  auto batches = make_batches(3, kBatch, kSeq);
  auto ref = reference_with(adamw(), batches);
  for (Prefetch p : {Prefetch::ROOT_ALL, Prefetch::CHAIN}) {
    const std::string what = "prefetch case " + std::to_string(static_cast<int>(p));
    std::vector<Trace> plain(ws), holder(ws);
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net hnet{nullptr};
      Model h = holder_sharded(pg, {}, &hnet);
      set_prefetch(fsdp_api(hnet), Modules{hnet->blocks[0].ptr(), hnet->blocks[1].ptr()}, p);
      holder[pg->rank()] = train_with(h, pg, batches, adamw());
      PlainNet net{nullptr};
      Model m = plain_sharded(pg, {}, &net);
      set_prefetch(fsdp_api(net), Modules(net->blocks->begin(), net->blocks->end()), p);
      plain[pg->rank()] = train_with(m, pg, batches, adamw());
    });
    for (int r = 0; r < ws; ++r) {
      EXPECT_EQ(diff_traces(plain[r], holder[r]), "") << what << ": unchanged vs holder path, rank " << r;
      expect_parity(plain[r], ref.ref, what + ", rank " + std::to_string(r));
    }
  }
}

// ---- 4. CPUOffloadPolicy and HSDP ---------------------------------------------------------------------

TEST_P(UnchangedMore, CpuOffloadMatchesReferenceAndHolderPath) {
  const int ws = GetParam();
  Config s;
  s.offload = true;
  plain_vs_holder_vs_reference(ws, s, "CPUOffloadPolicy");
  // Each parameter is its group's CPU shard, its gradient a shard of the same shape.
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = plain_sharded(pg, s, &net);
    auto b = make_batches(1, kBatch, kSeq)[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
    loss_fn(m.forward(b.idx), b.targets).backward();
    for (const auto& p : net->named_parameters()) {
      const auto full = initial_weights().at(p.key());
      EXPECT_EQ(p.value().size(0), chunk_range(full.size(0), ws, pg->rank()).length) << p.key() << ": not a shard";
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_EQ(p.value().grad().sizes(), p.value().sizes()) << p.key();
      EXPECT_TRUE(p.value().device().is_cpu());
    }
  });
}

TEST(UnchangedMoreHsdp, TwoByTwoMeshMatchesReferenceAndHolderPath) {
  Config s;
  s.mesh = {2, 2};
  plain_vs_holder_vs_reference(4, s, "HSDP {2, 2}");
  run_ranks(4, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    plain_sharded(pg, s, &net);
    for (const auto& [name, dt] : fsdp_api(*net->blocks[0]).sharded_parameters()) {
      ASSERT_EQ(dt.placements().size(), 2u) << name;
      EXPECT_TRUE(dt.placements()[0].is_replicate()) << name;
    }
  });
}

// ---- 5. reshard_after_forward = 2 on 4 ranks ----------------------------------------------------------
// After forward each block holds the post-forward state (a 1/2 slice gathered over pairs of ranks),
// its parameters show the shard; backward gathers over the pairs, not the shard group.
TEST(UnchangedMoreReshard, IntTwoOnFourRanksPostForwardStateAndParity) {
  Config s;
  s.block_raf = ReshardAfterForward(2);
  plain_vs_holder_vs_reference(4, s, "reshard_after_forward 2");
  const int ws = 4, k = 2;
  auto batches = make_batches(1, kBatch, kSeq);
  Model ref = plain_reference();
  loss_fn(ref.forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = plain_sharded(pg, s, &net);
    auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
    for (int it = 0; it < 2; ++it) {
      const uint64_t nblocks = net->blocks->size();
      auto ag0 = pg->collective_count("all_gather_into_tensor");
      auto rs0 = pg->collective_count("reduce_scatter_tensor");
      auto loss = loss_fn(m.forward(b.idx), b.targets);
      auto ag1 = pg->collective_count("all_gather_into_tensor");
      EXPECT_EQ(ag1 - ag0, nblocks + 1) << "forward all-gathers, iteration " << it;
      std::vector<uint64_t> pf0;
      for (size_t i = 0; i < nblocks; ++i) {
        auto& st = detail::fsdp_state(fsdp_api(*net->blocks[i]));
        auto& g = *st.group;
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED_POST_FORWARD)
            << "block " << i << ", iteration " << it;
        EXPECT_EQ(net->blocks[i]->as<BlockImpl>()->fc1->weight.size(0), chunk_range(kHidden, ws, pg->rank()).length)
            << "block " << i << " shows its shard after forward";
        ASSERT_TRUE(st.post_forward_group);
        EXPECT_EQ(st.post_forward_group->size(), k);
        for (const auto& p : g.params()) {
          ASSERT_TRUE(p.post_forward_shard.defined()) << p.fqn;
          EXPECT_EQ(p.post_forward_shard.numel(), ws / k * p.padded_numel()) << p.fqn << ": a 1/" << k << " slice";
        }
        pf0.push_back(st.post_forward_group->collective_count("all_gather_into_tensor"));
      }
      EXPECT_EQ(detail::fsdp_state(fsdp_api(net)).group->sharded_state(), detail::ShardedState::UNSHARDED);
      loss.backward();
      EXPECT_EQ(pg->collective_count("all_gather_into_tensor") - ag1, 0u)
          << "backward all-gathers over the shard group";
      for (size_t i = 0; i < nblocks; ++i) {
        auto& st = detail::fsdp_state(fsdp_api(*net->blocks[i]));
        EXPECT_EQ(st.post_forward_group->collective_count("all_gather_into_tensor") - pf0[i], 1u)
            << "block " << i << " gathers over its pair in backward";
        EXPECT_EQ(st.group->sharded_state(), detail::ShardedState::SHARDED) << "block " << i << " after backward";
      }
      EXPECT_EQ(pg->collective_count("reduce_scatter_tensor") - rs0, nblocks + 1) << "reduce-scatters";
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      for (const auto& p : net->named_parameters()) {
        auto expect = distribute_tensor(ref.module->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        // Iteration 1 accumulates onto iteration 0's gradient (no zero_grad): twice the reference.
        EXPECT_TRUE(torch::allclose(p.value().grad(), expect * (it + 1), kGradRtol, kGradAtol))
            << p.key() << " on rank " << pg->rank() << ", iteration " << it;
      }
    }
  });
}

// ---- 6. Outside forward: full reads between steps; optimizers that read the parameter -----------------

// Under NoGradGuard between steps (and before the first), reading a parameter gathers its group: the
// values are the reference's full parameter after that step; training then continues to match. The
// step ends with zero_grad() before the read (see the disabled test below for a read before it).
TEST_P(UnchangedMore, ReadUnderNoGradBetweenStepsSeesFullParameterAndTrainingContinues) {
  const int ws = GetParam();
  auto batches = make_batches(3, kBatch, kSeq);
  auto ref = reference_with(adamw(), batches);
  std::vector<Trace> traces(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = plain_sharded(pg, {}, &net);
    torch::optim::Optimizer* opt = nullptr;
    auto check_reads = [&](const std::map<std::string, torch::Tensor>& expect, const std::string& when) {
      torch::NoGradGuard g;
      for (const auto& p : net->named_parameters()) {
        const auto& full = expect.at(p.key());
        const double sum = p.value().sum().item<double>();
        EXPECT_NEAR(sum, full.sum().item<double>(), 1e-5 * (1 + full.abs().sum().item<double>()))
            << p.key() << " " << when << ", rank " << pg->rank();
        auto copy = p.value().clone();
        EXPECT_EQ(copy.sizes(), full.sizes()) << p.key() << " " << when << ": the read saw the shard";
        if (copy.sizes() == full.sizes()) {
          EXPECT_TRUE(torch::allclose(copy, full, kRtol, kAtol))
              << p.key() << " " << when << ": max |diff| " << max_abs_diff(copy, full);
        }
      }
    };
    check_reads(initial_weights(), "before training");
    auto make_opt = [&](const std::vector<torch::Tensor>& params) {
      auto o = make_optimizer(params, Opt::ADAMW);
      opt = o.get();
      return o;
    };
    traces[pg->rank()] = train_with(m, pg, batches, make_opt, [&](size_t s) {
      opt->zero_grad();
      check_reads(ref.params_after[s], "after step " + std::to_string(s));
    });
  });
  for (int r = 0; r < ws; ++r) expect_parity(traces[r], ref.ref, "reads between steps, rank " + std::to_string(r));
}

// Was a bug of both paths: a forward use outside training -- a read under NoGradGuard on an implicit
// group, or an evaluation forward of the root on either path -- unsharded the group and moved its
// sharded gradients aside (p.grad() was then undefined); opt.zero_grad() afterwards cleared nothing,
// and the next backward added the old gradient to the new one (measured: exactly g0 + g1). The sharded
// gradient now stays in .grad outside a backward, whatever the data.
TEST(RegressionsZeroGrad, ZeroGradAfterReadOrEvaluationForwardClearsTheGradient) {
  for (int variant = 0; variant < 3; ++variant) {  // 0: read (implicit); 1: eval forward (implicit); 2: holder
    run_ranks(2, [&](ProcessGroupPtr pg) {
      torch::nn::Linear lin(4, 4);
      {
        torch::NoGradGuard g;
        lin->weight.copy_(torch::arange(16, torch::kFloat).reshape({4, 4}) / 16);
        lin->bias.fill_(0.1);
      }
      std::optional<FSDPModule<torch::nn::Linear>> holder;
      if (variant == 2) holder.emplace(lin);
      fully_shard(lin, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
      auto fwd = [&](const torch::Tensor& x) { return holder ? (*holder)(x) : lin(x); };
      auto x = torch::arange(8, torch::kFloat).reshape({2, 4}) * (pg->rank() + 1);
      fwd(x).pow(2).sum().backward();
      const auto g0 = lin->weight.grad().clone();
      {
        torch::NoGradGuard g;
        if (variant == 0) {
          lin->weight.sum();
        } else {
          fwd(x);
        }
      }
      for (auto& p : lin->parameters()) p.mutable_grad() = torch::Tensor();  // opt.zero_grad()
      fwd(x).pow(2).sum().backward();
      EXPECT_TRUE(torch::allclose(lin->weight.grad(), g0))
          << "variant " << variant << ", rank " << pg->rank() << ": second gradient " << lin->weight.grad() << " first "
          << g0;
    });
  }
}

// torch::optim::SGD with momentum and weight decay (`d_p = p.grad().data(); d_p.add(p, wd)`, a
// momentum buffer cloned from it) and torch::optim::Adam with weight decay (`grad.add(p, wd)`, state
// from zeros_like(p)) step the shards: the same numbers as the holder path and the reference.
TEST_P(UnchangedMore, SgdMomentumWeightDecayStepsShards) {
  Config s;
  s.opt = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  };
  plain_vs_holder_vs_reference(GetParam(), s, "SGD momentum 0.9 weight_decay 0.01");
}

TEST_P(UnchangedMore, AdamWeightDecayStepsShards) {
  Config s;
  s.opt = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
  };
  plain_vs_holder_vs_reference(GetParam(), s, "Adam weight_decay 0.01");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, UnchangedMore, ::testing::Values(2, 3));

// ---- 2. Debug mode: ranks that disagree ---------------------------------------------------------------
// FSDP_DEBUG=DETAIL. Each disagreement raises on every rank, with the same message on both paths
// (the root's type name aside), instead of hanging or training a mixture.

struct DebugEnv {
  DebugEnv() { setenv("FSDP_DEBUG", "DETAIL", 1); }
  ~DebugEnv() { unsetenv("FSDP_DEBUG"); }
};

enum class Disagree { WEIGHTS, BLOCK_COUNT, BLOCK_DTYPE };

// Builds the model for `rank` with the disagreement on rank 1, shards it and runs one step.
template <typename NetT>
void disagreeing_step(ProcessGroupPtr pg, Disagree d) {
  const int rank = pg->rank();
  NetT net(d == Disagree::BLOCK_COUNT && rank == 1 ? 3 : 2);
  {
    torch::NoGradGuard g;
    const auto init = initial_weights();
    for (auto& p : net->named_parameters()) {
      auto it = init.find(p.key());
      if (it != init.end()) {
        p.value().copy_(it->second);
      } else {
        p.value().fill_(0.5);  // blocks.2 of the longer model
      }
    }
    if (d == Disagree::WEIGHTS && rank == 1) net->named_parameters()["blocks.1.fc1.weight"][0][0].add_(1.0);
  }
  std::optional<FSDPModule<NetT>> holder;
  if constexpr (std::is_same_v<NetT, Net>) holder.emplace(net);
  auto mesh = init_device_mesh(torch::kCPU, {pg->size()});
  auto opts = FullyShardOptions().mesh(mesh);
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  if constexpr (std::is_same_v<NetT, Net>) {
    for (auto& b : net->blocks) blocks.push_back(b.ptr());
  } else {
    blocks.assign(net->blocks->begin(), net->blocks->end());
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto o = opts;
    if (d == Disagree::BLOCK_DTYPE && rank == 1 && i == 1) {
      o.mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
    }
    fully_shard(blocks[i], o);
  }
  fully_shard(net, opts);
  if constexpr (std::is_same_v<NetT, Net>) {
    EXPECT_FALSE(is_implicit(fsdp_api(net)));
  } else {
    EXPECT_TRUE(is_implicit(fsdp_api(net)));
  }
  auto b = make_batches(1, kBatch, kSeq)[0].slice(rank * 2, 2);
  auto out = holder ? (*holder)(b.idx) : net->forward(b.idx);
  loss_fn(out.to(torch::kFloat), b.targets).backward();
}

// The unchanged model's root type named as the holder model's (the only expected difference).
std::string normalized(std::string s) {
  const std::string from = "PlainNetImpl", to = "NetImpl";
  for (size_t pos; (pos = s.find(from)) != std::string::npos;) s.replace(pos, from.size(), to);
  return s;
}

void check_disagreement(Disagree d, const std::vector<std::string>& phrases) {
  DebugEnv debug;
  const int ws = 2;
  auto collect = [&](auto tag) {
    using NetT = decltype(tag);
    return run_ranks_collect(
        ws,
        [&](ProcessGroupPtr pg) {
          ASSERT_TRUE(pg->debug_backend());
          disagreeing_step<NetT>(pg, d);
        },
        std::chrono::seconds(60), std::chrono::seconds(10));
  };
  auto holder = collect(Net{nullptr});
  auto plain = collect(PlainNet{nullptr});
  for (int r = 0; r < ws; ++r) {
    EXPECT_NE(plain[r], "") << "rank " << r << " did not fail";
    for (const auto& ph : phrases) EXPECT_NE(plain[r].find(ph), std::string::npos) << "rank " << r << ": " << plain[r];
    EXPECT_EQ(normalized(plain[r]), holder[r]) << "rank " << r << ": unchanged vs holder path";
  }
}

TEST(UnchangedMoreDebug, DifferentWeightsOnOneRankNamedAtFullyShard) {
  check_disagreement(Disagree::WEIGHTS, {"fully_shard: parameter 'fc1.weight'", "differs between rank 0 and rank 1",
                                         "FSDP_DEBUG checksum check"});
}

// Rank 1 has a third block: the checksum exchanges of fully_shard meet with different lengths (the
// root's 3 parameters on rank 0, blocks.2's 7 on rank 1), which debug mode names.
TEST(UnchangedMoreDebug, DifferentModelOnOneRankFailsEveryRank) {
  check_disagreement(Disagree::BLOCK_COUNT,
                     {"FSDP_DEBUG: collective mismatch", "rank 0 calls all_reduce #2(input [2, 3]",
                      "rank 1 calls all_reduce #2(input [2, 7]", "(input shape differs)"});
}

// Rank 1 gathers blocks.1 in bf16: the implicit root's lazy init (at the first op of the forward)
// compares the groups before any all-gather.
TEST(UnchangedMoreDebug, DifferentGroupDtypeOnOneRankFailsEveryRankAtFirstForward) {
  check_disagreement(Disagree::BLOCK_DTYPE,
                     {"fully_shard: the ranks disagree about the collectives of their FSDP groups",
                      "all-gather dtype Float on rank 0 but BFloat16 on rank 1",
                      "group #2 is 'blocks.1' (fsdp::testing::BlockImpl)"});
}

}  // namespace
}  // namespace fsdp::testing

