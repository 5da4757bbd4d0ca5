// Distributed checkpoints (CTest label: checkpoint): save and load on any world size, bit-exact;
// resume equivalence; async save; atomicity; and every bad input failing clearly without changing the
// model or the optimizer; an unchanged LibTorch model's round trip and resume (Unchanged: label
// unchanged_models, common/unchanged_harness.h; this file instantiates that fixture for test_checkpoint).
// Ranks are threads over Gloo (common/multi_rank.h). The crash of a real process (kill -9 mid-save) and the
// interop with PyTorch are in tests/python/test_checkpoint_interop.py.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/safetensors.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

std::vector<Batch> batches() {
  static auto b = make_batches(8, kCkptBatch, kCkptSeq, 1234);
  return b;
}

/// Trains `steps` steps on `world` ranks (seed 7), saves into `dir`; returns the full state at the save.
FullState train_and_save(int world, int steps, const std::string& dir, std::vector<int64_t> mesh_shape = {}) {
  FullState saved;
  std::mutex mu;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7, OptimKind::ADAMW, mesh_shape);
    for (int i = 0; i < steps; ++i) t.step(batches()[i]);
    dcp::save(get_state_dict(t.net, *t.opt), dir, dcp::SaveOptions().update_latest(true));
    auto s = full_state(t);
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = s;
  });
  return saved;
}

/// Loads `dir` on `world` ranks into a fresh model (seed 8) and fresh optimizer; checks that the full
/// state equals `expect` bit for bit on every rank.
void load_and_compare(int world, const std::string& dir, const FullState& expect) {
  run_ranks(world, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto sd = get_state_dict(t.net, *t.opt);
    dcp::load(sd, dir);
    set_state_dict(t.net, *t.opt, sd);
    EXPECT_EQ(diff_states(full_state(t), expect), "") << "loading " << dir << " on " << world << " ranks, rank "
                                                      << pg->rank();
  });
}

TEST(Checkpoint, Crc32cMatchesTheStandardAndItsBlockwiseForm) {
  EXPECT_EQ(dcp::detail::crc32c(0, "123456789", 9), 0xE3069283u);  // the CRC-32C check value
  std::vector<uint8_t> data(1000003);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  const int64_t block = 4096;
  auto crcs = dcp::detail::block_crcs(data.data(), data.size(), block);  // three blocks at a time
  ASSERT_EQ(crcs.size(), (data.size() + block - 1) / block);
  for (size_t b = 0; b < crcs.size(); ++b) {
    size_t n = std::min<size_t>(block, data.size() - b * block);
    EXPECT_EQ(crcs[b], dcp::detail::crc32c(0, data.data() + b * block, n)) << "block " << b;
  }
  EXPECT_EQ(dcp::detail::crc32c(dcp::detail::crc32c(0, data.data(), 5000), data.data() + 5000, data.size() - 5000),
            dcp::detail::crc32c(0, data.data(), data.size()));
}

TEST(Checkpoint, RoundTripIsBitExact) {
  auto dir = temp_dir("roundtrip") + "/step-3";
  auto saved = train_and_save(2, 3, dir);
  EXPECT_EQ(saved.values.at("optim.state.wte.weight.step"), 3);
  load_and_compare(2, dir, saved);
  EXPECT_TRUE(dcp::verify(dir).empty());
  EXPECT_EQ(dcp::latest(fs::path(dir).parent_path().string()), dir);
  // The layout PyTorch's HuggingFaceStorageReader expects.
  EXPECT_TRUE(fs::exists(fs::path(dir) / "shard-00001-model-00001-of-00001.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "shard-00002-model-00001-of-00001.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / dcp::kMetadataFileName));
}

