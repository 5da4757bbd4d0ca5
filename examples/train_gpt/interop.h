// What train_gpt writes so that another program can replay its run exactly (bench/gpt_twin.py: the same
// GPT in PyTorch, sharded with PyTorch's own FSDP2; bench/compare_fsdp2.py runs both side by side):
//   --save-init FILE     the full initial weights, before sharding, as safetensors (rank 0);
//   --dump-batches DIR   DIR/rank<R>.npy: the int64 token batches rank R trained on, shape
//                        [steps, grad_accum_steps, 2 (input, target), batch_size, block_size];
//                        DIR/run.json: the hyper-parameters the replay needs (rank 0).
// And the floor of the comparison (--no-shard): plain LibTorch in one process, mixed precision by CPU
// autocast. Self-contained (no dependency on the checkpoint code), little-endian hosts only.
#pragma once

#include <ATen/autocast_mode.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "data.h"

namespace train_gpt {

/// Writes `tensors` (name, contiguous CPU tensor of a dtype below) as one safetensors file: an 8-byte
/// little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}
/// padded with spaces to a multiple of 8, then the raw data of the tensors in the order given.
/// Throws UsageError if the file cannot be written.
inline void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  static const std::map<torch::ScalarType, std::string> kDtypes = {
      {torch::kFloat32, "F32"}, {torch::kBFloat16, "BF16"}, {torch::kFloat16, "F16"}, {torch::kInt64, "I64"}};
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    auto dtype = kDtypes.find(t.scalar_type());
    TORCH_CHECK(dtype != kDtypes.end(), "write_safetensors: '", name, "' has unsupported dtype ", t.scalar_type());
    const auto nbytes = static_cast<int64_t>(t.nbytes());
    header[name] = {{"dtype", dtype->second}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    data.push_back(t);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw UsageError("--save-init " + path + " cannot be written (missing directory?)");
  const uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), sizeof len);
  out << text;
  for (const auto& t : data) out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!out) throw UsageError("--save-init " + path + ": write failed (disk full?)");
}

/// Writes an int64 tensor as a .npy file (format 1.0: magic, header length, a Python dict literal
/// padded to a multiple of 64 bytes and ending in '\n', then the C-order data).
inline void write_npy(const std::string& path, const torch::Tensor& tensor) {
  auto t = tensor.to(torch::kInt64).contiguous();
  std::string shape;
  for (auto d : t.sizes()) shape += std::to_string(d) + ", ";
  std::string dict = "{'descr': '<i8', 'fortran_order': False, 'shape': (" + shape + "), }";
  const size_t preamble = 10;  // magic (6) + version (2) + header length (2)
  dict.append((64 - (preamble + dict.size() + 1) % 64) % 64, ' ');
  dict += '\n';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw UsageError("--dump-batches: " + path + " cannot be written");
  const uint16_t len = static_cast<uint16_t>(dict.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&len), sizeof len);
  out << dict;
  out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!out) throw UsageError("--dump-batches: write to " + path + " failed (disk full?)");
}

/// The batches one rank trains on, kept in memory during training and written once at the end (so
/// that recording costs the timed steps nothing but a reference).
class BatchRecorder {
 public:
  /// Creates `dir` (throws UsageError if that fails). Call on every rank before training.
  explicit BatchRecorder(std::string dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (!std::filesystem::is_directory(dir_)) {
      throw UsageError("--dump-batches " + dir_ + " cannot be created: " + ec.message());
    }
  }
  /// One microbatch: inputs and targets [batch_size, block_size].
  void add(const torch::Tensor& x, const torch::Tensor& y) { batches_.push_back(torch::stack({x, y})); }
  /// Writes <dir>/rank<rank>.npy, [steps, accum, 2, batch_size, block_size]; rank 0 also writes
  /// <dir>/run.json (`run`).
  void write(int rank, int64_t grad_accum_steps, const nlohmann::json& run) const {
    TORCH_CHECK(!batches_.empty() && batches_.size() % grad_accum_steps == 0, "BatchRecorder: ", batches_.size(),
                " microbatches recorded, not a whole number of steps of ", grad_accum_steps);
    auto all = torch::stack(batches_);  // [steps * accum, 2, B, T]
    write_npy(dir_ + "/rank" + std::to_string(rank) + ".npy",
              all.view({-1, grad_accum_steps, 2, all.size(2), all.size(3)}));
    if (rank == 0) {
      std::ofstream out(dir_ + "/run.json", std::ios::trunc);
      out << run.dump(2) << '\n';
      if (!out) throw UsageError("--dump-batches: " + dir_ + "/run.json cannot be written");
    }
  }

 private:
  std::string dir_;
  std::vector<torch::Tensor> batches_;  // one [2, B, T] per microbatch, in training order
};

/// While alive, CPU ops listed by autocast run in `dtype` (bf16): how plain LibTorch trains in mixed
/// precision without FSDP (the --no-shard floor). Parameters and gradients stay fp32.
class CpuAutocast {
 public:
  /// Autocast on `device` (CPU or CUDA) to `dtype` for the scope.
  explicit CpuAutocast(torch::ScalarType dtype, at::DeviceType device = at::kCPU)
      : device_(device),
        was_enabled_(at::autocast::is_autocast_enabled(device)),
        old_dtype_(at::autocast::get_autocast_dtype(device)) {
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, old_dtype_);
    at::autocast::clear_cache();  // the weight casts of this forward
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  at::DeviceType device_;
  bool was_enabled_;
  at::ScalarType old_dtype_;
};

}  // namespace train_gpt
