// The plan side's view of the boundary styles (prepare_module.cpp): the model being parallelised, which
// register_forward_pre_hook and the PrepareModule* styles search for the boundary of a module.
#pragma once

#include <memory>

#include <torch/nn/module.h>

namespace fsdp::tp::detail {

/// While it lives, this thread is inside parallelize_module(root, ...) (nested calls keep the outermost root).
struct ParallelizeContext {
  explicit ParallelizeContext(std::shared_ptr<torch::nn::Module> root);
  ~ParallelizeContext();
  ParallelizeContext(const ParallelizeContext&) = delete;
  ParallelizeContext& operator=(const ParallelizeContext&) = delete;

 private:
  std::shared_ptr<torch::nn::Module> previous_;
};

/// Whether a live fsdp::FSDPModule holder routes `module`'s forward (installed by the fsdp layer, which owns
/// the holders' registry, so that tensor/parallel does not depend on fsdp).
using HolderQuery = bool (*)(const torch::nn::Module& module);
void set_holder_query(HolderQuery q);

}  // namespace fsdp::tp::detail
