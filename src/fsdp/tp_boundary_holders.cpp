// Tells tensor parallelism's boundary styles which modules an fsdp::FSDPModule holder calls (the fsdp layer owns
// the holders' registry; tensor/parallel does not depend on fsdp). See [Note: module boundaries] in
// src/tensor/parallel/prepare_module.cpp.
#include "fsdp/fsdp_state.h"
#include "tensor/parallel/prepare_module.h"

namespace fsdp::detail {
namespace {
const bool installed = [] {
  tp::detail::set_holder_query([](const torch::nn::Module& m) { return is_marked(m); });
  return true;
}();
}  // namespace
}  // namespace fsdp::detail
