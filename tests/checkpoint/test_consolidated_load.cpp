// Loading a consolidated safetensors checkpoint (model.safetensors, or model.safetensors.index.json and
// its shards, as consolidate() and Hugging Face write them) straight into a sharded model (CTest labels:
// checkpoint, large_model). Each rank must read only its own rows: LoadResult::bytes_read is checked to
// be exactly the headers of the files plus the bytes of the rank's local pieces. Ranks are threads over
// Gloo (common/multi_rank.h); the tiny test model has uneven and empty shards on 2 and 3 ranks. A file
// written by Python's safetensors.torch.save_file: tests/python/test_checkpoint_consolidated.py.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint/safetensors.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

/// The full tensors the checkpoints hold: the test model's weights (seed 7) and a plain tensor (an
/// unsharded entry, as a buffer is) that every rank reads in full.
std::map<std::string, torch::Tensor> full_tensors() {
  auto full = seeded_weights(7);
  full["extra.buf"] = torch::arange(12, torch::kFloat32).reshape({3, 4}) * 0.25;
  return full;
}

/// The model's sharded state dict plus the plain tensor "extra.buf" (zeros).
StateDict sharded_dict(const Trainer& t) {
  auto sd = get_model_state_dict(*t.net);
  sd.insert_or_assign("extra.buf", torch::zeros({3, 4}));
  return sd;
}

/// 8 + the header length of a safetensors file: what reading its header costs.
int64_t header_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  return static_cast<int64_t>(8 + n);
}

/// The safetensors files of a consolidated folder (all of them: every rank reads every header).
int64_t all_header_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") n += header_bytes(e.path().string());
  return n;
}

/// Checks every entry of `sd` against the rows of `expect` it should hold (bit-identical, in the
/// entry's dtype), and returns the bytes of its local pieces in the file's dtype `file_es` bytes
/// per element.
int64_t check_pieces(const StateDict& sd, const std::map<std::string, torch::Tensor>& expect, int rank,
                     int64_t file_es) {
  int64_t bytes = 0;
  for (const auto& [k, v] : sd) {
    const auto& full = expect.at(k);
    torch::Tensor local, want = full;
    if (const auto* d = std::get_if<DTensor>(&v)) {
      local = d->to_local();
      auto off = d->local_offsets();
      for (size_t i = 0; i < off.size(); ++i)
        want = want.narrow(static_cast<int64_t>(i), off[i], local.size(static_cast<int64_t>(i)));
    } else {
      local = std::get<torch::Tensor>(v);
    }
    want = want.to(local.scalar_type());
    EXPECT_TRUE(local.sizes() == want.sizes() && torch::equal(local, want))
        << "rank " << rank << ": '" << k << "' local piece " << local << " expected " << want;
    bytes += local.numel() * file_es;
  }
  return bytes;
}

/// Loads the consolidated folder `dir` into the sharded test model on `world` ranks (mesh shape
/// `mesh`), checks every local piece and the gathered model against `expect`, and that each rank
/// read exactly the headers and its pieces. Returns rank 0's bytes read.
int64_t load_and_check(int world, const std::string& dir, const std::map<std::string, torch::Tensor>& expect,
                       int64_t file_es, std::vector<int64_t> mesh = {}) {
  const int64_t headers = all_header_bytes(dir);
  std::vector<int64_t> read(world, 0);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8, OptimKind::ADAMW, mesh);
    auto sd = sharded_dict(t);
    auto res = dcp::load(sd, dir);
    EXPECT_TRUE(res.missing_keys.empty() && res.unexpected_keys.empty());
    const int64_t pieces = check_pieces(sd, expect, pg->rank(), file_es);
    EXPECT_EQ(res.bytes_read, headers + pieces) << "rank " << pg->rank() << " of " << world;
    read[pg->rank()] = res.bytes_read;
    std::printf("[bytes read] %s on %d ranks, rank %d: %lld = headers %lld + local pieces %lld\n", dir.c_str(),
                world, static_cast<int>(pg->rank()), static_cast<long long>(res.bytes_read),
                static_cast<long long>(headers), static_cast<long long>(pieces));
    // The model itself holds the values (the state dict aliases its shards).
    for (const auto& [k, v] : get_model_state_dict(*t.net, StateDictOptions().full_state_dict(true))) {
      EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(v), expect.at(k).to(torch::kFloat32)))
          << "rank " << pg->rank() << ": the model's '" << k << "' differs";
    }
  });
  return read[0];
}

TEST(ConsolidatedLoad, SingleFileIntoShardedModelReadsOnlyEachRanksRows) {
  const auto dir = temp_dir("consolidated_single");
  const auto full = full_tensors();
  dcp::save_file(full, dir + "/model.safetensors");
  int64_t total = 0;
  for (const auto& [_, t] : full) total += t.numel() * 4;
  std::vector<int64_t> rank0;
  for (int world : {1, 2, 3}) rank0.push_back(load_and_check(world, dir, full, 4));
  // One rank reads the whole file once; more ranks read less each.
  EXPECT_EQ(rank0[0], all_header_bytes(dir) + total);
  EXPECT_LT(rank0[2], rank0[1]);
  EXPECT_LT(rank0[1], rank0[0]);
}