// Saved on 4 ranks, loaded on 1, 2 and 3; saved on 3, loaded on 4. head.weight [2, 6] and scale [1]
// have fewer rows than ranks (empty shards on both sides).
TEST(Checkpoint, ReshardsToAnyWorldSize) {
  auto base = temp_dir("reshard");
  auto saved4 = train_and_save(4, 2, base + "/from4");
  for (int world : {1, 2, 3}) load_and_compare(world, base + "/from4", saved4);
  auto saved3 = train_and_save(3, 2, base + "/from3");
  load_and_compare(4, base + "/from3", saved3);
  auto info = dcp::inspect(base + "/from4");
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.tensors.at("model.head.weight").chunks.size(), 2u);  // ranks 2 and 3 hold no rows
}

// HSDP: a (replicate 2, shard 2) mesh writes each shard once; a 1-D job of 3 ranks loads it.
TEST(Checkpoint, HsdpMeshSavesOneReplicaAndLoadsOnOneDimMesh) {
  auto dir = temp_dir("hsdp") + "/ck";
  auto saved = train_and_save(4, 2, dir, {2, 2});
  auto info = dcp::inspect(dir);
  EXPECT_EQ(info.mesh_shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(info.tensors.at("model.wte.weight").chunks.size(), 2u);
  EXPECT_TRUE(dcp::verify(dir).empty());
  load_and_compare(3, dir, saved);
}

// Train k steps, save, train m more; versus load and train m: identical losses and weights.
TEST(Checkpoint, ResumeIsBitIdentical) {
  auto dir = temp_dir("resume") + "/step-3";
  const int k = 3, m = 3;
  std::vector<float> straight, resumed;
  FullState straight_end, resumed_end;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    for (int i = 0; i < k; ++i) t.step(batches()[i]);
    dcp::save(get_state_dict(t.net, *t.opt), dir);
    std::vector<float> losses;
    for (int i = k; i < k + m; ++i) losses.push_back(t.step(batches()[i]));
    auto s = full_state(t);
    if (pg->rank() == 0) straight = losses, straight_end = s;
  });
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, /*seed=*/8);
    auto sd = get_state_dict(t.net, *t.opt);
    dcp::load(sd, dir);
    set_state_dict(t.net, *t.opt, sd);
    std::vector<float> losses;
    for (int i = k; i < k + m; ++i) losses.push_back(t.step(batches()[i]));
    auto s = full_state(t);
    if (pg->rank() == 0) resumed = losses, resumed_end = s;
  });
  EXPECT_EQ(straight, resumed);
  EXPECT_EQ(diff_states(straight_end, resumed_end), "");
}

// async_save returns once staged: an optimizer step right after cannot change what is written.
TEST(Checkpoint, AsyncSaveHoldsThePreStepValues) {
  auto dir = temp_dir("async") + "/ck";
  FullState before;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    t.step(batches()[0]);
    auto s = full_state(t);
    auto fut = dcp::async_save(get_state_dict(t.net, *t.opt), dir);
    t.step(batches()[1]);  // collectives on the group while the save runs in the background
    {
      torch::NoGradGuard g;
      for (auto& p : t.net->parameters()) p.add_(1.0);
    }
    fut.get();
    if (pg->rank() == 0) before = s;
  });
  load_and_compare(2, dir, before);
}

TEST(Checkpoint, AsyncSavesCompleteInOrderAndMoveLatest) {
  auto base = temp_dir("async_chain");
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    std::vector<std::future<void>> futs;
    for (int i = 0; i < 3; ++i) {
      t.step(batches()[i]);
      futs.push_back(dcp::async_save(get_state_dict(t.net, *t.opt), base + "/step-" + std::to_string(i),
                                     dcp::SaveOptions().keep_last(2).update_latest(true)));
    }
    for (auto& f : futs) f.get();
  });
  EXPECT_EQ(dcp::latest(base), base + "/step-2");
  EXPECT_FALSE(fs::exists(base + "/step-0"));  // keep_last(2)
  EXPECT_TRUE(fs::exists(base + "/step-1"));
}

