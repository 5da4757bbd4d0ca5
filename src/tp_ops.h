// Tensor parallelism's op side (tp_ops.cpp): the registry of TP parameters and the handling of the ops
// that run a parallelised module (aten::linear, aten::embedding) inside the dispatcher fallback of
// fsdp_interception.cpp. The plan side (matching, validation, sharding) is tensor_parallel.cpp.
#pragma once

#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

#include "fsdp/tensor_parallel.h"

namespace fsdp::tp::detail {

/// What a parallelised parameter is.
struct TPParam {
  std::string fqn;            ///< module FQN in the model parallelize_module was given ("" = that module)
  bool is_embedding = false;  ///< else Linear
  bool is_weight = true;      ///< else the (colwise) bias
  ParallelStyle style;
  DeviceMeshPtr mesh;                 ///< 1-D TP mesh (keeps the group alive for the autograd functions)
  Placement placement;                ///< of this parameter on the mesh
  std::vector<int64_t> global_shape;  ///< before sharding
};

/// Records a parallelised parameter (by its TensorImpl, which set_data keeps).
void register_tp_param(const torch::Tensor& param, TPParam info);
/// The record of `param`, or nullptr.
const TPParam* find_tp_param(const torch::Tensor& param);

/// Called first by the interception fallback on every intercepted op. Runs the op the TP way and
/// returns true when it is aten::linear or aten::embedding on a TP weight; else returns false and leaves
/// the stack untouched.
bool tp_handle_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

}  // namespace fsdp::tp::detail
