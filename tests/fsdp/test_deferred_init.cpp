// deferred_init + fully_shard + materialize_module: the shards hold exactly the rows an eagerly
// constructed model has (same seed, any number of ranks), no rank ever holds the full model, and the
// misuses give clear errors. (CTest label large_model.)
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <unistd.h>
#include <map>

#include <optional>

#include <c10/core/CPUAllocator.h>

#include "counting_allocator.h"
#include "fsdp/fsdp.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

// The test model's blocks plus what initialisation has to get right: an Embedding with a padding row
// (a write through a view), a weight tied under a second name, a frozen parameter, a buffer, a
// parameter made by torch::randn (a factory that draws), and a head whose rows do not divide by 2 or 3.
struct DeferNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::Linear head{nullptr};
  torch::Tensor tied, frozen, noise, buf;
  DeferNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kDim).padding_idx(1)));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(Block());
    head = register_module("head", torch::nn::Linear(kDim, kClasses + 3));
    tied = register_parameter("tied", wte->weight);
    frozen = register_parameter("frozen", torch::randn({7, 3}), /*requires_grad=*/false);
    noise = register_parameter("noise", torch::randn({5}) * 0.5 + 1.0);
    buf = register_buffer("buf", torch::rand({4}));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = wte(idx);
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(x).narrow(-1, 0, kClasses) * noise.narrow(0, 0, 1) + x.matmul(tied.t()).narrow(-1, 0, kClasses);
  }
};
TORCH_MODULE(DeferNet);

std::map<std::string, torch::Tensor> eager_tensors(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().detach().clone();
  return out;
}

void shard(DeferNet& m, const DeviceMeshPtr& mesh) {
  for (const auto& b : *m->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
  fully_shard(m.ptr(), FullyShardOptions().mesh(mesh));
}

class DeferredInitWorldSizes : public ::testing::TestWithParam<int> {};

TEST_P(DeferredInitWorldSizes, ShardsEqualEagerRowsAndTrainTheSame) {
  const int ws = GetParam();
  torch::manual_seed(3);
  DeferNet eager;
  const auto expect = eager_tensors(*eager);
  const auto eager_next = torch::rand({3});  // what the default generator gives after construction
  const auto batch = make_batches(1, kBatch, kSeq)[0];
  const auto eager_loss = loss_fn(eager->forward(batch.idx), batch.targets).item<float>();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    torch::manual_seed(3);
    auto m = deferred_init([] { return DeferNet(); });
    for (const auto& p : m->parameters()) EXPECT_TRUE(p.is_meta());
    EXPECT_TRUE(is_deferred(m->wte->weight));
    barrier(*pg);  // every rank has read the seed before any rank's materialize_module moves it on
    shard(m, mesh);
    materialize_module(m);
    EXPECT_FALSE(is_deferred(m->wte->weight));
    for (const auto& [k, v] : get_model_state_dict(*m)) {
      if (const auto* d = std::get_if<DTensor>(&v)) {
        auto rows = distribute_tensor(expect.at(k), mesh, {Shard(0)}).to_local();
        EXPECT_TRUE(torch::equal(d->to_local(), rows)) << k << " on rank " << pg->rank();
      } else if (const auto* t = std::get_if<torch::Tensor>(&v)) {
        EXPECT_TRUE(torch::equal(*t, expect.at(k))) << k << " on rank " << pg->rank();
      }
    }
    EXPECT_FALSE(m->frozen.requires_grad());
    EXPECT_TRUE(m->noise.requires_grad());
    // The whole batch on every rank: the same loss as the eager model, bit for bit.
    auto loss = loss_fn(m->forward(batch.idx), batch.targets);
    EXPECT_EQ(loss.item<float>(), eager_loss) << "rank " << pg->rank();
    loss.backward();
    barrier(*pg);
  });
  if (ws == 1) EXPECT_TRUE(torch::equal(torch::rand({3}), eager_next)) << "the default generator after materialize";
}
INSTANTIATE_TEST_SUITE_P(LargeModel, DeferredInitWorldSizes, ::testing::Values(1, 2, 3));

