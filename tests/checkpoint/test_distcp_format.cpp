// PyTorch's default DCP format (CTest label: checkpoint): dcp::save(..., storage_format(Distcp)) and
// dcp::load of `.distcp` + `.metadata` folders, resharded to any world size and mesh, bit-exact; Values
// and per-rank Values; keep_last; nothing written outside the checkpoint's folder by default; the pickle
// reader and writer; and malformed or hostile metadata and archives refused with the file and the
// fault named, changing nothing. Interop with PyTorch itself (dcp.save / dcp.load in Python, FSDP2,
// HSDP and FSDP + TP layouts) is in tests/python/test_checkpoint_interop.py.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/pickle.h"
#include "checkpoint/torch_dcp.h"
#include "checkpoint_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

std::vector<Batch> batches() {
  static auto b = make_batches(8, kCkptBatch, kCkptSeq, 2468);
  return b;
}

dcp::SaveOptions distcp() { return dcp::SaveOptions().storage_format(dcp::StorageFormat::Distcp); }

/// Trains `steps` steps on `world` ranks (mesh `mesh_shape`), saves in PyTorch's format into `dir`
/// (with `extra` added to the state dict); returns the full state at the save.
FullState train_and_save(int world, int steps, const std::string& dir, std::vector<int64_t> mesh_shape = {},
                         const std::function<void(StateDict&, int rank)>& extra = nullptr,
                         dcp::SaveOptions opts = distcp()) {
  FullState saved;
  std::mutex mu;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 7, OptimKind::ADAMW, mesh_shape);
    for (int i = 0; i < steps; ++i) t.step(batches()[i]);
    auto sd = get_state_dict(t.net, *t.opt);
    if (extra) extra(sd, pg->rank());
    dcp::save(sd, dir, opts);
    auto s = full_state(t);
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = s;
  });
  return saved;
}

void load_and_compare(int world, const std::string& dir, const FullState& expect, std::vector<int64_t> mesh = {}) {
  run_ranks(world, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8, OptimKind::ADAMW, mesh);
    auto sd = get_state_dict(t.net, *t.opt);
    dcp::load(sd, dir);
    set_state_dict(t.net, *t.opt, sd);
    EXPECT_EQ(diff_states(full_state(t), expect), "") << "loading " << dir << " on " << world << " ranks, rank "
                                                      << pg->rank();
  });
}