TEST(Checkpoint, ValuesPlainTensorsAndPerRankState) {
  auto dir = temp_dir("values") + "/ck";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    StateDict sd;
    sd.insert_or_assign("rng", torch::arange(10, torch::kUInt8));
    sd.insert_or_assign("scalar", torch::tensor(2.5, torch::kFloat64));
    sd.insert_or_assign("config", Value(nlohmann::json{{"lr", 0.1}, {"name", "gpt"}}));
    sd.insert_or_assign("loader", per_rank_value(100 + pg->rank()));
    dcp::save(sd, dir);
    StateDict back;
    back.insert_or_assign("rng", torch::zeros({10}, torch::kUInt8));
    back.insert_or_assign("scalar", torch::tensor(0.0, torch::kFloat64));
    back.insert_or_assign("config", Value());
    back.insert_or_assign("loader", per_rank_value(nullptr));
    dcp::load(back, dir);
    EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(back.at("rng")), torch::arange(10, torch::kUInt8)));
    EXPECT_EQ(std::get<torch::Tensor>(back.at("scalar")).item<double>(), 2.5);
    EXPECT_EQ(std::get<Value>(back.at("config")).json["name"], "gpt");
    EXPECT_EQ(std::get<Value>(back.at("loader")).json, 100 + pg->rank());
  });
  // Per-rank state cannot be resharded: a clear error on another world size.
  auto errors = run_ranks_collect(3, [&](ProcessGroupPtr pg) {
    StateDict back;
    back.insert_or_assign("loader", per_rank_value(nullptr));
    dcp::load(back, dir, dcp::LoadOptions().strict(false));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("'loader' is per-rank state saved by 2 ranks"), std::string::npos) << e;
    EXPECT_NE(e.find("cannot be resharded"), std::string::npos) << e;
  }
}

TEST(Checkpoint, ExistingFolderNeedsOverwrite) {
  auto dir = temp_dir("overwrite") + "/ck";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    dcp::save(get_state_dict(t.net, *t.opt), dir);
    try {
      dcp::save(get_state_dict(t.net, *t.opt), dir);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
    }
    t.step(batches()[0]);
    dcp::save(get_state_dict(t.net, *t.opt), dir, dcp::SaveOptions().overwrite(true));
  });
  EXPECT_EQ(dcp::inspect(dir).values.at("optim.state.wte.weight.step"), 1);
  EXPECT_TRUE(dcp::verify(dir).empty());
}

// ---- Atomicity: a failure at any point of a save leaves the previous checkpoint and `latest` ----------

class FailAt : public ::testing::TestWithParam<std::string> {};

TEST_P(FailAt, PreviousCheckpointSurvives) {
  const std::string stage = GetParam();
  auto base = temp_dir("failat_" + stage);
  auto saved = train_and_save(2, 1, base + "/step-1");
  dcp::detail::set_fault_hook([stage](const dcp::detail::FaultPoint& p) {
    // "write" fires after each tensor of each rank's file: fail rank 1's file midway.
    if (p.stage == stage && (stage != "write" || (p.path.find("shard-00002") != std::string::npos && p.bytes_written > 1000)))
      throw std::runtime_error("injected failure at " + stage);
  });
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    t.step(batches()[0]);
    t.step(batches()[1]);
    dcp::save(get_state_dict(t.net, *t.opt), base + "/step-2", dcp::SaveOptions().update_latest(true));
  });
  dcp::detail::set_fault_hook(nullptr);
  const bool committed = stage == "before_latest";  // the folder is complete; only `latest` did not move
  for (const auto& e : errors) EXPECT_NE(e.find("injected failure at " + stage), std::string::npos) << e;
  EXPECT_EQ(dcp::latest(base), base + "/step-1");
  EXPECT_EQ(fs::exists(base + "/step-2"), committed);
  for (const auto& e : fs::directory_iterator(base))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  EXPECT_TRUE(dcp::verify(base + "/step-1").empty());
  load_and_compare(2, base + "/latest", saved);
}
INSTANTIATE_TEST_SUITE_P(Stages, FailAt, ::testing::Values("write", "before_metadata", "before_rename", "before_latest"));

