// fsdp::dcp::save_file / load_file (CTest label: checkpoint): one
// safetensors file, every supported dtype bit for bit, scalars and empty tensors, the metadata, atomic
// replacement, and clear errors for a bad path, a truncated file and what safetensors cannot store.
// The interop with Python's safetensors package is in tests/python/test_checkpoint_interop.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/safetensors.h"
#include "checkpoint_test_util.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

/// A tensor of every dtype save_file supports, a scalar, an empty tensor and a non-contiguous view,
/// with values that use every byte (a bit-exact round trip cannot pass by luck).
std::map<std::string, torch::Tensor> every_kind() {
  torch::manual_seed(3);
  auto f = torch::randn({3, 5}, torch::kFloat64) * 1e3;
  return {
      {"f64", f},
      {"f32", f.to(torch::kFloat32)},
      {"bf16", f.to(torch::kBFloat16)},
      {"f16", (f / 1e2).to(torch::kFloat16)},
      {"i64", torch::randint(-(int64_t(1) << 62), int64_t(1) << 62, {4}, torch::kInt64)},
      {"i32", torch::randint(-(int64_t(1) << 30), int64_t(1) << 30, {2, 2}, torch::kInt32)},
      {"i16", torch::randint(-30000, 30000, {7}, torch::kInt16)},
      {"i8", torch::randint(-128, 128, {2, 3, 1}, torch::kInt8)},
      {"u8", torch::randint(0, 256, {9}, torch::kUInt8)},
      {"bool", torch::rand({6}) > 0.5},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::zeros({0, 3}, torch::kInt32)},
      {"transposed", f.to(torch::kFloat32).t()},  // not contiguous: stored as its values in C order
  };
}

std::string expect_throw(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

TEST(CheckpointSafetensorsFile, RoundTripsEveryDtypeBitExact) {
  const std::string path = temp_dir("st_file") + "/every.safetensors";
  const auto want = every_kind();
  dcp::save_file(want, path, {{"producer", "test"}, {"n_layer", "2"}});
  const auto got = dcp::load_file(path);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    const auto& g = got.at(name);
    EXPECT_EQ(g.scalar_type(), w.scalar_type()) << name;
    EXPECT_EQ(g.sizes(), w.sizes()) << name;
    EXPECT_TRUE(g.is_contiguous()) << name;
    // Bytes, not values: -0.0 == 0.0 and NaN != NaN would hide a wrong copy.
    auto bytes = [](const torch::Tensor& t) { return t.contiguous().reshape({-1}).view(torch::kUInt8); };
    EXPECT_TRUE(torch::equal(bytes(g), bytes(w))) << name;
  }
  // The metadata is the header's __metadata__, as given (nothing added), the keys in order.
  const auto file = dcp::detail::File::open_read(path, "test");
  const auto header = dcp::detail::read_header(file, file.size(), "test");
  EXPECT_EQ(header.metadata, (nlohmann::json{{"n_layer", "2"}, {"producer", "test"}}));
  EXPECT_FALSE(header.has_sharding_info);
}

TEST(CheckpointSafetensorsFile, NoMetadataAndNoTensors) {
  const std::string path = temp_dir("st_file") + "/empty.safetensors";
  dcp::save_file({}, path);
  EXPECT_TRUE(dcp::load_file(path).empty());
  const auto file = dcp::detail::File::open_read(path, "test");
  EXPECT_EQ(dcp::detail::read_header(file, file.size(), "test").metadata, nlohmann::json::object());
}

TEST(CheckpointSafetensorsFile, ReplacesAnExistingFileAndLeavesNoTemporaryFile) {
  const std::string dir = temp_dir("st_file_replace");
  const std::string path = dir + "/w.safetensors";
  dcp::save_file({{"a", torch::ones({1000})}}, path);
  dcp::save_file({{"b", torch::arange(3)}}, path);
  const auto got = dcp::load_file(path);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(torch::equal(got.at("b"), torch::arange(3)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  // A failed save (a dtype safetensors cannot store, found before writing) leaves the old file.
  EXPECT_THROW(dcp::save_file({{"c", torch::zeros({2}, torch::kComplexFloat)}}, path), c10::Error);
  EXPECT_TRUE(torch::equal(dcp::load_file(path).at("b"), torch::arange(3)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
}

TEST(CheckpointSafetensorsFile, BadPathsFailNamingThePath) {
  const std::string missing = temp_dir("st_file_bad") + "/no/such/folder/w.safetensors";
  auto msg = expect_throw([&] { dcp::save_file({{"a", torch::ones({2})}}, missing); });
  EXPECT_NE(msg.find("dcp::save_file: cannot write " + missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  msg = expect_throw([&] { dcp::load_file(missing); });
  EXPECT_NE(msg.find("dcp::load_file: cannot open " + missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("ENOENT"), std::string::npos) << msg;
}

TEST(CheckpointSafetensorsFile, TruncatedOrDamagedFilesFailNamingTheTensor) {
  const std::string dir = temp_dir("st_file_trunc");
  const std::string path = dir + "/t.safetensors";
  dcp::save_file({{"a", torch::ones({4})}, {"b", torch::ones({100})}}, path);
  const auto size = fs::file_size(path);
  fs::resize_file(path, size - 8);
  auto msg = expect_throw([&] { dcp::load_file(path); });
  EXPECT_NE(msg.find("dcp::load_file: " + path + " is truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'b' is cut off"), std::string::npos) << msg;
  fs::resize_file(path, 5);  // not even the header length
  msg = expect_throw([&] { dcp::load_file(path); });
  EXPECT_NE(msg.find("is truncated: 5 bytes"), std::string::npos) << msg;
  {
    std::ofstream out(dir + "/junk.safetensors", std::ios::binary);
    const uint64_t n = 4;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{no}";
  }
  msg = expect_throw([&] { dcp::load_file(dir + "/junk.safetensors"); });
  EXPECT_NE(msg.find("malformed safetensors header (not JSON"), std::string::npos) << msg;
}

TEST(CheckpointSafetensorsFile, WhatSafetensorsCannotStoreFailsNamingTheKey) {
  const std::string path = temp_dir("st_file_dtype") + "/d.safetensors";
  auto msg = expect_throw([&] { dcp::save_file({{"z", torch::zeros({2}, torch::kComplexFloat)}}, path); });
  EXPECT_NE(msg.find("dcp::save_file: 'z' has dtype ComplexFloat, which safetensors cannot store"), std::string::npos)
      << msg;
  msg = expect_throw([&] { dcp::save_file({{"u", torch::Tensor()}}, path); });
  EXPECT_NE(msg.find("'u' is an undefined tensor"), std::string::npos) << msg;
  msg = expect_throw([&] { dcp::save_file({{"s", torch::eye(2).to_sparse()}}, path); });
  EXPECT_NE(msg.find("'s' is a Sparse tensor"), std::string::npos) << msg;
  msg = expect_throw([&] { dcp::save_file({{"__metadata__", torch::ones({1})}}, path); });
  EXPECT_NE(msg.find("the key '__metadata__' is reserved"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace fsdp::testing