/// Loads `dir` on 2 ranks; expects every rank to fail with each of `needles` and nothing changed.
void expect_load_error(const std::string& dir, const std::vector<std::string>& needles) {
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    t.step(batches()[5]);
    auto before = local_state(t);
    auto sd = get_state_dict(t.net, *t.opt);
    try {
      dcp::load(sd, dir);
    } catch (...) {
      EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank() << ": the failed load changed state";
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(errors[r].empty()) << "rank " << r << " loaded " << dir << " without error";
    for (const auto& n : needles) EXPECT_NE(errors[r].find(n), std::string::npos) << "rank " << r << ": " << errors[r];
  }
  std::printf("[bad input] %s\n", errors[1].c_str());
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// ---- Round trips ------------------------------------------------------------------------------------------

// Saved on 4 ranks, loaded on 1 and 3; saved on 3, loaded on 2 and 4. head.weight [2, 6] and scale [1]
// have fewer rows than ranks (empty shards on both sides).
TEST(DistcpFormat, ReshardsToAnyWorldSizeBitExact) {
  auto base = temp_dir("distcp_reshard");
  auto saved4 = train_and_save(4, 2, base + "/from4");
  EXPECT_TRUE(fs::exists(base + "/from4/.metadata"));
  EXPECT_TRUE(fs::exists(base + "/from4/__0_0.distcp"));
  EXPECT_TRUE(fs::exists(base + "/from4/__3_0.distcp"));
  EXPECT_FALSE(fs::exists(base + "/from4/" + dcp::kMetadataFileName));
  for (int world : {1, 3}) load_and_compare(world, base + "/from4", saved4);
  auto saved3 = train_and_save(3, 2, base + "/from3");
  for (int world : {2, 4}) load_and_compare(world, base + "/from3", saved3);
  auto info = dcp::inspect(base + "/from4");
  EXPECT_EQ(info.format, "torch-dcp");
  EXPECT_EQ(info.tensors.at("model.head.weight").chunks.size(), 2u);  // ranks 2 and 3 hold no rows
  EXPECT_EQ(info.values.at("optim.state.wte.weight.step"), 2);
  EXPECT_TRUE(dcp::verify(base + "/from4").empty());
  // read_tensor assembles a tensor from its archives.
  EXPECT_TRUE(torch::equal(dcp::read_tensor(info, "model.wte.weight"), saved4.tensors.at("model.wte.weight")));
}

// HSDP: a (replicate 2, shard 2) mesh writes each shard once; a 1-D job of 3 ranks and another HSDP
// job load it.
TEST(DistcpFormat, HsdpSavesOneReplicaAndLoadsOnAnyMesh) {
  auto dir = temp_dir("distcp_hsdp") + "/ck";
  auto saved = train_and_save(4, 2, dir, {2, 2});
  EXPECT_EQ(dcp::inspect(dir).tensors.at("model.wte.weight").chunks.size(), 2u);
  load_and_compare(3, dir, saved);
  load_and_compare(4, dir, saved, {2, 2});
}

// A checkpoint in our format and one in PyTorch's hold the same state: each loads into the other's run.
TEST(DistcpFormat, BothFormatsHoldTheSameState) {
  auto base = temp_dir("distcp_both");
  auto a = train_and_save(2, 3, base + "/ours", {}, nullptr, dcp::SaveOptions());
  auto b = train_and_save(2, 3, base + "/torch");
  EXPECT_EQ(diff_states(a, b), "");
  load_and_compare(3, base + "/ours", b);
  load_and_compare(3, base + "/torch", a);
}

// Values of every JSON type, per-rank Values (same world size only), bf16 and int tensors, a scalar.
TEST(DistcpFormat, ValuesAndPerRankValuesRoundTrip) {
  auto dir = temp_dir("distcp_values") + "/ck";
  const nlohmann::json v = {{"name", "run-1"}, {"lrs", {0.1, 0.01}}, {"on", true}, {"none", nullptr},
                            {"big", int64_t(1) << 40}, {"neg", -7}, {"nested", {{"a", {1, 2, {{"b", "c"}}}}}}};
  auto extra = [&](StateDict& sd, int rank) {
    sd.insert_or_assign("trainer.config", Value(v));
    sd.insert_or_assign("loader.position", per_rank_value(100 + rank));
    sd.insert_or_assign("rng", torch::arange(5, torch::kInt64) * 3);
    sd.insert_or_assign("half", torch::linspace(-1, 1, 7).to(torch::kBFloat16));
    sd.insert_or_assign("scalar", torch::tensor(2.5));
    sd.insert_or_assign("empty", torch::zeros({4, 0, 3}));
  };
  train_and_save(2, 1, dir, {}, extra);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto sd = get_state_dict(t.net, *t.opt);
    sd.insert_or_assign("trainer.config", Value(nullptr));
    sd.insert_or_assign("loader.position", per_rank_value(0));
    sd.insert_or_assign("rng", torch::zeros({5}, torch::kInt64));
    sd.insert_or_assign("half", torch::zeros({7}, torch::kBFloat16));
    sd.insert_or_assign("scalar", torch::tensor(0.0));
    sd.insert_or_assign("empty", torch::zeros({4, 0, 3}));
    dcp::load(sd, dir);
    EXPECT_EQ(std::get<Value>(sd.at("trainer.config")).json, v);
    EXPECT_EQ(std::get<Value>(sd.at("loader.position")).json, 100 + pg->rank());
    EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(sd.at("rng")), torch::arange(5, torch::kInt64) * 3));
    EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(sd.at("half")), torch::linspace(-1, 1, 7).to(torch::kBFloat16)));
    EXPECT_EQ(std::get<torch::Tensor>(sd.at("scalar")).item<double>(), 2.5);
  });
  // Per-rank state on another world size: refused, naming the key.
  auto errors = run_ranks_collect(3, [&](ProcessGroupPtr pg) {
    StateDict sd;
    sd.insert_or_assign("loader.position", per_rank_value(0));
    dcp::load(sd, dir, dcp::LoadOptions().strict(false).group(pg));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("'loader.position' is per-rank state saved by 2 ranks"), std::string::npos) << e;
  }
}