// ---- Bad input: a clear error naming the file and the FQN, and nothing changed --------------------------

struct Corrupted {
  std::string dir;
  FullState saved;
};

/// A 2-rank checkpoint copied into a fresh folder for each corruption.
Corrupted fresh_copy(const std::string& name) {
  static std::string master;
  static FullState saved;
  if (master.empty()) {
    master = temp_dir("bad_master") + "/ck";
    saved = train_and_save(2, 2, master);
  }
  auto dir = temp_dir("bad_" + name) + "/ck";
  fs::copy(master, dir, fs::copy_options::recursive);
  return {dir, saved};
}

/// Loads `dir` on 2 ranks (model and optimizer trained one step: both hold state); expects every rank to
/// fail with a message containing each needle and the model and optimizer to be unchanged.
void expect_load_error(const std::string& dir, const std::vector<std::string>& needles,
                       const std::function<void(StateDict&)>& edit = nullptr, dcp::LoadOptions opts = {}) {
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    t.step(batches()[5]);
    auto before = local_state(t);
    auto sd = get_state_dict(t.net, *t.opt);
    if (edit) edit(sd);
    try {
      dcp::load(sd, dir, opts);
    } catch (...) {
      EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank() << ": the failed load changed state";
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(errors[r].empty()) << "rank " << r << " loaded " << dir << " without error";
    for (const auto& n : needles) EXPECT_NE(errors[r].find(n), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("nothing was loaded"), std::string::npos) << errors[r];
  }
  std::printf("[bad input] %s\n", errors[1].c_str());
}

TEST(BadInput, MissingFile) {
  auto c = fresh_copy("missing");
  fs::remove(c.dir + "/shard-00002-model-00001-of-00001.safetensors");
  expect_load_error(c.dir, {"shard-00002-model-00001-of-00001.safetensors is missing", "'model."});
  EXPECT_FALSE(dcp::verify(c.dir).empty());
}

TEST(BadInput, TruncatedFile) {
  auto c = fresh_copy("truncated");
  auto f = c.dir + "/shard-00001-model-00001-of-00001.safetensors";
  fs::resize_file(f, fs::file_size(f) - 10);
  expect_load_error(c.dir, {"shard-00001-model-00001-of-00001.safetensors is truncated", "'model."});
}

TEST(BadInput, ChecksumMismatch) {
  auto c = fresh_copy("checksum");
  auto f = c.dir + "/shard-00002-model-00001-of-00001.safetensors";
  {
    std::fstream s(f, std::ios::in | std::ios::out | std::ios::binary);
    s.seekp(-3, std::ios::end);  // the last tensor's data
    char x = 0x5a;
    s.write(&x, 1);
  }
  expect_load_error(c.dir, {"checksum mismatch in " + c.dir + "/shard-00002-model-00001-of-00001.safetensors",
                            "reading 'optim.state.head.bias.exp_avg_sq'"});
  auto problems = dcp::verify(c.dir);
  ASSERT_EQ(problems.size(), 1u);
}

// The same on a resharded load (2 -> 3 ranks; each rank reading its own pieces, and with [Note: one reader
// per file region], where ranks read a file behind its reader): every rank fails together, without
// waiting for the group's timeout, and nothing is loaded.
TEST(BadInput, ChecksumMismatchInAReshardedLoad) {
  auto c = fresh_copy("checksum_reshard");
  const auto f = c.dir + "/shard-00002-model-00001-of-00001.safetensors";
  {
    std::fstream s(f, std::ios::in | std::ios::out | std::ios::binary);
    s.seekp(-3, std::ios::end);
    char x = 0x5a;
    s.write(&x, 1);
  }
  for (bool prefetch : {false, true}) {
  dcp::detail::set_cooperative_prefetch(prefetch);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        Trainer t(pg, 8);
        t.step(batches()[5]);
        auto before = local_state(t);
        auto sd = get_state_dict(t.net, *t.opt);
        try {
          dcp::load(sd, c.dir);
        } catch (...) {
          EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank() << ": the failed load changed state";
          throw;
        }
      },
      std::chrono::seconds(90), std::chrono::seconds(30));
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("checksum mismatch in " + f), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("nothing was loaded"), std::string::npos) << errors[r];
  }
  // Measured about 0.06 s; a rank left waiting would take the 30 s timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15)) << "prefetch " << prefetch;
  }
  dcp::detail::set_cooperative_prefetch(false);
}

