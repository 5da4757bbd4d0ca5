// The CPU buffer pool of FSDP's transient buffers (CTest label: fully_shard; issue 16, part 2): exact-size
// reuse, the high-water bound, lifetime, the switch (FSDP_CPU_BUFFER_POOL=1; off by default); and in training: after the first steps every buffer
// FSDP needs comes from the pool (no fresh block, hence no page faults from FSDP's own buffers), with
// results bit-identical to training without the pool (uneven shards, 2 and 3 ranks, zero_grad setting
// gradients to none or zeroing them in place). Counters, not timing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "fsdp/fsdp_buffer_pool.h"
#include "fsdp/fsdp_streams.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

using detail::BufferPool;
using detail::make_buffer_pool;

// Sets an environment variable for a scope (the pool reads FSDP_CPU_BUFFER_POOL when it is made).
struct ScopedEnv {
  std::string name;
  std::string old;
  bool had;
  ScopedEnv(const char* n, const char* v) : name(n) {
    const char* o = std::getenv(n);
    had = o != nullptr;
    if (had) old = o;
    if (v) setenv(n, v, 1); else unsetenv(n);
  }
  ~ScopedEnv() {
    if (had) setenv(name.c_str(), old.c_str(), 1); else unsetenv(name.c_str());
  }
};

TEST(BufferPool, ReusesABlockOfTheSameSize) {
  ScopedEnv env("FSDP_CPU_BUFFER_POOL", "1");
  auto pool = make_buffer_pool();
  ASSERT_TRUE(pool->enabled());
  void* first = nullptr;
  {
    auto t = pool->empty({250}, torch::kFloat32);
    EXPECT_EQ(t.nbytes(), 1000u);
    EXPECT_EQ(t.storage().allocator(), pool.get());  // re-allocations through the storage use the pool
    first = t.data_ptr();
    EXPECT_EQ(pool->stats().in_use_bytes, 1000u);
  }
  EXPECT_EQ(pool->stats().idle_bytes, 1000u);
  auto again = pool->empty({50, 5}, torch::kFloat32);  // same bytes, other shape
  EXPECT_EQ(again.data_ptr(), first);
  const auto s = pool->stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.idle_bytes, 0u);
}

TEST(BufferPool, FootprintStaysWithinTwiceTheMostBytesInUse) {
  ScopedEnv env("FSDP_CPU_BUFFER_POOL", "1");
  auto pool = make_buffer_pool();
  { auto a = pool->empty({1000}, torch::kUInt8); }  // high-water 1000, then idle
  auto b = pool->empty({1000}, torch::kUInt8);        // reuses it
  auto c = pool->empty({1500}, torch::kUInt8);        // high-water 2500: footprint 2500
  b = torch::Tensor();
  c = torch::Tensor();                                // both idle: 2500
  auto s = pool->stats();
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.idle_bytes, 2500u);
  EXPECT_EQ(s.high_water_bytes, 2500u);
  {
    auto d = pool->empty({2000}, torch::kUInt8);  // 2500 idle + 2000 <= 2 x 2500: kept beside them
    EXPECT_EQ(pool->stats().evictions, 0u);
  }
  EXPECT_EQ(pool->stats().idle_bytes, 4500u);
  auto f = pool->empty({3000}, torch::kUInt8);  // 4500 idle + 3000 > 2 x 2500: the largest idle go first
  s = pool->stats();
  EXPECT_EQ(s.evictions, 2u);  // 2000, then 1500: 1000 + 3000 <= 5000
  EXPECT_EQ(s.idle_bytes, 1000u);
  EXPECT_LE(s.in_use_bytes + s.idle_bytes, 2 * s.high_water_bytes);
  pool->release_idle();
  EXPECT_EQ(pool->stats().idle_bytes, 0u);
}

TEST(BufferPool, BlocksOutliveThePool) {
  ScopedEnv env("FSDP_CPU_BUFFER_POOL", "1");
  auto pool = make_buffer_pool();
  auto t = pool->empty({64}, torch::kFloat32);
  t.fill_(3);
  pool.reset();                            // the owner goes away first
  EXPECT_EQ(t.sum().item<float>(), 192);   // the block is still valid
  t = torch::Tensor();                     // and returns to the (shared) state without a crash
}

TEST(BufferPool, SwitchedOffByEnvironment) {
  {
    ScopedEnv unset("FSDP_CPU_BUFFER_POOL", nullptr);  // off by default (it holds memory between steps)
    EXPECT_FALSE(make_buffer_pool()->enabled());
    ScopedEnv env("FSDP_CPU_BUFFER_POOL", "0");
    auto pool = make_buffer_pool();
    EXPECT_FALSE(pool->enabled());
    { auto t = pool->empty({100}, torch::kFloat32); }
    EXPECT_EQ(pool->stats().misses, 0u);
    EXPECT_EQ(pool->stats().idle_bytes, 0u);
  }
  ScopedEnv bad("FSDP_CPU_BUFFER_POOL", "yes");
  try {
    make_buffer_pool();
    FAIL() << "an invalid FSDP_CPU_BUFFER_POOL was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected \"1\""), std::string::npos) << e.what();
  }
}