// PyTorch keeps Adam's step as a float32 scalar tensor: it loads into libfsdp's integer Value.
TEST(DistcpFormat, OneElementTensorLoadsIntoAValue) {
  auto dir = temp_dir("distcp_step") + "/ck";
  train_and_save(2, 1, dir, {}, [](StateDict& sd, int) {
    sd.insert_or_assign("step_as_tensor", torch::tensor(7.0f));
    sd.insert_or_assign("lr_as_tensor", torch::tensor(0.5));
  });
  run_ranks(2, [&](ProcessGroupPtr pg) {
    StateDict sd;
    sd.insert_or_assign("step_as_tensor", Value(0));
    sd.insert_or_assign("lr_as_tensor", Value(0.0));
    dcp::load(sd, dir, dcp::LoadOptions().strict(false).group(pg));
    EXPECT_TRUE(std::get<Value>(sd.at("step_as_tensor")).json.is_number_integer());
    EXPECT_EQ(std::get<Value>(sd.at("step_as_tensor")).json, 7);
    EXPECT_EQ(std::get<Value>(sd.at("lr_as_tensor")).json, 0.5);
  });
}

// ---- Around the folder --------------------------------------------------------------------------------------

// Neither format writes anything next to the checkpoint unless asked (update_latest, keep_last).
TEST(DistcpFormat, SaveWritesNothingOutsideItsFolderByDefault) {
  for (auto opts : {distcp(), dcp::SaveOptions()}) {
    auto parent = temp_dir("distcp_outside");
    train_and_save(2, 1, parent + "/ck", {}, nullptr, opts);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(parent)) names.push_back(e.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"ck"});
    EXPECT_FALSE(dcp::latest(parent));
  }
}

// keep_last prunes libfsdp's PyTorch-format checkpoints too (never a folder another program wrote).
TEST(DistcpFormat, KeepLastAndLatest) {
  auto base = temp_dir("distcp_keep");
  fs::create_directories(base + "/foreign");
  write_all(base + "/foreign/.metadata", "not ours");
  for (int i = 0; i < 3; ++i) {
    train_and_save(2, 1, base + "/step-" + std::to_string(i), {}, nullptr, distcp().keep_last(2).update_latest(true));
  }
  EXPECT_EQ(dcp::latest(base), base + "/step-2");
  EXPECT_FALSE(fs::exists(base + "/step-0"));
  EXPECT_TRUE(fs::exists(base + "/step-1"));
  EXPECT_TRUE(fs::exists(base + "/foreign/.metadata"));
}

// ---- The pickle reader and writer ----------------------------------------------------------------------------

// 120 files (thread_count 120): reading the checkpoint keeps at most 64 of them open, so it works with
// 80 descriptors to spare where opening all at once would need 120 (and fail with EMFILE).
TEST(DistcpFormat, ManyFilesAreNotAllOpenAtOnce) {
  const auto dir = temp_dir("distcp_many") + "/ck";
  StateDict sd;
  for (int i = 0; i < 120; ++i) sd.insert_or_assign("t" + std::to_string(i), torch::full({3}, double(i)));
  dcp::save(sd, dir, dcp::SaveOptions().storage_format(dcp::StorageFormat::Distcp).thread_count(120));
  int in_use = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) in_use += e.path().empty() ? 0 : 1;
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(in_use + 80);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::string error;
  dcp::CheckpointInfo info;
  try {
    info = dcp::inspect(dir);
  } catch (const std::exception& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_NOFILE, &old);
  ASSERT_EQ(error, "");
  EXPECT_EQ(info.files.size(), 120u);
  for (const auto& [key, why] : info.unreadable) ADD_FAILURE() << key << ": " << why;
  ASSERT_EQ(info.tensors.size(), 120u);
  for (int i = 0; i < 120; ++i) {
    EXPECT_TRUE(torch::equal(dcp::read_tensor(info, "t" + std::to_string(i)), torch::full({3}, double(i)))) << i;
  }
}

