// The builders of the unchanged_models tests that compare an unchanged LibTorch model (unchanged_models.h's
// PlainNet) with the same model declared with FSDPModule holders (fsdp_test_model.h's Net: same parameter
// names and initial weights), and the world-size fixtures of their parameterized tests.
//
// Their tests are spread over the feature files (mixed precision, memory, communication, prefetch, ...), in
// namespace fsdp::testing::unchanged_harness. A binary instantiates each fixture once, in one file (for
// test_fsdp: fsdp/test_unchanged_models.cpp): INSTANTIATE_TEST_SUITE_P(WorldSizes, Unchanged, Values(2, 3)) and
// INSTANTIATE_TEST_SUITE_P(WorldSizes, UnchangedMore, Values(2, 3)).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "unchanged_models.h"

namespace fsdp::testing::unchanged_harness {

// ---- Knobs: the builders of the Unchanged tests ------------------------------------------------------

inline constexpr int kSteps3 = 3;

struct Knobs {
  int calls_per_block = 1;
  int call_style = 0;
  bool checkpoint = false;  // PlainNet: fsdp::checkpoint at the call site; Net: checkpoint_wrapper
  std::optional<ReshardAfterForward> block_reshard;
  MixedPrecisionPolicy mp;
};

inline Model make_plain(const Knobs& k) {
  PlainNet net;
  load_full(*net, initial_weights());
  net->calls_per_block = k.calls_per_block;
  net->call_style = k.call_style;
  net->checkpoint_blocks = k.checkpoint;
  return as_model(net);
}

// The unchanged model, sharded per block then the root.
inline Model sharded_plain(ProcessGroupPtr pg, const Knobs& k, PlainNet* out = nullptr) {
  Model m = make_plain(k);
  auto net = PlainNet(std::dynamic_pointer_cast<PlainNetImpl>(m.module));
  auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {pg->size()})).mp_policy(k.mp);
  for (size_t i = 0; i < net->blocks->size(); ++i) {
    fully_shard(net->blocks[i], FullyShardOptions(opts).reshard_after_forward(k.block_reshard));
  }
  fully_shard(net, opts);
  if (out) *out = net;
  return m;
}

// The same model with holders (the zero-overhead path), sharded the same way.
inline Model sharded_holder(ProcessGroupPtr pg, const Knobs& k, Net* out = nullptr) {
  Net net;
  load_full(*net, initial_weights());
  net->calls_per_block = k.calls_per_block;
  FSDPModule<Net> model(net);
  auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {pg->size()})).mp_policy(k.mp);
  for (auto& b : net->blocks) {
    if (k.checkpoint) checkpoint_wrapper(b);
    fully_shard(b, FullyShardOptions(opts).reshard_after_forward(k.block_reshard));
  }
  fully_shard(net, opts);
  if (out) *out = net;
  return {net.ptr(), [model](const torch::Tensor& x) mutable { return model(x); }};
}

// Runs both paths on `ws` ranks; expects bit-identical traces. Returns rank 0's traces (plain, holder).
inline std::pair<Trace, Trace> plain_vs_holder(int ws, const Knobs& k, const std::string& what) {
  auto batches = make_batches(kSteps3, kBatch, kSeq);
  std::vector<Trace> plain(ws), holder(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net hnet{nullptr};
    Model h = sharded_holder(pg, k, &hnet);
    EXPECT_FALSE(is_implicit(fsdp_api(hnet->blocks[0]))) << "the holder path must stay the holder path";
    holder[pg->rank()] = train_sharded(h, pg, batches);
    PlainNet pnet{nullptr};
    Model p = sharded_plain(pg, k, &pnet);
    EXPECT_TRUE(is_implicit(fsdp_api(*pnet->blocks[0])));
    EXPECT_TRUE(is_implicit(fsdp_api(pnet)));
    plain[pg->rank()] = train_sharded(p, pg, batches);
  });
  for (int r = 0; r < ws; ++r) {
    EXPECT_EQ(plain[r].losses.size(), static_cast<size_t>(kSteps3)) << what << ", rank " << r;
    EXPECT_EQ(diff_traces(plain[r], holder[r]), "") << what << ": unchanged vs holder path, rank " << r;
  }
  return {plain[0], holder[0]};
}

class Unchanged : public ::testing::TestWithParam<int> {};  // world size

// ---- Config: the builders of the UnchangedMore tests ---------------------------------------------------

using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
using OptFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<torch::Tensor>&)>;

inline OptFactory adamw() {
  return [](const std::vector<torch::Tensor>& p) { return make_optimizer(p, Opt::ADAMW); };
}

struct Config {
  std::vector<int64_t> mesh;  // empty: 1-D over every rank; {2, 2}: HSDP (replicate, shard)
  std::optional<ReshardAfterForward> block_raf;
  bool offload = false;
  OptFactory opt = adamw();
};

inline FullyShardOptions options_of(const ProcessGroupPtr& pg, const Config& s) {
  auto mesh = s.mesh.size() == 2 ? init_device_mesh(torch::kCPU, s.mesh, {"replicate", "shard"})
                                 : init_device_mesh(torch::kCPU, {pg->size()});
  auto o = FullyShardOptions().mesh(mesh);
  if (s.offload) o.offload_policy(CPUOffloadPolicy().pin_memory(false));
  return o;
}

// The unchanged model (initial_weights(): the parameter names of Net), blocks then the root.
inline Model plain_sharded(const ProcessGroupPtr& pg, const Config& s, PlainNet* out = nullptr) {
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
inline Model holder_sharded(const ProcessGroupPtr& pg, const Config& s, Net* out = nullptr) {
  Net net;
  load_full(*net, initial_weights());
  FSDPModule<Net> model(net);
  auto opts = options_of(pg, s);
  for (auto& b : net->blocks) fully_shard(b, FullyShardOptions(opts).reshard_after_forward(s.block_raf));
  fully_shard(net, opts);
  if (out) *out = net;
  return {net.ptr(), [model](const torch::Tensor& x) mutable { return model(x); }};
}

inline Model plain_reference() {
  PlainNet net;
  load_full(*net, initial_weights());
  return as_model(net);
}

/// Single-process run with `opt`; also the full parameters after every step.
struct RefRun {
  Reference ref;
  std::vector<std::map<std::string, torch::Tensor>> params_after;
};
inline RefRun reference_with(const OptFactory& make_opt, const std::vector<Batch>& batches) {
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
inline Trace train_with(const Model& m, const ProcessGroupPtr& pg, const std::vector<Batch>& batches,
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
inline void plain_vs_holder_vs_reference(int ws, const Config& s, const std::string& what, int steps = 3) {
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

}  // namespace fsdp::testing::unchanged_harness
