// What one rank of dcp::save writes (see save.cpp for the protocol): the plan of its items, and the
// files of the two formats (save_files.cpp): its chunks, and rank 0's metadata from every rank's report.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::dcp::detail {

/// Bytes per CRC-32C block (checksums cover each tensor's data in blocks from its first byte, so a
/// resharded load can verify what it reads without reading whole files).
constexpr int64_t kChecksumBlockBytes = int64_t(128) << 10;
constexpr int kFormatVersion = 1;
constexpr const char* kFormatName = "libfsdp-dcp";

/// Our format's file `index` of `count` of `rank`: PyTorch's HuggingFaceStorageWriter naming.
inline std::string shard_file_name(int rank, int index = 0, int count = 1) {
  char buf[80];
  std::snprintf(buf, sizeof(buf), "shard-%05d-model-%05d-of-%05d.safetensors", rank + 1, index + 1, count);
  return buf;
}

/// What this rank saves.
struct Item {
  std::string key;
  bool sharded = false;  // a DTensor
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> global;   // global shape
  std::vector<int64_t> offsets;  // where the local piece starts
  std::vector<int64_t> sizes;    // local piece's shape
  bool write = false;            // this rank writes the piece (one replica does)
  torch::Tensor data;            // the local piece when write: contiguous CPU memory once staged, or the
                                 // source itself, copied by the writer's CopyAhead (copy_ahead.h)
};

struct Plan {
  StorageFormat format = StorageFormat::Safetensors;
  std::vector<Item> items;
  nlohmann::json values = nlohmann::json::object();    // replicated Values (rank 0's are saved)
  nlohmann::json per_rank = nlohmann::json::object();  // this rank's per-rank Values
  std::vector<std::string> value_keys;                 // every Value key, in order
  std::vector<int64_t> mesh_shape;
  std::vector<std::string> mesh_dim_names;
};

/// Writes this rank's files into `tmp` (`threads` files in parallel, see SaveOptions::thread_count);
/// returns their records (empty when this rank writes nothing).
/// Items that are not contiguous CPU memory yet are copied `copy_ahead` bytes ahead of each writer.
nlohmann::json write_shard(const Plan& plan, const std::string& tmp, int rank, int threads, int64_t copy_ahead,
                           bool do_fsync, const char* api);

/// Rank 0: our format's metadata file (libfsdp_checkpoint.json), from every rank's report.
nlohmann::ordered_json metadata_of(const Plan& plan, const std::vector<nlohmann::json>& reports, int world);

/// Rank 0, PyTorch's format: the Values into __0_{n}.distcp (per-rank ones as {kPerRankKey: [...]}),
/// then `.metadata` describing every rank's archives (see [Note: PyTorch's DCP format]).
void write_torch_metadata(const Plan& plan, const std::vector<nlohmann::json>& reports,
                          const std::filesystem::path& tmp, bool do_fsync, const char* api);

}  // namespace fsdp::dcp::detail