TEST(BadInput, ShapeMismatch) {
  auto c = fresh_copy("shape");
  expect_load_error(c.dir, {"'model.blocks.1.fc2.weight' has shape [6, 5] in", "but [6, 4] in the state dict"},
                    [](StateDict& sd) { sd.insert_or_assign("model.blocks.1.fc2.weight", torch::zeros({6, 4})); });
}

TEST(BadInput, DtypeMismatch) {
  auto c = fresh_copy("dtype");
  expect_load_error(c.dir, {"'model.head.bias' has dtype Float in", "but Double in the state dict"},
                    [](StateDict& sd) { sd.insert_or_assign("model.head.bias", torch::zeros({2}, torch::kFloat64)); });
}

TEST(BadInput, MissingKeyWithStrict) {
  auto c = fresh_copy("missing_key");
  expect_load_error(c.dir, {"key(s) of the state dict are not in", "'model.extra'"},
                    [](StateDict& sd) { sd.insert_or_assign("model.extra", torch::zeros({3})); });
}

TEST(BadInput, UnexpectedKeyWithStrict) {
  auto c = fresh_copy("unexpected_key");
  expect_load_error(c.dir, {"key(s) no rank's state dict does", "'optim."},
                    [](StateDict& sd) { sd = sd.with_prefix("model.", /*strip=*/false); });
}

TEST(BadInput, MalformedMetadata) {
  auto c = fresh_copy("metadata");
  fs::resize_file(c.dir + "/" + dcp::kMetadataFileName, 100);
  expect_load_error(c.dir, {std::string(dcp::kMetadataFileName) + " is not valid JSON"});
}

TEST(BadInput, RanksWhoseStateDictsDisagreeAtSave) {
  // The same key with another shape on another rank: refused, nothing left behind.
  auto dir = temp_dir("disagree") + "/ck";
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("extra", torch::zeros({pg->rank() == 1 ? 3 : 2}));
    dcp::save(sd, dir);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("the ranks' state dicts disagree: 'extra' is"), std::string::npos) << e;
    EXPECT_NE(e.find("[2]"), std::string::npos) << e;
    EXPECT_NE(e.find("[3]"), std::string::npos) << e;
    EXPECT_NE(e.find("on rank 1"), std::string::npos) << e;
  }
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_FALSE(dcp::latest(fs::path(dir).parent_path().string()));
}

// Ranks may hold different keys (pipeline stages each hold their own): the checkpoint holds the union,
// a plain tensor only one rank holds is written by that rank, and a strict load of the same layout
// (each rank asking for its own keys) finds every key asked for by some rank.
TEST(Checkpoint, RanksWithDifferentKeysSaveTheirUnion) {
  auto dir = temp_dir("union") + "/ck";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg);
    auto sd = get_state_dict(t.net, *t.opt);
    if (pg->rank() == 1) sd.insert_or_assign("only_on_1", torch::arange(5, torch::kFloat));
    if (pg->rank() == 1) sd.insert_or_assign("value_on_1", Value(nlohmann::json(7)));
    dcp::save(sd, dir);
    auto back = get_state_dict(t.net, *t.opt);
    if (pg->rank() == 1) back.insert_or_assign("only_on_1", torch::zeros({5}));
    if (pg->rank() == 1) back.insert_or_assign("value_on_1", Value(nlohmann::json(0)));
    dcp::load(back, dir);
    if (pg->rank() == 1) {
      EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(back.at("only_on_1")), torch::arange(5, torch::kFloat)));
      EXPECT_EQ(std::get<Value>(back.at("value_on_1")).json, nlohmann::json(7));
    }
    // A key no rank asks for is still an error under strict.
    auto partial = get_state_dict(t.net, *t.opt);
    try {
      dcp::load(partial, dir);
      ADD_FAILURE() << "a strict load without 'only_on_1' on any rank succeeded";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("no rank's state dict does"), std::string::npos) << e.what();
    }
  });
  auto info = dcp::inspect(dir);
  EXPECT_TRUE(info.tensors.count("only_on_1"));
}

