// What a parameter sends in fully_shard's all-gather, when it is not its shard in param_dtype: the C++ form
// of the tensor-subclass extension point `fsdp_pre_all_gather` / `fsdp_post_all_gather` of FSDP2
// (torchao's float8 weights use it to all-gather in float8). One user ships here: a low-precision
// all-gather (bf16, fp16, or float8 with a per-shard scale) of fp32 weights, upcast after the gather.
//
// [Note: all-gather extension]
// A parameter with an extension contributes, instead of its padded shard in param_dtype, the tensors
// pre_all_gather returns (any dtypes; the group's all-gather then moves bytes, see [Note: mixed-dtype
// all-gather] in src/fsdp/fsdp_collectives.cpp), and post_all_gather rebuilds the unsharded parameter from
// every rank's copies. Only the all-gather from the shards changes: the gradient is reduce-scattered as
// usual (reduce_dtype), the optimizer updates the fp32 shards, and the backward all-gather of a
// reshard_after_forward=k group re-gathers the already rebuilt values. The forward and backward compute
// with the rebuilt (e.g. float8-rounded) values, as torchao's float8 training computes with float8 weights.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

namespace fsdp {

/// A parameter's own all-gather. Mirrors the tensor-subclass methods fsdp_pre_all_gather and
/// fsdp_post_all_gather of FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
class AllGatherExtension {
 public:
  virtual ~AllGatherExtension() = default;
  /// This rank's all-gather inputs, from its padded shard `shard` ([ceil(d0 / world), *rest] in the
  /// parameter's dtype; zero rows past the parameter's end; the same shape on every rank). Every call must
  /// return the same number of tensors with the same numel and dtype on every rank (checked once across
  /// ranks, then per call). `param_dtype`: the dtype of the unsharded parameter (mp_policy). Runs under
  /// torch::NoGradGuard. Mirrors fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy).
  virtual std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, torch::ScalarType param_dtype) = 0;
  /// Writes the unsharded padded parameter `out` ([world * ceil(d0 / world), *rest], param_dtype,
  /// contiguous) from the gathered inputs: `outputs[i]` is [world, numel of input i], row r holding rank
  /// r's input i flattened (a view; may be strided). Runs under torch::NoGradGuard. Mirrors
  /// fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=).
  virtual void post_all_gather(const std::vector<torch::Tensor>& outputs, const torch::Tensor& out) = 0;
};

/// Chooses a parameter's extension: called by fully_shard once per parameter with its name relative to
/// the fully_shard module and its (unsharded) value; null = the plain all-gather.
using AllGatherExtensionFn =
    std::function<std::shared_ptr<AllGatherExtension>(const std::string& name, const torch::Tensor& param)>;

/// All-gathers a floating-point parameter in a lower precision and upcasts it to param_dtype afterwards:
/// `dtype` kBFloat16 / kHalf (a cast: half the bytes of fp32), or kFloat8_e4m3fn / kFloat8_e5m2 (a quarter:
/// each rank scales its shard by max_finite / amax(|shard|), one float32 scale per rank travels with it,
/// and the upcast divides by the sender's scale, as torchao's float8 all-gather with tensor-wise scaling;
/// amax is clamped to at least 1e-12, as torchao). Values are rounded to `dtype` once per all-gather (from the fp32 shard,
/// so rounding errors do not accumulate across steps). Throws c10::Error for another dtype.
/// Example: `fsdp::LowPrecisionAllGather(torch::kFloat8_e4m3fn)`
class LowPrecisionAllGather : public AllGatherExtension {
 public:
  explicit LowPrecisionAllGather(torch::ScalarType dtype);
  std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, torch::ScalarType param_dtype) override;
  void post_all_gather(const std::vector<torch::Tensor>& outputs, const torch::Tensor& out) override;
  torch::ScalarType dtype() const { return dtype_; }

 private:
  torch::ScalarType dtype_;
  bool float8_;
};

/// FullyShardOptions::all_gather_extension_fn that gives every floating-point parameter of at least
/// `min_dim` dims (default 2: Linear and Embedding weights, not biases or norm weights, as torchao converts
/// only Linear weights) a LowPrecisionAllGather(dtype). Throws c10::Error for an unsupported dtype.
/// Example: `fsdp::FullyShardOptions().all_gather_extension_fn(fsdp::low_precision_all_gather(torch::kBFloat16))`
AllGatherExtensionFn low_precision_all_gather(torch::ScalarType dtype, int64_t min_dim = 2);

}  // namespace fsdp
