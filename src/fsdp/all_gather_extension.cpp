// The low-precision all-gather: an AllGatherExtension (see fsdp/fsdp/all_gather_extension.h).
#include "fsdp/fsdp/all_gather_extension.h"

#include <limits>

namespace fsdp {
namespace {
bool is_float8(torch::ScalarType t) { return t == torch::kFloat8_e4m3fn || t == torch::kFloat8_e5m2; }
double float8_max(torch::ScalarType t) {
  return t == torch::kFloat8_e4m3fn ? 448.0 : 57344.0;  // largest finite value of the format
}
}  // namespace

LowPrecisionAllGather::LowPrecisionAllGather(torch::ScalarType dtype) : dtype_(dtype), float8_(is_float8(dtype)) {
  TORCH_CHECK(float8_ || dtype == torch::kBFloat16 || dtype == torch::kHalf, "LowPrecisionAllGather: expected ",
              "kBFloat16, kHalf, kFloat8_e4m3fn or kFloat8_e5m2, got ", dtype);
}

std::vector<torch::Tensor> LowPrecisionAllGather::pre_all_gather(const torch::Tensor& shard,
                                                                 torch::ScalarType param_dtype) {
  TORCH_CHECK(at::isFloatingType(shard.scalar_type()), "LowPrecisionAllGather: the parameter is ",
              shard.scalar_type(), "; only floating-point parameters can be all-gathered in ", dtype_);
  if (!float8_) return {shard.to(dtype_)};
  // Tensor-wise scaling of this rank's shard: the largest magnitude maps to the format's largest finite
  // value; computed in fp32 on the shard's device, without a host sync (no .item()).
  auto x = shard.to(torch::kFloat32);
  // amax clamped from below as torchao does: a zero or subnormal amax would make the scale inf (0 * inf = NaN).
  auto amax = (x.numel() > 0 ? x.abs().max() : torch::zeros({}, x.options())).clamp_min(1e-12);
  auto scale = float8_max(dtype_) / amax;
  auto q = (x * scale).clamp(-float8_max(dtype_), float8_max(dtype_)).to(dtype_);
  return {q, scale.reshape({1})};
}

void LowPrecisionAllGather::post_all_gather(const std::vector<torch::Tensor>& outputs, const torch::Tensor& out) {
  const int64_t world = outputs[0].size(0);
  auto dst = out.view({world, -1});
  if (!float8_) {
    dst.copy_(outputs[0]);
    return;
  }
  // Each rank's values divided by that rank's scale (outputs[1]: [world, 1] float32).
  dst.copy_(outputs[0].to(torch::kFloat32).div(outputs[1]));
}

AllGatherExtensionFn low_precision_all_gather(torch::ScalarType dtype, int64_t min_dim) {
  auto extension = std::make_shared<LowPrecisionAllGather>(dtype);  // validates dtype now
  return [extension, min_dim](const std::string&, const torch::Tensor& p) -> std::shared_ptr<AllGatherExtension> {
    if (!at::isFloatingType(p.scalar_type()) || p.dim() < min_dim) return nullptr;
    return extension;  // stateless: one instance serves every parameter
  };
}

}  // namespace fsdp