TEST(ConsolidatedLoad, HsdpMeshReadsTheShardRowsOfEachReplica) {
  const auto dir = temp_dir("consolidated_hsdp");
  const auto full = full_tensors();
  dcp::save_file(full, dir + "/model.safetensors");
  load_and_check(4, dir, full, 4, {2, 2});  // (Replicate(), Shard(0)): ranks 0 and 2 read the same rows
}

TEST(ConsolidatedLoad, SplitLayoutWithIndexAsConsolidateWritesIt) {
  const auto ck = temp_dir("consolidated_split_src") + "/step-0";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7);
    dcp::save(sharded_dict(t), ck);  // "extra.buf" holds zeros here
  });
  const auto dir = temp_dir("consolidated_split");
  auto files = dcp::consolidate(ck, dir, dcp::ConsolidateOptions().max_file_bytes(200));
  ASSERT_GT(files.size(), 3u);
  ASSERT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  auto full = full_tensors();
  full["extra.buf"] = torch::zeros({3, 4});
  for (int world : {1, 2, 3}) load_and_check(world, dir, full, 4);
}

TEST(ConsolidatedLoad, Bf16FileIntoFp32ModelConvertsOnLoad) {
  const auto dir = temp_dir("consolidated_bf16");
  std::map<std::string, torch::Tensor> bf16;
  for (const auto& [k, t] : full_tensors()) bf16[k] = (t * 1.001).to(torch::kBFloat16);
  dcp::save_file(bf16, dir + "/model.safetensors");
  // Each rank reads the bf16 rows (2 bytes an element) and widens them exactly.
  for (int world : {2, 3}) load_and_check(world, dir, bf16, 2);
}

TEST(ConsolidatedLoad, GeneralBoxesShard1ScalarsAndNonContiguousPieces) {
  const auto dir = temp_dir("consolidated_boxes");
  torch::manual_seed(3);
  std::map<std::string, torch::Tensor> full = {{"a", torch::randn({5, 7, 3})},
                                               {"b", torch::randn({4, 6})},
                                               {"c", torch::tensor(2.5)},
                                               {"d", torch::randn({3, 8})}};
  dcp::save_file(full, dir + "/model.safetensors");
  const int64_t headers = header_bytes(dir + "/model.safetensors");
  for (int world : {2, 3}) {
    // On 3 ranks, staging buffers of 16 bytes: the staged boxes are read in slabs of one row.
    dcp::detail::set_load_stage_bytes(world == 3 ? 16 : 0);
    run_ranks(world, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      auto mesh = init_device_mesh(torch::kCPU, {world}, {"shard"}, pg);
      StateDict sd;
      // Shard(1) of a 3-D tensor: one run per (dim-0 index), each len[1] x 3 elements.
      auto ra = chunk_range(7, world, r);
      sd.insert_or_assign("a", DTensor(torch::zeros({5, ra.length, 3}), mesh, {Shard(1)}, {5, 7, 3}));
      // Shard(0) into a non-contiguous local piece (a transposed view): staged, then copied.
      auto rb = chunk_range(4, world, r);
      sd.insert_or_assign("b", DTensor(torch::zeros({6, rb.length}).t(), mesh, {Shard(0)}, {4, 6}));
      sd.insert_or_assign("c", torch::zeros({}));
      // Shard(1) of a 2-D tensor into bf16: staged in the file's dtype, converted.
      auto rd = chunk_range(8, world, r);
      sd.insert_or_assign("d", DTensor(torch::zeros({3, rd.length}, torch::kBFloat16), mesh, {Shard(1)}, {3, 8}));
      auto res = dcp::load(sd, dir);
      const int64_t pieces = check_pieces(sd, full, r, 4);
      EXPECT_EQ(res.bytes_read, headers + pieces) << "rank " << r << " of " << world;
    });
  }
  dcp::detail::set_load_stage_bytes(0);
}

TEST(ConsolidatedLoad, LargeTensorEachRankReadsOnlyItsRows) {
  // 12 MiB in fp32 (and 6 MiB in bf16): the headers are negligible, each rank reads about 1/N.
  const auto dir32 = temp_dir("consolidated_large_fp32"), dir16 = temp_dir("consolidated_large_bf16");
  torch::manual_seed(4);
  const auto w = torch::randn({3001, 1024});
  dcp::save_file({{"w", w}}, dir32 + "/model.safetensors");
  dcp::save_file({{"w", w.to(torch::kBFloat16)}}, dir16 + "/model.safetensors");
  const int world = 2;
  dcp::detail::set_load_stage_bytes(1 << 20);  // bf16 -> fp32 staged in slabs of 512 rows
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    auto mesh = init_device_mesh(torch::kCPU, {world}, {"shard"}, pg);
    auto rows = chunk_range(3001, world, r);
    for (const auto& [dir, es] : {std::pair<std::string, int64_t>{dir32, 4}, {dir16, 2}}) {
      StateDict sd;
      sd.insert_or_assign("w", DTensor(torch::zeros({rows.length, 1024}), mesh, {Shard(0)}, {3001, 1024}));
      auto res = dcp::load(sd, dir);
      const auto& local = std::get<DTensor>(sd.at("w")).to_local();
      auto want = (es == 4 ? w : w.to(torch::kBFloat16).to(torch::kFloat32)).narrow(0, rows.offset, rows.length);
      EXPECT_TRUE(torch::equal(local, want)) << "rank " << r << ", " << dir;
      const int64_t expect = header_bytes(dir + "/model.safetensors") + rows.length * 1024 * es;
      EXPECT_EQ(res.bytes_read, expect) << "rank " << r << ", " << dir;
      std::printf("[bytes read] %s, rank %d of %d: %lld of the file's %lld bytes (rows [%lld, %lld))\n",
                  dir.c_str(), r, world, static_cast<long long>(res.bytes_read),
                  static_cast<long long>(fs::file_size(dir + "/model.safetensors")),
                  static_cast<long long>(rows.offset), static_cast<long long>(rows.offset + rows.length));
    }
  });
  dcp::detail::set_load_stage_bytes(0);
}