// A full disk during save: a real ENOSPC from a tiny tmpfs when this process can mount one in a private
// user+mount namespace (unshare -rm), else a real ENOSPC from /dev/full: the fault hook swaps /dev/full
// in under the descriptor of rank 1's file after its first tensor, so the library's next write() fails
// with ENOSPC from the kernel. Either way every message checked below is the library's own text.
TEST(BadInput, FullDiskDuringSave) {
  const char* inner = std::getenv("FSDP_TEST_TMPFS");
  if (!inner) {
    auto mnt = temp_dir("tmpfs");
    std::string self = fs::read_symlink("/proc/self/exe").string();
    // The inner run leaves a marker next to the mount point, so that a failing test is told apart from
    // an unshare or mount that is not permitted here.
    const std::string marker = mnt + ".ran";
    fs::remove(marker);
    std::string cmd = "unshare -rm sh -c 'mount -t tmpfs -o size=256k tmpfs " + mnt + " && FSDP_TEST_TMPFS=" + mnt +
                      " exec " + self + " --gtest_filter=BadInput.FullDiskDuringSave' 2>&1";
    int rc = std::system(cmd.c_str());
    if (fs::exists(marker)) {
      EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << "the tmpfs run of this test failed (see above)";
      std::printf("[full disk] real ENOSPC on a 256 KiB tmpfs (unshare -rm)\n");
      return;
    }
    std::printf("[full disk] no private tmpfs (unshare -rm unavailable): ENOSPC from /dev/full instead\n");
  }
  const std::string base = inner ? std::string(inner) : temp_dir("fulldisk");
  if (inner) std::ofstream(std::string(inner) + ".ran") << "1";
  FullState saved;
  std::vector<std::string> errors;
  std::atomic<bool> full_fd_swapped{false};
  {
    std::mutex mu;
    run_ranks(2, [&](ProcessGroupPtr pg) {
      Trainer t(pg);
      t.step(batches()[0]);
      dcp::save(get_state_dict(t.net, *t.opt), base + "/step-1", dcp::SaveOptions().update_latest(true));
      auto s = full_state(t);
      if (pg->rank() == 0) saved = s;
    });
    if (!inner) {
      dcp::detail::set_fault_hook([&full_fd_swapped](const dcp::detail::FaultPoint& p) {
        if (p.stage != "write" || p.path.find("shard-00002-model") == std::string::npos ||
            full_fd_swapped.exchange(true)) {
          return;
        }
        // The file's descriptor: the /proc/self/fd link naming it (ranks are threads of this process).
        const auto target = fs::weakly_canonical(p.path);
        for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
          std::error_code ec;
          if (fs::read_symlink(e.path(), ec) != target || ec) continue;
          const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
          ASSERT_GE(full, 0) << "/dev/full: " << std::strerror(errno);
          ASSERT_GE(::dup2(full, std::stoi(e.path().filename().string())), 0) << std::strerror(errno);
          ::close(full);
          return;
        }
        ADD_FAILURE() << "no open descriptor for " << p.path;
      });
    }
    errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
      Trainer t(pg);
      t.step(batches()[0]);
      StateDict sd = get_state_dict(t.net, *t.opt);
      sd.insert_or_assign("model.big", torch::ones({512, 256}));  // 512 KiB: more than the tmpfs holds
      dcp::save(sd, base + "/step-2", dcp::SaveOptions().update_latest(true));
    });
    dcp::detail::set_fault_hook(nullptr);
  }
  if (!inner) EXPECT_TRUE(full_fd_swapped) << "the save never wrote rank 1's file";
  for (const auto& e : errors) {
    // All of it the library's text: errno's name, the file, the tensor, the advice, the outcome.
    EXPECT_NE(e.find("No space left on device (ENOSPC)"), std::string::npos) << e;
    EXPECT_NE(e.find("The disk is full: free space or save elsewhere"), std::string::npos) << e;
    EXPECT_NE(e.find(inner ? "shard-0000" : "shard-00002-model"), std::string::npos) << e;
    EXPECT_NE(e.find("writing 'model."), std::string::npos) << e;  // names the tensor being written
    EXPECT_NE(e.find("previous checkpoint and `latest` are untouched"), std::string::npos) << e;
  }
  std::printf("[full disk] %s\n", errors[0].c_str());
  EXPECT_EQ(dcp::latest(base), base + "/step-1");
  EXPECT_FALSE(fs::exists(base + "/step-2"));
  for (const auto& e : fs::directory_iterator(base))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  EXPECT_TRUE(dcp::verify(base + "/step-1").empty());
  load_and_compare(2, base + "/latest", saved);
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- An unchanged model (issue 13) ---------------------------------------------------------------------
// Train 2 steps, dcp::save, train 2 more; a model built from other weights, loaded from the checkpoint,
// holds the saved weights and trains on bit-identically.
TEST_P(Unchanged, DcpSaveLoadRoundTripAndResume) {
  const int ws = GetParam();
  auto dir = temp_dir("unchanged_" + std::to_string(ws)) + "/step-2";
  auto batches = make_batches(4, kBatch, kSeq);
  std::vector<Trace> straight(ws), resumed(ws);
  std::vector<std::map<std::string, torch::Tensor>> saved(ws), loaded(ws);
  auto step = [](const Model& m, torch::optim::Optimizer& opt, ProcessGroupPtr pg, const Batch& global) {
    const int64_t local = kBatch / pg->size();
    auto b = global.slice(pg->rank() * local, local);
    opt.zero_grad();
    auto loss = loss_fn(m.forward(b.idx), b.targets);
    loss.backward();
    opt.step();
    return global_loss(loss, *pg);
  };
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = sharded_plain(pg, {}, &net);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    for (int i = 0; i < 2; ++i) step(m, *opt, pg, batches[i]);
    dcp::save(get_state_dict(net, *opt), dir);
    saved[pg->rank()] = full_params(*net);
    for (int i = 2; i < 4; ++i) straight[pg->rank()].losses.push_back(step(m, *opt, pg, batches[i]));
    straight[pg->rank()].final_params = full_params(*net);
  });
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto net = seeded<PlainNet>();  // other weights than initial_weights()
    auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {pg->size()}));
    for (size_t i = 0; i < net->blocks->size(); ++i) fully_shard(net->blocks[i], opts);
    fully_shard(net, opts);
    Model m = as_model(net);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    auto sd = get_state_dict(net, *opt);
    dcp::load(sd, dir);
    set_state_dict(net, *opt, sd);
    loaded[pg->rank()] = full_params(*net);
    for (int i = 2; i < 4; ++i) resumed[pg->rank()].losses.push_back(step(m, *opt, pg, batches[i]));
    resumed[pg->rank()].final_params = full_params(*net);
  });
  for (int r = 0; r < ws; ++r) {
    EXPECT_FALSE(saved[r].empty());
    Trace a, b;
    a.final_params = saved[r];
    b.final_params = loaded[r];
    EXPECT_EQ(diff_traces(a, b), "") << "round trip, rank " << r;
    EXPECT_EQ(straight[r].losses.size(), 2u);
    EXPECT_EQ(diff_traces(straight[r], resumed[r]), "") << "resumed training, rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Unchanged, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
