// PyTorch's default DCP format (FileSystemWriter / FileSystemReader): `.distcp` files of torch.save
// archives and a pickled `.metadata`. Reading it into a CheckpointInfo (so that dcp::load, inspect,
// verify, read_tensor and consolidate handle it like our own format), and writing it.
// See [Note: PyTorch's DCP format] in torch_dcp.cpp.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "checkpoint/safetensors.h"
#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::dcp::detail {

/// Modules of the classes PyTorch's `.metadata` pickles.
constexpr const char* kMetaModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kFsModule = "torch.distributed.checkpoint.filesystem";
/// A per-rank Value in PyTorch's format (which has none): {"libfsdp_per_rank": [rank 0's, rank 1's, ...]}.
constexpr const char* kPerRankKey = "libfsdp_per_rank";

/// A dtype as torch.save and the `.metadata` pickle name it.
struct TorchDtype {
  torch::ScalarType dtype;
  const char* name;     ///< torch.<name>
  const char* storage;  ///< torch.<storage> for _rebuild_tensor_v2, "" when torch.save uses UntypedStorage (v3)
};
/// The entry of `dtype`, or null for a dtype the format cannot name here.
const TorchDtype* torch_dtype_of(torch::ScalarType dtype);

/// Name of the metadata file of PyTorch's format.
constexpr const char* kTorchMetadataFileName = ".metadata";
/// CheckpointInfo::format of a checkpoint in PyTorch's format.
constexpr const char* kTorchFormatName = "torch-dcp";

/// Fills `info` (whose `dir` is set) from `dir/.metadata` and the archives it points at: one ChunkInfo per
/// chunk, addressing the tensor's raw bytes inside its torch.save archive; Values from the non-tensor
/// entries. A missing or truncated `.distcp` file is passed to `report` (its chunks are left out);
/// anything wrong with `.metadata` or an archive throws c10::Error naming the file, the key and the fault.
void read_torch_dcp(CheckpointInfo& info, const std::function<void(const std::string&)>& report, const char* api);

/// "float32", ... (torch.<name>). Throws c10::Error "<api>: '<key>' has dtype X, which PyTorch's DCP format
/// cannot name" for a dtype outside the table.
std::string torch_dtype_name(torch::ScalarType dtype, const char* api, const std::string& key);

/// `__{rank}_0.distcp`: the file a rank's chunks go to.
std::string distcp_file_name(int rank, int index = 0);

/// Appends a torch.save archive of `t` (contiguous, CPU) to `f`; returns its length in bytes.
int64_t append_torch_save(File& f, const torch::Tensor& t, const std::string& what);
/// Appends a torch.save archive of the Python object `v` (JSON as Python builtins) to `f`; returns its length.
int64_t append_torch_save(File& f, const nlohmann::json& v, const std::string& what);

/// Appends a torch.save archive whose data.pkl is `data_pkl` and whose "data/0" record holds `data`'s
/// bytes (when defined): any content, for tests of what the reader refuses.
int64_t append_torch_save_raw(File& f, const std::string& data_pkl, const torch::Tensor& data, const std::string& what);

/// One entry of a checkpoint's `.metadata`.
struct TorchEntry {
  std::string key;
  bool tensor = true;  ///< false: a bytes entry (a Value)
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> sizes;  ///< global shape
  struct Chunk {
    std::vector<int64_t> offsets, sizes;
    std::string file;
    int64_t offset = 0, length = 0;  ///< the archive's bytes in `file`
  };
  std::vector<Chunk> chunks;  ///< a bytes entry: exactly one (offsets and sizes empty)
};

/// The pickled `.metadata` for `entries` (in order), as PyTorch 2.13's FileSystemWriter writes it;
/// `save_id` goes into storage_meta.
std::string torch_metadata_pickle(const std::vector<TorchEntry>& entries, const std::string& save_id);

/// Nanoseconds since the epoch at which libfsdp saved the PyTorch-format checkpoint in `dir` (from the
/// save_id it wrote), or nullopt for a folder that is not one (keep_last deletes only its own).
std::optional<int64_t> libfsdp_torch_dcp_time(const std::string& dir);

/// The save_id libfsdp writes: "libfsdp-<unix ns>-<nonce>".
std::string libfsdp_save_id(int64_t unix_ns);

}  // namespace fsdp::dcp::detail