TEST(DistcpPickle, WriterAndReaderRoundTripJson) {
  const nlohmann::json v = {{"i", 1}, {"neg", -300}, {"wide", int64_t(-1) << 50}, {"f", 0.1}, {"s", "ü"},
                            {"l", {1, "a", nullptr, false}}, {"d", {{"x", {{"y", {}}}}}}, {"empty", nlohmann::json::object()}};
  dcp::detail::PickleWriter w;
  w.json(v);
  std::string why;
  auto back = dcp::detail::to_json(*dcp::detail::unpickle(w.finish(), "test"), &why);
  EXPECT_EQ(why, "");
  EXPECT_EQ(back, v);
}

TEST(DistcpPickle, HostileInputIsRefusedWithoutCrashing) {
  using namespace std::string_literals;
  auto refuse = [](const std::string& data, const std::string& needle) {
    try {
      dcp::detail::unpickle(data, "x.pkl");
      ADD_FAILURE() << "accepted " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
    }
  };
  refuse(""s, "the data ends before STOP");
  refuse("\x80\x02]"s, "the data ends before STOP");
  refuse("\x80\x02X\xff\xff\xff\x7f"s, "runs past the end");
  refuse("\x80\x02h\x05."s, "memo entry 5 was never stored");
  refuse("\x80\x02u."s, "no MARK");
  refuse("\x80\x02" "a."s, "stack underflow");
  refuse("\x80\x02N\x8a\x09"s, "wider than 64 bits");
  // A global is a name, never imported or called.
  refuse("\x80\x02" "cos\nsystem\n(X\x02\x00\x00\x00" "ls" "t."s, "STOP with 2 values");
  refuse("\x80\x02\xff"s, "opcode 0xff");
  // 200k lists through the memo, and 200k nested lists: parsed and freed without recursion; to_json
  // stops at its depth limit.
  std::string memo = "\x80\x02]\x94"s;
  for (int i = 0; i < 200000; ++i) memo += "]\x94h\x00" "a0"s;  // new list, memoized; append list 0 to it; pop
  memo += ".";
  std::string why;
  auto o = dcp::detail::unpickle(memo, "memo.pkl");
  EXPECT_EQ(dcp::detail::to_json(*o, &why), nlohmann::json::array());
  EXPECT_EQ(why, "");
  std::string nest = "\x80\x02"s + std::string(200000, ']') + std::string(199999, 'a') + ".";
  auto n = dcp::detail::unpickle(nest, "nest.pkl");
  dcp::detail::to_json(*n, &why);
  EXPECT_NE(why.find("nested more than 64 levels"), std::string::npos) << why;
  n.reset();  // frees 200k levels iteratively
  // A list inside itself (memo + APPEND) is refused; beside the tree, it is garbage: both are freed.
  const int64_t live = dcp::detail::live_pyobjs();
  refuse("\x80\x02]\x94h\x00" "a."s, "reference cycle");
  EXPECT_EQ(dcp::detail::live_pyobjs(), live);
  refuse("\x80\x02}\x94(X\x01\x00\x00\x00k]\x94h\x00" "au."s, "reference cycle");  // dict -> list -> dict
  EXPECT_EQ(dcp::detail::live_pyobjs(), live);
  {
    auto root = dcp::detail::unpickle("\x80\x02]\x94h\x00" "a0N."s, "garbage.pkl");
    EXPECT_TRUE(root->is(dcp::detail::PyObj::Kind::None));
  }
  EXPECT_EQ(dcp::detail::live_pyobjs(), live);
}

// ---- Bad checkpoints ---------------------------------------------------------------------------------------

