// How dcp::save writes (CTest label: checkpoint): SaveOptions::thread_count splits each rank's chunks
// over parallel writers (files of about equal size) holding exactly the tensors the single writer
// writes, in both formats; async_save's staging buffers are kept and reused across saves of the same
// shapes (SaveOptions::cache_staging) without ever saving stale data, and replaced when the shapes change.
#include <gtest/gtest.h>

#include <filesystem>

#include "checkpoint/safetensors.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

std::vector<Batch> batches() {
  static auto b = make_batches(4, kCkptBatch, kCkptSeq, 531);
  return b;
}

std::vector<std::string> files_of(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class Writers : public ::testing::TestWithParam<dcp::StorageFormat> {};

// 2 ranks, thread_count 1 and 3: 3 files per rank, the same tensors bit for bit, both load on 3 ranks.
TEST_P(Writers, ThreadCountWritesTheSameTensorsInMoreFiles) {
  const auto base = temp_dir("writers");
  const bool distcp = GetParam() == dcp::StorageFormat::Distcp;
  FullState saved;
  std::mutex mu;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7);
    t.step(batches()[0]);
    auto sd = get_state_dict(t.net, *t.opt);
    dcp::save(sd, base + "/one", dcp::SaveOptions().storage_format(GetParam()));
    dcp::save(sd, base + "/three", dcp::SaveOptions().storage_format(GetParam()).thread_count(3));
    auto s = full_state(t);
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = s;
  });
  const auto one = files_of(base + "/one"), three = files_of(base + "/three");
  const std::vector<std::string> want_three =
      distcp ? std::vector<std::string>{".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp",
                                        "__1_0.distcp", "__1_1.distcp", "__1_2.distcp"}
             : std::vector<std::string>{dcp::kMetadataFileName,
                                        "shard-00001-model-00001-of-00003.safetensors",
                                        "shard-00001-model-00002-of-00003.safetensors",
                                        "shard-00001-model-00003-of-00003.safetensors",
                                        "shard-00002-model-00001-of-00003.safetensors",
                                        "shard-00002-model-00002-of-00003.safetensors",
                                        "shard-00002-model-00003-of-00003.safetensors"};
  EXPECT_EQ(three, want_three);  // distcp: __0_3 holds rank 0's Values
  EXPECT_EQ(one.size(), distcp ? 4u : 3u);
  auto a = dcp::inspect(base + "/one"), b = dcp::inspect(base + "/three");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [k, _] : a.tensors) {
    EXPECT_TRUE(torch::equal(dcp::read_tensor(a, k), dcp::read_tensor(b, k))) << k;
  }
  EXPECT_EQ(a.values, b.values);
  EXPECT_TRUE(dcp::verify(base + "/three").empty());
  // The files of one rank hold about equal bytes (largest tensors spread first).
  std::vector<int64_t> sizes;
  for (const auto& f : b.files)
    if (f.rank == 0 && f.name.find("__0_3") == std::string::npos) sizes.push_back(f.bytes);
  ASSERT_EQ(sizes.size(), 3u);
  EXPECT_LT(*std::max_element(sizes.begin(), sizes.end()), 3 * *std::min_element(sizes.begin(), sizes.end()));
  run_ranks(3, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto sd = get_state_dict(t.net, *t.opt);
    dcp::load(sd, base + "/three");
    set_state_dict(t.net, *t.opt, sd);
    EXPECT_EQ(diff_states(full_state(t), saved), "");
  });
}

INSTANTIATE_TEST_SUITE_P(Formats, Writers,
                         ::testing::Values(dcp::StorageFormat::Safetensors, dcp::StorageFormat::Distcp),
                         [](const auto& info) {
                           return info.param == dcp::StorageFormat::Distcp ? std::string("Distcp")
                                                                           : std::string("Safetensors");
                         });

// Three async saves of the same state dict: the 2nd and 3rd stage into the 1st's buffers, and each
// checkpoint holds the state at its own call (an optimizer step runs while the previous save writes).
// A state dict of other shapes gets fresh buffers; cache_staging(false) keeps none.
TEST(CheckpointWriters, AsyncSaveReusesItsStagingBuffersAndNeverSavesStaleData) {
  dcp::detail::clear_staging_cache();
  const auto base = temp_dir("staging");
  const int64_t reuses0 = dcp::detail::staging_cache_reuses();
  std::vector<FullState> at_call(3);
  std::mutex mu;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7);
    std::vector<std::future<void>> futs;
    for (int i = 0; i < 3; ++i) {
      t.step(batches()[i]);
      auto s = full_state(t);
      if (pg->rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        at_call[i] = s;
      }
      futs.push_back(dcp::async_save(get_state_dict(t.net, *t.opt), base + "/step-" + std::to_string(i)));
      futs.back().wait();  // the buffers return to the cache when the write ends
    }
    for (auto& f : futs) f.get();
  });
  EXPECT_EQ(dcp::detail::staging_cache_reuses() - reuses0, 4);  // 2 ranks x the 2nd and 3rd saves
  for (int i = 0; i < 3; ++i) {
    run_ranks(2, [&](ProcessGroupPtr pg) {
      Trainer t(pg, 8);
      auto sd = get_state_dict(t.net, *t.opt);
      dcp::load(sd, base + "/step-" + std::to_string(i));
      set_state_dict(t.net, *t.opt, sd);
      EXPECT_EQ(diff_states(full_state(t), at_call[i]), "") << "step-" << i;
    });
  }
  // Other shapes: nothing to reuse; without caching: nothing kept.
  const int64_t reuses1 = dcp::detail::staging_cache_reuses();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    StateDict sd;
    sd.insert_or_assign("x", torch::ones({7}));
    dcp::async_save(sd, base + "/other", dcp::SaveOptions().group(pg)).get();
    sd.insert_or_assign("x", torch::full({7}, 2.0));
    dcp::async_save(sd, base + "/nocache-1", dcp::SaveOptions().group(pg).cache_staging(false)).get();
    dcp::async_save(sd, base + "/nocache-2", dcp::SaveOptions().group(pg).cache_staging(false)).get();
  });
  EXPECT_EQ(dcp::detail::staging_cache_reuses(), reuses1);
  EXPECT_TRUE(torch::equal(dcp::read_tensor(dcp::inspect(base + "/nocache-2"), "x"), torch::full({7}, 2.0)));
  dcp::detail::clear_staging_cache();
}

}  // namespace
}  // namespace fsdp::testing
