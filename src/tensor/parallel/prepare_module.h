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

/// Throws c10::Error if `param` belongs to a module with boundary styles (PrepareModuleInput/Output, user hooks)
/// whose boundary is not open on this thread: the module was called around its holder or Sequential, so its styles
/// did not run. Called by the TP op side for the weight of each TP Linear/Embedding op it runs. Every rank runs the same
/// forward, so every rank throws alike.
void check_boundary_use(const torch::Tensor& param);

/// Whether a live fsdp::FSDPModule holder routes `module`'s forward (installed by the fsdp layer, which owns
/// the holders' registry, so that tensor/parallel does not depend on fsdp).
using HolderQuery = bool (*)(const torch::nn::Module& module);
void set_holder_query(HolderQuery q);

}  // namespace fsdp::tp::detail
