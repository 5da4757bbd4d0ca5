// Ops on DTensors with sharding propagation: elementwise (with broadcasting), reductions, matmul/linear
// (the Megatron rules), view/reshape, transpose/permute, cat/split, softmax. Each op picks the output's
// placements from the inputs' (redistributing an input where no rule keeps its layout, as PyTorch's
// sharding strategies do), runs the same ATen op on the local tensors and returns a DTensor. Autograd
// works through them: the local tensors are ordinary autograd tensors and the redistributions are
// differentiable. Design, rules and limits: [Note: DTensor ops] in src/tensor/dtensor_ops.cpp and
// docs/TENSOR_PARALLEL.md ("DTensor as a tensor").
//
// Mirrors the aten ops of torch.distributed.tensor.DTensor (torch/distributed/tensor/_ops/).
//
// Every op is collective over the mesh when it redistributes an input (or, in backward, when it sums
// the gradient of a replicated input whose output is sharded): every rank calls the same ops in the same
// order. Errors are raised from rank-identical information (shapes, placements) on every rank alike.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <torch/types.h>

#include "fsdp/tensor/dtensor.h"

namespace fsdp::dtensor {

// ---- Elementwise (pointwise) ops --------------------------------------------------------------------
// Shapes broadcast as torch's. The output follows the input with the most dims (the most sharded one
// among equals): its Shard(d) shards the matching dim of the other inputs (a broadcast dim, size 1 or
// missing, is replicated instead); Replicate stays Replicate. Partial inputs: add/sub keep Partial when
// both inputs are Partial with the same linear op (sum/avg); mul keeps it when one input is Partial(sum
// or avg) and the other Replicate; div when the numerator is; neg and multiplication/division by a scalar
// keep it; anything else all-reduces the Partial input first (PyTorch's rules). A plain torch::Tensor
// operand is taken as Replicate on every mesh dim (it must be the same on every rank: PyTorch's
// implicit_replication()).
// Throws c10::Error when the shapes do not broadcast or the meshes differ (naming the op and placements).
// Example: auto y = dtensor::add(x, b);  // x [8, 4] Shard(0), b [4] Replicate -> y [8, 4] Shard(0)

/// a + alpha * b. Mirrors aten::add.Tensor on DTensors.
DTensor add(const DTensor& a, const DTensor& b, const c10::Scalar& alpha = 1);
DTensor add(const DTensor& a, const torch::Tensor& b, const c10::Scalar& alpha = 1);
/// a + s (a Partial input is all-reduced first).
DTensor add(const DTensor& a, const c10::Scalar& s);
/// a - alpha * b. Mirrors aten::sub.Tensor.
DTensor sub(const DTensor& a, const DTensor& b, const c10::Scalar& alpha = 1);
DTensor sub(const DTensor& a, const torch::Tensor& b, const c10::Scalar& alpha = 1);
DTensor sub(const DTensor& a, const c10::Scalar& s);
/// a * b. Mirrors aten::mul.Tensor.
DTensor mul(const DTensor& a, const DTensor& b);
DTensor mul(const DTensor& a, const torch::Tensor& b);
DTensor mul(const DTensor& a, const c10::Scalar& s);
/// a / b. Mirrors aten::div.Tensor.
DTensor div(const DTensor& a, const DTensor& b);
DTensor div(const DTensor& a, const torch::Tensor& b);
DTensor div(const DTensor& a, const c10::Scalar& s);
/// -a (keeps Partial(sum/avg)). Mirrors aten::neg. Example: auto m = dtensor::neg(x);
DTensor neg(const DTensor& a);
/// Unary ops: a Partial input is all-reduced first; Shard and Replicate are kept. Mirror aten::exp, log,
/// sqrt, abs, relu, gelu (approximate "none" or "tanh"), silu, tanh, sigmoid, sin, cos, pow.Tensor_Scalar.
/// Same shape and dtype as the input. Example: auto h = dtensor::gelu(x, "tanh");
DTensor exp(const DTensor& a);
DTensor log(const DTensor& a);
DTensor sqrt(const DTensor& a);
DTensor abs(const DTensor& a);
DTensor relu(const DTensor& a);
DTensor gelu(const DTensor& a, const std::string& approximate = "none");
DTensor silu(const DTensor& a);
DTensor tanh(const DTensor& a);
DTensor sigmoid(const DTensor& a);
DTensor sin(const DTensor& a);
DTensor cos(const DTensor& a);
DTensor pow(const DTensor& a, const c10::Scalar& exponent);

// ---- Reductions ------------------------------------------------------------------------------------
// sum/mean over reduced dims that are sharded give Partial("sum") (mean divides the local sum by the
// global count, exact for uneven shards); other Shard dims move to their place in the output (keepdim or
// not); Partial(sum/avg) inputs stay Partial. max/min over a sharded dim all-gather that dim first (the
// index of the maximum is global only on the whole dim; PyTorch does the same for max.dim), so their
// outputs are never Partial and their gradients equal one process's.

/// Sum of all elements: a 0-dim DTensor. Mirrors aten::sum.
DTensor sum(const DTensor& a);
/// Sum over `dims` (negative dims count from the end). Mirrors aten::sum.dim_IntList.
/// Example: auto s = dtensor::sum(x, {1}, true);  // x [8, 6] Shard(1) -> s [8, 1] Partial(sum)
DTensor sum(const DTensor& a, std::vector<int64_t> dims, bool keepdim = false);
/// Mean of all elements / over `dims`. Mirrors aten::mean, aten::mean.dim.
DTensor mean(const DTensor& a);
DTensor mean(const DTensor& a, std::vector<int64_t> dims, bool keepdim = false);
/// Maximum / minimum of all elements: a 0-dim Replicate DTensor. Mirrors aten::max, aten::min.
/// Example: auto m = dtensor::max(x);  // x [8, 6] Shard(0): all-gathers, m [] Replicate
DTensor max(const DTensor& a);
DTensor min(const DTensor& a);
/// (values, indices) of the maximum / minimum over `dim`; indices are int64. Mirrors aten::max.dim, aten::min.dim.
/// Example: auto [v, i] = dtensor::max(x, 1);  // x [8, 6] Shard(0) -> v, i [8] Shard(0)
std::tuple<DTensor, DTensor> max(const DTensor& a, int64_t dim, bool keepdim = false);
std::tuple<DTensor, DTensor> min(const DTensor& a, int64_t dim, bool keepdim = false);

// ---- Matrix products -------------------------------------------------------------------------------
/// a [..., m, k] @ b [k, n] (or batched: a [B..., m, k] @ b [B..., k, n], same batch shape). Per mesh
/// dim, following a's placement (the Megatron rules):
///   Shard(batch or m) x Replicate -> Shard(same dim)      (b's gradient is summed over the mesh dim)
///   Replicate x Shard(n) -> Shard(-1)                     (a's gradient is summed over the mesh dim)
///   Shard(k) x Shard(k) -> Partial(sum)
///   Replicate x Replicate -> Replicate; Partial(sum/avg) x Replicate and Replicate x Partial -> Partial
///   Replicate x Shard(k): a takes its local k chunk (no communication) -> Partial(sum)
///   anything else: b (then a) is redistributed to what a's placement needs (an all-gather).
/// Throws c10::Error for other ranks or mismatched shapes, naming the op and placements.
/// Mirrors aten::matmul / aten::mm / aten::bmm on DTensors.
/// Example: auto y = dtensor::matmul(x, w);  // x [4, 6] Shard(1), w [6, 5] Shard(0) -> y [4, 5] Partial(sum)
DTensor matmul(const DTensor& a, const DTensor& b);
/// x @ weight^T + bias, weight [out, in] (torch.nn.functional.linear): matmul with transpose(weight),
/// then add. Colwise weight Shard(0) + Replicate x -> Shard(-1); rowwise Shard(1) + x Shard(-1) -> Partial
/// (the bias is then added after an all-reduce, as PyTorch's Partial + Replicate). Mirrors aten::linear.
/// Example: auto y = dtensor::linear(x, w, b);  // x Replicate, w [out, in] Shard(0), b Shard(0) -> y Shard(-1)
DTensor linear(const DTensor& x, const DTensor& weight, const std::optional<DTensor>& bias = std::nullopt);

// ---- Shape ops ---------------------------------------------------------------------------------------
/// Swaps two dims; Shard dims follow. No communication. Throws c10::Error for a dim out of range.
/// Mirrors aten::transpose.int. Example: dtensor::transpose(w, 0, 1);  // [out, in] Shard(0) -> [in, out] Shard(1)
DTensor transpose(const DTensor& a, int64_t dim0, int64_t dim1);
/// Reorders dims; Shard dims follow. No communication. Throws c10::Error for a wrong or repeated dim.
/// Mirrors aten::permute. Example: dtensor::permute(x, {2, 0, 1});  // [B, S, H] Shard(1) -> [H, B, S] Shard(2)
DTensor permute(const DTensor& a, std::vector<int64_t> dims);
/// View/reshape to `shape` (one -1 allowed). Every sharded dim must survive unchanged: an output dim of
/// the same size with the same number of elements before it (e.g. [4, 6, 8] Shard(0) -> [4, 48]);
/// splitting or merging a sharded dim throws "fsdp::DTensor: no sharding rule for aten::view with
/// placements [...]" with the fix (redistribute that dim to Replicate first). Partial is kept.
/// Mirrors aten::view / aten::reshape. Example: dtensor::view(x, {4, -1});  // [4, 6, 8] Shard(0) -> [4, 48] Shard(0)
DTensor view(const DTensor& a, std::vector<int64_t> shape);
DTensor reshape(const DTensor& a, std::vector<int64_t> shape);
/// Concatenates along `dim`. A mesh dim sharding `dim` (in the first input) is all-gathered first; the
/// others follow the first input's placements. Throws c10::Error when the shapes differ outside `dim`.
/// Mirrors aten::cat. Example: dtensor::cat({a, b}, 1);  // [5, 3] and [5, 4] Shard(0) -> [5, 7] Shard(0)
DTensor cat(const std::vector<DTensor>& tensors, int64_t dim = 0);
/// Pieces of `split_size` along `dim` (the last may be shorter). A mesh dim sharding `dim` is
/// all-gathered first (PyTorch's rule); other placements are kept. Mirrors aten::split.Tensor.
/// Example: auto parts = dtensor::split(x, 3, 1);  // [7, 5] Shard(0) -> [7, 3], [7, 2] Shard(0)
std::vector<DTensor> split(const DTensor& a, int64_t split_size, int64_t dim = 0);
/// Softmax / log-softmax over `dim`: a sharded `dim` or a Partial input is made Replicate first; other
/// Shard dims are kept. Mirrors aten::_softmax / aten::_log_softmax.
/// Example: dtensor::softmax(logits, -1);  // [B, V] Shard(0) -> Shard(0); Shard(1) is all-gathered first
DTensor softmax(const DTensor& a, int64_t dim);
DTensor log_softmax(const DTensor& a, int64_t dim);

}  // namespace fsdp::dtensor

namespace fsdp {

/// Operators on DTensors: dtensor::add/sub/mul/div/neg (see above).
/// Example: auto y = (x * w + b) / 2.0;
DTensor operator+(const DTensor& a, const DTensor& b);
DTensor operator-(const DTensor& a, const DTensor& b);
DTensor operator*(const DTensor& a, const DTensor& b);
DTensor operator/(const DTensor& a, const DTensor& b);
DTensor operator+(const DTensor& a, const torch::Tensor& b);
DTensor operator-(const DTensor& a, const torch::Tensor& b);
DTensor operator*(const DTensor& a, const torch::Tensor& b);
DTensor operator/(const DTensor& a, const torch::Tensor& b);
DTensor operator+(const DTensor& a, double s);
DTensor operator-(const DTensor& a, double s);
DTensor operator*(const DTensor& a, double s);
DTensor operator/(const DTensor& a, double s);
DTensor operator+(double s, const DTensor& a);
DTensor operator*(double s, const DTensor& a);
DTensor operator-(const DTensor& a);

}  // namespace fsdp