struct Corrupted {
  std::string dir;
};
Corrupted fresh_copy(const std::string& name) {
  static std::string master;
  if (master.empty()) {
    master = temp_dir("distcp_master") + "/ck";
    train_and_save(2, 2, master);
  }
  auto dir = temp_dir("distcp_bad_" + name) + "/ck";
  fs::copy(master, dir, fs::copy_options::recursive);
  return {dir};
}

TEST(DistcpBadInput, TruncatedMetadata) {
  auto c = fresh_copy("trunc_meta");
  auto m = c.dir + "/.metadata";
  auto bytes = read_all(m);
  write_all(m, bytes.substr(0, bytes.size() / 2));
  expect_load_error(c.dir, {c.dir + "/.metadata: not a valid pickle (truncated or damaged?)", "the data ends before STOP"});
  write_all(m, "");
  expect_load_error(c.dir, {".metadata: not a valid pickle"});
}

TEST(DistcpBadInput, MetadataOfAnotherKind) {
  auto c = fresh_copy("other_meta");
  dcp::detail::PickleWriter w;
  w.json({{"state_dict_metadata", nlohmann::json::object()}});
  write_all(c.dir + "/.metadata", w.finish());
  expect_load_error(c.dir, {"is not PyTorch DCP metadata: expected a pickled torch.distributed.checkpoint.metadata.Metadata, found dict"});
  // Code in a pickle is named, never run.
  using namespace std::string_literals;
  write_all(c.dir + "/.metadata", "\x80\x02" "cos\nsystem\nX\x05\x00\x00\x00" "touch\x85R."s);
  expect_load_error(c.dir, {"found os.system(...)"});
}

TEST(DistcpBadInput, MissingAndTruncatedArchives) {
  auto c = fresh_copy("missing");
  fs::remove(c.dir + "/__1_0.distcp");
  expect_load_error(c.dir, {"__1_0.distcp is missing", "restore the file"});
  auto t = fresh_copy("truncated");
  fs::resize_file(t.dir + "/__0_0.distcp", fs::file_size(t.dir + "/__0_0.distcp") - 100);
  expect_load_error(t.dir, {"__0_0.distcp is truncated"});
  EXPECT_FALSE(dcp::verify(c.dir).empty());
}

TEST(DistcpBadInput, DamagedArchive) {
  auto c = fresh_copy("damaged");
  auto f = c.dir + "/__0_0.distcp";
  auto bytes = read_all(f);
  bytes.replace(0, 4, "JUNK");  // the first archive's zip signature
  write_all(f, bytes);
  expect_load_error(c.dir, {"is not a readable torch.save archive", "__0_0.distcp"});
}