// ---------------------------------------------------------------------------------------------
// Bad input: every rank throws, naming the FQN or file and the rank, and nothing is loaded.

void expect_consolidated_error(const std::string& dir, const std::vector<std::string>& needles,
                               dcp::LoadOptions opts = {}) {
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto sd = sharded_dict(t);
    auto before = local_state(t);
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
    // The failing rank names itself; the others name the first failing rank.
    EXPECT_NE(errors[r].find("rank "), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("nothing was loaded"), std::string::npos) << errors[r];
  }
  std::printf("[bad input] %s\n", errors[1].c_str());
}

TEST(ConsolidatedLoadBadInput, MissingAndUnexpectedKeys) {
  const auto dir = temp_dir("consolidated_missing");
  auto full = full_tensors();
  full.erase("head.bias");
  full["ghost.weight"] = torch::ones({2});
  dcp::save_file(full, dir + "/model.safetensors");
  expect_consolidated_error(dir, {"key(s) of the state dict are not in " + dir, "'head.bias'"});
  // Non-strict: the others load, the missing one is left unchanged and reported.
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto sd = sharded_dict(t);
    auto res = dcp::load(sd, dir, dcp::LoadOptions().strict(false));
    EXPECT_EQ(res.missing_keys, std::vector<std::string>{"head.bias"});
    EXPECT_EQ(res.unexpected_keys, std::vector<std::string>{"ghost.weight"});
    sd.erase("head.bias");
    check_pieces(sd, full, pg->rank(), 4);
  });
}

TEST(ConsolidatedLoadBadInput, WrongShapeNamesFqnShapesFileAndRank) {
  const auto dir = temp_dir("consolidated_shape");
  auto full = full_tensors();
  full["blocks.1.fc1.weight"] = torch::ones({4, 6});
  dcp::save_file(full, dir + "/model.safetensors");
  expect_consolidated_error(dir, {"'blocks.1.fc1.weight' has shape [4, 6] in " + dir, "model.safetensors",
                                  "but [5, 6] in the state dict (rank "});
}

TEST(ConsolidatedLoadBadInput, IntegerFileIntoFloatModel) {
  const auto dir = temp_dir("consolidated_dtype");
  auto full = full_tensors();
  full["head.bias"] = torch::zeros({2}, torch::kLong);
  dcp::save_file(full, dir + "/model.safetensors");
  expect_consolidated_error(dir, {"'head.bias' has dtype Long in " + dir + "/model.safetensors",
                                  "only floating-point data converts"});
}

TEST(ConsolidatedLoadBadInput, TruncatedFile) {
  const auto dir = temp_dir("consolidated_truncated");
  dcp::save_file(full_tensors(), dir + "/model.safetensors");
  fs::resize_file(dir + "/model.safetensors", fs::file_size(dir + "/model.safetensors") - 10);
  expect_consolidated_error(dir, {dir + "/model.safetensors is truncated", "is cut off", "(rank "});
}

TEST(ConsolidatedLoadBadInput, FolderWithNeitherLayout) {
  const auto dir = temp_dir("consolidated_empty");
  std::ofstream(dir + "/README.md") << "not a checkpoint\n";
  expect_consolidated_error(dir, {dir + " holds no checkpoint: looked for libfsdp_checkpoint.json",
                                  "model.safetensors.index.json", "model.safetensors,", "(rank "});
}

TEST(ConsolidatedLoadBadInput, IndexNamesAMissingFile) {
  const auto ck = temp_dir("consolidated_index_src") + "/step-0";
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7);
    dcp::save(sharded_dict(t), ck);
  });
  const auto dir = temp_dir("consolidated_index_missing");
  auto files = dcp::consolidate(ck, dir, dcp::ConsolidateOptions().max_file_bytes(200));
  ASSERT_GT(files.size(), 3u);
  fs::remove(files[1]);
  expect_consolidated_error(dir, {files[1] + " is missing: " + dir + "/model.safetensors.index.json names it",
                                  "(rank "});
}

}  // namespace
}  // namespace fsdp::testing
