// How dcp::save writes (CTest label: checkpoint): SaveOptions::thread_count splits each rank's chunks
// over parallel writers (files of about equal size) holding exactly the tensors the single writer
// writes, in both formats; async_save's staging buffers are kept and reused across saves of the same
// shapes (SaveOptions::cache_staging) without ever saving stale data, and replaced when the shapes change;
// a blocking save copies what is not contiguous CPU memory at most per_thread_copy_ahead bytes ahead of
// each writer, into files identical to those of copying everything first.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/copy_ahead.h"
#include "checkpoint/save_plan.h"
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

std::string bytes_of_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Strided views (transposes and every other column: each needs a copy before it is written) of
/// 8..64 KiB, and one contiguous tensor, which is written as it is.
std::vector<std::pair<std::string, torch::Tensor>> strided_tensors() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  auto g = at::detail::createCPUGenerator(17);
  for (int i = 0; i < 6; ++i) {
    auto base = torch::randn({64, 32 * (i + 1)}, g);
    out.emplace_back("w" + std::to_string(i), i % 2 ? base.t() : base.slice(1, 0, c10::nullopt, 2));
  }
  out.emplace_back("contiguous", torch::arange(1000, torch::kFloat64));
  return out;
}
StateDict state_dict_of(const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  StateDict sd;
  for (const auto& [k, v] : tensors) sd.insert_or_assign(k, v);
  return sd;
}

// One process: copy ahead with budgets of 0 (everything first), 20 KB (a few tensors ahead), 1 byte
// (one at a time: every tensor is larger), and with 2 writers; the shard files are identical byte for
// byte in both formats, the tensors equal the sources, and the copies held at once stay within the budget
// or one tensor.
TEST_P(Writers, CopyAheadWritesTheSameFilesWithinItsBudget) {
  const auto base = temp_dir("copy_ahead");
  const bool distcp = GetParam() == dcp::StorageFormat::Distcp;
  const auto tensors = strided_tensors();
  const auto sd = state_dict_of(tensors);
  int64_t largest = 0, total = 0;
  for (const auto& [k, v] : tensors) {
    if (!v.is_contiguous()) {
      largest = std::max<int64_t>(largest, v.nbytes());
      total += v.nbytes();
    }
  }
  auto opts = [&] { return dcp::SaveOptions().storage_format(GetParam()); };
  dcp::save(sd, base + "/zero", opts().per_thread_copy_ahead(0));
  EXPECT_EQ(dcp::detail::last_copy_ahead_peak_bytes(), 0);  // staged before writing: no copier
  dcp::save(sd, base + "/budget", opts().per_thread_copy_ahead(20'000));
  EXPECT_GT(dcp::detail::last_copy_ahead_peak_bytes(), 0);
  EXPECT_LE(dcp::detail::last_copy_ahead_peak_bytes(), std::max<int64_t>(20'000, largest));
  dcp::save(sd, base + "/one", opts().per_thread_copy_ahead(1));
  EXPECT_LE(dcp::detail::last_copy_ahead_peak_bytes(), largest);
  dcp::save(sd, base + "/all", opts());  // 10 MB: everything may go ahead (how far depends on timing)
  EXPECT_GE(dcp::detail::last_copy_ahead_peak_bytes(), largest);
  EXPECT_LE(dcp::detail::last_copy_ahead_peak_bytes(), total);
  dcp::save(sd, base + "/two", opts().per_thread_copy_ahead(20'000).thread_count(2));
  const auto shard = distcp ? std::string("__0_0.distcp") : dcp::detail::shard_file_name(0);
  const auto want = bytes_of_file(base + "/zero/" + shard);
  for (const char* d : {"budget", "one", "all"}) EXPECT_EQ(bytes_of_file(base + "/" + d + "/" + shard), want) << d;
  for (const char* d : {"zero", "budget", "one", "all", "two"}) {
    auto info = dcp::inspect(base + "/" + d);
    for (const auto& [k, v] : tensors) EXPECT_TRUE(torch::equal(dcp::read_tensor(info, k), v)) << d << " " << k;
    EXPECT_TRUE(dcp::verify(base + "/" + d).empty()) << d;
  }
}

// A write that fails while the copier is ahead of it: the save fails with the writer's error, stops its
// copier (no hang, no crash), leaves nothing behind, and the next save works; a negative budget is
// refused by name before anything is written.
TEST(CheckpointWriters, CopyAheadStopsWhenAWriteFails) {
  const auto base = temp_dir("copy_ahead_fail");
  const auto sd = state_dict_of(strided_tensors());
  dcp::detail::set_fault_hook([](const dcp::detail::FaultPoint& p) {
    if (p.stage == "write" && p.bytes_written > 20'000) throw std::runtime_error("injected failure at write");
  });
  try {
    dcp::save(sd, base + "/fails", dcp::SaveOptions().per_thread_copy_ahead(40'000));
    ADD_FAILURE() << "the save should have failed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("injected failure at write"), std::string::npos) << e.what();
  }
  dcp::detail::set_fault_hook(nullptr);
  EXPECT_FALSE(fs::exists(base + "/fails"));
  for (const auto& e : fs::directory_iterator(base)) ADD_FAILURE() << "left behind: " << e.path();
  try {
    dcp::save(sd, base + "/negative", dcp::SaveOptions().per_thread_copy_ahead(-1));
    ADD_FAILURE() << "a negative per_thread_copy_ahead should be refused";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("per_thread_copy_ahead must be at least 0 bytes, got -1"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(base + "/negative"));
  dcp::save(sd, base + "/works", dcp::SaveOptions().per_thread_copy_ahead(40'000));
  EXPECT_TRUE(dcp::verify(base + "/works").empty());
}

}  // namespace
}  // namespace fsdp::testing
