// fsdp::elastic::record and record_exception (include/fsdp/elastic/errors.h): the error file a launcher reads
// (TORCHELASTIC_ERROR_FILE), in torch's JSON; the end-to-end path through fsdprun's summary is in
// tests/python/test_fsdprun.py (test_cpp_worker_records_its_error_as_torch_does).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/elastic/errors.h"

namespace {

namespace fs = std::filesystem;

struct ErrorFile {
  fs::path path = fs::temp_directory_path() / ("fsdp_error_" + std::to_string(::getpid()) + ".json");
  ErrorFile() {
    fs::remove(path);
    ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
  }
  ~ErrorFile() {
    ::unsetenv("TORCHELASTIC_ERROR_FILE");
    fs::remove(path);
  }
  nlohmann::json read() const {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return nlohmann::json::parse(ss.str());
  }
};

TEST(ElasticRecord, ReturnsMainsCodeAndWritesNothingWhenItSucceeds) {
  ErrorFile f;
  EXPECT_EQ(fsdp::elastic::record([] { return 7; }), 7);
  EXPECT_FALSE(fs::exists(f.path));
}

TEST(ElasticRecord, AC10ErrorIsWrittenAsTorchWritesIt) {
  ErrorFile f;
  EXPECT_EQ(fsdp::elastic::record([]() -> int { TORCH_CHECK(false, "shard 7 is missing"); }), 1);
  const auto j = f.read().at("message");
  EXPECT_EQ(j.at("message").get<std::string>().rfind("c10::Error: shard 7 is missing", 0), 0u) << j.dump();
  EXPECT_TRUE(j.at("extraInfo").at("py_callstack").is_string());
  EXPECT_FALSE(j.at("extraInfo").at("timestamp").get<std::string>().empty());
}

TEST(ElasticRecord, OtherExceptionsNameTheirType) {
  ErrorFile f;
  EXPECT_EQ(fsdp::elastic::record([]() -> int { throw std::out_of_range("step 9 of 8"); }), 1);
  EXPECT_EQ(f.read()["message"]["message"], "std::out_of_range: step 9 of 8");
  EXPECT_EQ(fsdp::elastic::record([]() -> int { throw 42; }), 1);
  EXPECT_EQ(f.read()["message"]["message"], "std::runtime_error: an exception that is not a std::exception");
}

TEST(ElasticRecord, NoFileWithoutTheVariableAndAnUnwritableFileDoesNotThrow) {
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  EXPECT_EQ(fsdp::elastic::record([]() -> int { throw std::runtime_error("x"); }), 1);
  ::setenv("TORCHELASTIC_ERROR_FILE", "/nonexistent-dir/error.json", 1);
  EXPECT_NO_THROW(fsdp::elastic::record_exception(std::runtime_error("y")));
  EXPECT_EQ(fsdp::elastic::record([]() -> int { throw std::runtime_error("z"); }), 1);
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
}

}  // namespace