// ---- In training ----------------------------------------------------------------------------------------

struct PoolRun {
  int world;
  bool set_to_none;
};

struct RankResult {
  std::map<std::string, torch::Tensor> params;  // final local shards
  std::vector<float> losses;
  detail::BufferPoolStats warm, end;  // after the warm-up steps, at the end
};

constexpr int kWarmSteps = 3, kSteadySteps = 3;

// Trains Net (uneven shards on 2 and 3 ranks) for kWarmSteps + kSteadySteps AdamW steps, every block and
// the root sharded, with the pool on or off; per rank: final shards, losses and the pool's counters.
std::vector<RankResult> train(const PoolRun& c, bool pool_on) {
  ScopedEnv env("FSDP_CPU_BUFFER_POOL", pool_on ? "1" : "0");
  std::vector<RankResult> out(c.world);
  const auto batches = make_batches(kWarmSteps + kSteadySteps, 6 * c.world, 4);
  // The initial weights, drawn once (rank threads drawing from the global generator at once would race).
  torch::manual_seed(7);
  const auto weights = snapshot(*Net(/*n_blocks=*/3));
  run_ranks(c.world, [&](ProcessGroupPtr pg) {
    Net net(/*n_blocks=*/3);
    load_full(*net, weights);
    auto mesh = init_device_mesh(torch::kCPU, {c.world});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    auto pool = detail::comm_context_for(mesh.get(), torch::kCPU)->pool_ptr();
    auto& r = out[pg->rank()];
    for (int s = 0; s < kWarmSteps + kSteadySteps; ++s) {
      auto b = batches[s].slice(6 * pg->rank(), 6);
      auto loss = loss_fn(model(b.idx), b.targets);
      loss.backward();
      opt.step();
      opt.zero_grad(c.set_to_none);
      r.losses.push_back(loss.item<float>());
      if (s + 1 == kWarmSteps) r.warm = pool->stats();
    }
    r.end = pool->stats();
    for (const auto& p : net->named_parameters()) r.params[p.key()] = p.value().detach().clone();
  });
  return out;
}

class BufferPoolTraining : public ::testing::TestWithParam<PoolRun> {};

TEST_P(BufferPoolTraining, SteadyStateReusesEveryBlockAndTrainsBitIdentically) {
  const auto c = GetParam();
  const auto with = train(c, true);
  const auto without = train(c, false);
  for (int r = 0; r < c.world; ++r) {
    const auto& w = with[r];
    // Steady state: the buffers come from idle blocks (a fresh one would be page-faulted in). Not
    // strictly all: Gloo's work releases a reduce-scatter's input and scratch when it is waited, so how
    // many blocks of a size are in use at once can differ by one between steps, and the pool then makes
    // one more block (kept from then on); on a loaded machine this happened for three sizes in one run
    // (CI: 3 fresh, 189 reused). Allowed: at most one fresh block per ten reused (a pool that does not
    // reuse makes all some sixty afresh, and one that frees between steps shows as evictions below).
    const uint64_t fresh = w.end.misses - w.warm.misses, reused = w.end.hits - w.warm.hits;
    EXPECT_LE(10 * fresh, reused) << "rank " << r << ": fresh blocks after the warm-up steps (" << reused
                                  << " reused)";
    EXPECT_GE(reused, 15u * kSteadySteps) << "rank " << r << ": the pool was not used";
    EXPECT_EQ(w.end.evictions, w.warm.evictions) << "rank " << r;
    EXPECT_LE(w.end.in_use_bytes + w.end.idle_bytes, 2 * w.end.high_water_bytes) << "rank " << r;
    EXPECT_EQ(without[r].end.misses + without[r].end.hits, 0u) << "rank " << r << ": the switch was ignored";
    // Bit-identical training: same losses, same shards.
    ASSERT_EQ(w.losses.size(), without[r].losses.size());
    for (size_t s = 0; s < w.losses.size(); ++s) {
      EXPECT_EQ(std::memcmp(&w.losses[s], &without[r].losses[s], sizeof(float)), 0)
          << "rank " << r << " step " << s << ": " << w.losses[s] << " vs " << without[r].losses[s];
    }
    for (const auto& [name, t] : w.params) {
      const auto& o = without[r].params.at(name);
      ASSERT_EQ(t.sizes(), o.sizes()) << name;
      EXPECT_EQ(std::memcmp(t.data_ptr(), o.data_ptr(), t.nbytes()), 0) << "rank " << r << ": " << name << " differs";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, BufferPoolTraining,
                         ::testing::Values(PoolRun{2, true}, PoolRun{3, true}, PoolRun{2, false}),
                         [](const ::testing::TestParamInfo<PoolRun>& i) {
                           return std::to_string(i.param.world) + "ranks" +
                                  (i.param.set_to_none ? "_SetToNone" : "_ZeroInPlace");
                         });

}  // namespace
}  // namespace fsdp::testing