// to_empty + dcp::load of a consolidated safetensors file: the model's values come from the checkpoint,
// each rank reading its rows into its shards; no initial values are drawn.
TEST_P(DeferredInitWorldSizes, ToEmptyThenLoadingAFullCheckpointGivesTheCheckpointsValues) {
  const int ws = GetParam();
  torch::manual_seed(5);
  DeferNet eager;
  const auto full = eager_tensors(*eager);
  const auto dir = std::filesystem::temp_directory_path() / ("deferred_load_" + std::to_string(::getpid()) + "_" +
                                                             std::to_string(ws));
  std::filesystem::create_directories(dir);
  dcp::save_file(full, (dir / "model.safetensors").string());
  const auto batch = make_batches(1, kBatch, kSeq)[0];
  const auto eager_loss = loss_fn(eager->forward(batch.idx), batch.targets).item<float>();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    auto m = deferred_init([] { return DeferNet(); });
    shard(m, mesh);
    to_empty(m);
    EXPECT_FALSE(is_deferred(m->wte->weight));
    auto sd = get_model_state_dict(*m);
    dcp::load(sd, dir.string(), dcp::LoadOptions().group(pg));
    for (const auto& [k, v] : get_model_state_dict(*m)) {
      if (const auto* d = std::get_if<DTensor>(&v)) {
        EXPECT_TRUE(torch::equal(d->to_local(), distribute_tensor(full.at(k), mesh, {Shard(0)}).to_local()))
            << k << " on rank " << pg->rank();
      } else if (const auto* t = std::get_if<torch::Tensor>(&v)) {
        EXPECT_TRUE(torch::equal(*t, full.at(k))) << k << " on rank " << pg->rank();
      }
    }
    EXPECT_EQ(loss_fn(m->forward(batch.idx), batch.targets).item<float>(), eager_loss) << "rank " << pg->rank();
  });
  std::filesystem::remove_all(dir);
}

// Four 2048x2048 fp32 Linear weights (16 MiB each, 64 MiB in all), initialised twice, on 2 ranks: eager
// construction would hold 64 MiB per rank; sharded init must stay under (64/2 + 16) * 1.1 MiB.
struct BigImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  explicit BigImpl(int num_layers = 4) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < num_layers; ++i) layers->push_back(torch::nn::Linear(torch::nn::LinearOptions(2048, 2048).bias(false)));
    // A second initialisation of every weight after all are made (as GPT-2's init loop): the first
    // values are dead, so the replay must not keep every parameter alive until this loop.
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.normal_(0.0, 0.02);
  }
};
TORCH_MODULE(Big);