// Only rank 1's state dict is wrong, on a resharded load (2 -> 3, where the ranks exchange the byte
// ranges they need before reading: [Note: one reader per file region]): no rank waits for it, every
// rank raises its error, nothing is loaded.
TEST(DistcpBadInput, OneRanksBadStateDictFailsEveryRankWithoutAHang) {
  auto c = fresh_copy("one_rank");
  auto errors = run_ranks_collect(3, [&](ProcessGroupPtr pg) {
    Trainer t(pg, 8);
    auto before = local_state(t);
    auto sd = get_state_dict(t.net, *t.opt);
    if (pg->rank() == 1) sd.insert_or_assign("model.extra", torch::zeros({2}));
    try {
      dcp::load(sd, c.dir);
    } catch (...) {
      EXPECT_EQ(diff_states(local_state(t), before), "") << "rank " << pg->rank();
      throw;
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("'model.extra'"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
  }
}

// A checkpoint crafted by hand: a tensor whose storage offset would wrap around, a Python object, a
// pickle that expands exponentially through shared references, a transposed chunk, and one good tensor.
// Each bad entry is set aside with its reason (verify lists them); loading it is refused by name; the
// good one loads.
TEST(DistcpBadInput, HostileEntriesAreSetAsideAndRefusedByName) {
  using namespace std::string_literals;
  namespace d = dcp::detail;
  const auto dir = temp_dir("distcp_hostile") + "/ck";
  fs::create_directories(dir);
  auto tensor_pkl = [](int64_t offset, std::vector<int64_t> size, std::vector<int64_t> stride, int64_t numel) {
    d::PickleWriter p;
    p.global("torch._utils", "_rebuild_tensor_v2").mark();
    p.mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu").integer(numel).tuple().binpersid();
    p.integer(offset).int_tuple(size).int_tuple(stride).boolean(false);
    p.global("collections", "OrderedDict").empty_tuple().reduce().tuple().reduce();
    return p.finish();
  };
  std::vector<d::TorchEntry> entries;
  {
    auto f = d::File::create(dir + "/__0_0.distcp", "test");
    int64_t at = 0;
    auto add = [&](const std::string& key, bool tensor, std::vector<int64_t> sizes, const std::string& pkl,
                   const torch::Tensor& data) {
      const int64_t n = d::append_torch_save_raw(f, pkl, data, key);
      d::TorchEntry e;
      e.key = key;
      e.tensor = tensor;
      e.sizes = sizes;
      e.chunks.push_back({tensor ? std::vector<int64_t>(sizes.size(), 0) : std::vector<int64_t>{}, sizes,
                          "__0_0.distcp", at, n});
      at += n;
      entries.push_back(e);
    };
    add("good", true, {4}, tensor_pkl(0, {4}, {1}, 4), torch::arange(4, torch::kFloat32));
    add("wraps", true, {4}, tensor_pkl((int64_t(1) << 62) - (int64_t(1) << 30), {4}, {1}, 4),
        torch::arange(4, torch::kFloat32));
    add("transposed", true, {2, 2}, tensor_pkl(0, {2, 2}, {1, 2}, 4), torch::arange(4, torch::kFloat32));
    d::PickleWriter size;
    size.global("torch", "Size").mark().int_tuple({2, 3}).tuple().reduce();
    add("shape", false, {}, size.finish(), {});
    std::string bomb = "\x80\x02]q\x00" "0"s;  // L0 = []; then 40 times L = [L, L]
    for (int i = 0; i < 40; ++i) bomb += "](h\x00h\x00" "eq\x00" "0"s;
    bomb += "h\x00."s;
    add("bomb", false, {}, bomb, {});
  }
  {
    auto f = d::File::create(dir + "/.metadata", "test");
    const auto meta = d::torch_metadata_pickle(entries, "test");
    f.write_all(meta.data(), meta.size(), "metadata");
  }
  auto info = dcp::inspect(dir);
  EXPECT_EQ(info.tensors.count("good"), 1u);
  ASSERT_EQ(info.unreadable.size(), 4u);
  EXPECT_NE(info.unreadable.at("wraps").find("overflow"), std::string::npos) << info.unreadable.at("wraps");
  EXPECT_NE(info.unreadable.at("transposed").find("not row-major"), std::string::npos);
  EXPECT_NE(info.unreadable.at("shape").find("torch.Size(...), which has no C++ form"), std::string::npos);
  EXPECT_NE(info.unreadable.at("bomb").find("values once shared references are expanded"), std::string::npos)
      << info.unreadable.at("bomb");
  EXPECT_EQ(dcp::verify(dir).size(), 4u);
  run_ranks(1, [&](ProcessGroupPtr pg) {
    StateDict sd;
    sd.insert_or_assign("good", torch::zeros({4}));
    auto r = dcp::load(sd, dir, dcp::LoadOptions().strict(false).group(pg));
    EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(sd.at("good")), torch::arange(4, torch::kFloat32)));
    EXPECT_EQ(r.unexpected_keys.size(), 4u);
    for (const std::string key : {"wraps", "transposed"}) {
      StateDict bad;
      bad.insert_or_assign(key, torch::zeros({4}));
      try {
        dcp::load(bad, dir, dcp::LoadOptions().strict(false).group(pg));
        ADD_FAILURE() << key << " loaded";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what_without_backtrace()).find("'" + key + "' in " + dir + " cannot be loaded: "),
                  std::string::npos) << e.what_without_backtrace();
      }
    }
    StateDict obj;
    obj.insert_or_assign("shape", Value(nullptr));
    EXPECT_THROW(dcp::load(obj, dir, dcp::LoadOptions().strict(false).group(pg)), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp::testing