TEST(LargeModelDeferredInit, PeakPerRankIsShardsPlusLargestParameter) {
  static CountingAllocator counting;
  std::optional<UseCountingAllocator> use(counting);
  const int ws = 2;
  const double param_bytes = 2048.0 * 2048 * 4, total = 4 * param_bytes;
  std::vector<int64_t> peaks(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    static CountingAllocator::Counter counters[2];  // never destroyed: shards may be freed after this lambda
    auto& counter = counters[pg->rank()];
    CountingAllocator::current() = &counter;
    {
      auto m = deferred_init([] { return Big(); });
      for (const auto& l : *m->layers) fully_shard(l, FullyShardOptions().mesh(mesh));
      fully_shard(m.ptr(), FullyShardOptions().mesh(mesh));
      materialize_module(m);
      peaks[pg->rank()] = counter.peak.load();
      CountingAllocator::current() = nullptr;
    }
  });
  use.reset();
  for (int r = 0; r < ws; ++r) {
    std::printf("[memory] rank %d: peak %.1f MiB during deferred_init + fully_shard + materialize_module "
                "(bound %.1f MiB, eager construction alone %.1f MiB)\n",
                r, peaks[r] / 1048576.0, (total / ws + param_bytes) * 1.1 / 1048576.0, total / 1048576.0);
    EXPECT_LE(peaks[r], (total / ws + param_bytes) * 1.1) << "rank " << r;
    EXPECT_GE(peaks[r], total / ws) << "rank " << r << ": the shards alone are that big";
  }
}

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); resetting VmHWM needs Linux >= 4.0.
double rss_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(status, line)) {
    if (line.compare(0, key.size(), key) == 0) return std::stod(line.substr(key.size())) * 1024.0;  // "  123 kB"
  }
  ADD_FAILURE() << field << " not in /proc/self/status";
  return 0;
}
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// The bound of sharded initialisation in RSS, with LibTorch's default allocator (glibc's malloc), which
// is what a user's process sees (issue 28, item 3; [Note: materialisation memory],
// src/fsdp/unmapping_allocator.cpp). The ranks are threads of this process, so the process's RSS peak is
// the sum of theirs: bound 1.1 x ws x (shards + the largest parameter).
TEST(LargeModelDeferredInit, RssPeakIsShardsPlusLargestParameter) {
  ASSERT_EQ(c10::GetCPUAllocator(), c10::GetDefaultCPUAllocator()) << "this test measures the default allocator";
  const int ws = 2;
  const double param_bytes = 2048.0 * 2048 * 4, total = 8 * param_bytes;
  double baseline = 0, peak = 0;
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    barrier(*pg);
    if (pg->rank() == 0) {
      reset_peak_rss();
      baseline = rss_bytes("VmRSS");
    }
    barrier(*pg);
    {
      auto m = deferred_init([] { return Big(/*layers=*/8); });
      for (const auto& l : *m->layers) fully_shard(l, FullyShardOptions().mesh(mesh));
      fully_shard(m.ptr(), FullyShardOptions().mesh(mesh));
      materialize_module(m);
      barrier(*pg);
      if (pg->rank() == 0) peak = rss_bytes("VmHWM");
      barrier(*pg);
    }
  });
  const double bound = 1.1 * ws * (total / ws + param_bytes);
  std::printf("[memory] RSS growth %.1f MiB for %d ranks during deferred_init + fully_shard + materialize_module "
              "(bound %.1f MiB; the shards alone %.1f MiB)\n",
              (peak - baseline) / 1048576.0, ws, bound / 1048576.0, total / 1048576.0);
  EXPECT_LE(peak - baseline, bound);
  EXPECT_GE(peak - baseline, total) << "the shards alone are that big: the measurement is off";
}

TEST(LargeModelDeferredInit, ForwardBeforeMaterializeNamesTheParameter) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {}, pg);
    auto m = deferred_init([] { return DeferNet(); });
    shard(m, mesh);
    try {
      (void)m->forward(make_batches(1, 4, kSeq)[0].idx);
      ADD_FAILURE() << "forward on unmaterialised parameters did not throw";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("deferred_init"), std::string::npos) << msg;
      EXPECT_NE(msg.find("materialize_module"), std::string::npos) << msg;
      EXPECT_NE(msg.find("parameter 'tied'"), std::string::npos) << msg;  // the first in named_parameters order
    }
  });
}

struct ReadsValueImpl : torch::nn::Module {
  torch::Tensor w;
  ReadsValueImpl() {
    w = register_parameter("w", torch::randn({4}));
    if (w.sum().item<float>() > 100) w.mul_(2);  // reads a value: impossible on meta
  }
};
TORCH_MODULE(ReadsValue);

TEST(LargeModelDeferredInit, ConstructorThatReadsValuesIsRefused) {
  try {
    (void)deferred_init([] { return ReadsValue(); });
    ADD_FAILURE() << "no error for .item() in a deferred constructor";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("deferred_init: the constructor reads a tensor's value"), std::string::npos)
        << e.what();
  }
  // The thread is usable again: a plain tensor is real.
  EXPECT_FALSE(torch::ones({2}).is_meta());
  try {
    materialize_module(std::make_shared<torch::nn::LinearImpl>(2, 2));
    ADD_FAILURE() << "no error for a module without deferred tensors";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no parameter or buffer waiting"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fsdp::testing
