// Parity harness for DTensor ops (tests/tensor/test_dtensor_ops.cpp, test_dtensor_autograd.cpp): runs an op
// on DTensors built from full tensors under every combination of the given placements, and compares the
// result (full_tensor()) and the gradients of the inputs' local tensors with the same op on the full
// tensors in one process (fp32, rtol 1e-5, atol 1e-5). The loss is sum(out * w) with a fixed random w,
// computed on every rank from the full output; the gradient of each input's local tensor must be this
// rank's piece of the one-process gradient under the input's placements, Partial read as Replicate
// ([Note: DTensor autograd]). Partial(sum) inputs hold uneven summands (not value-and-zeros), so that a
// dropped or double-counted summand shows.
#pragma once

#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"

namespace fsdp::testing::dtensor_parity {

using Placements = std::vector<Placement>;
using DOp = std::function<DTensor(const std::vector<DTensor>&)>;
using TOp = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

/// The largest difference seen by check_op in this process (printed by the tests).
inline double& max_diff_seen() {
  static double d = 0;
  return d;
}
inline std::mutex& max_diff_mutex() {
  static std::mutex mu;
  return mu;
}
inline void note_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) return;
  double d = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  std::lock_guard<std::mutex> lock(max_diff_mutex());
  max_diff_seen() = std::max(max_diff_seen(), d);
}

inline std::string describe(const Placements& ps) {
  std::string s = "(";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].str();
  return s + ")";
}

/// Deterministic full tensor, the same on every rank.
inline torch::Tensor full_input(const std::vector<int64_t>& shape, uint64_t seed, bool positive) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto t = torch::randn(shape, gen, torch::kFloat32);
  return positive ? t.abs() + 0.5 : t;
}

/// A DTensor of `full` with `ps`, whose local tensor is a leaf requiring grad. Partial(sum) dims hold
/// uneven summands.
inline DTensor leaf(const torch::Tensor& full, const DeviceMeshPtr& mesh, const Placements& ps) {
  auto plain = ps;
  for (auto& p : plain)
    if (p.is_partial()) p = Replicate();
  auto local = distribute_tensor(full, mesh, plain, std::nullopt).to_local().detach().clone();
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    if (!ps[d].is_partial()) continue;
    TORCH_CHECK(ps[d].reduce_op == "sum", "leaf: Partial(sum) only");
    auto r = torch::full_like(local, 0.25 * (d + 1));
    local = mesh->get_local_rank(d) == 0 ? local - (mesh->size(d) - 1) * r : r;
  }
  return DTensor(local.requires_grad_(true), mesh, ps, full.sizes().vec());
}

inline Placements grad_layout(Placements ps) {
  for (auto& p : ps)
    if (p.is_partial()) p = Replicate();
  return ps;
}

/// Checks `op` against `ref` for every combination of choices[i] (the placements tried for input i).
/// `shapes[i]` is input i's shape; `positive[i]` makes its values positive (for log, sqrt, div).
inline void check_op(const DeviceMeshPtr& mesh, const std::string& name, const std::vector<std::vector<int64_t>>& shapes,
                     const std::vector<std::vector<Placements>>& choices, const DOp& op, const TOp& ref,
                     std::vector<bool> positive = {}, bool grads = true) {
  positive.resize(shapes.size(), false);
  std::vector<torch::Tensor> fulls;
  for (size_t i = 0; i < shapes.size(); ++i) fulls.push_back(full_input(shapes[i], 1000 + 17 * i + shapes[i].size(), positive[i]));
  // Reference: output and gradients in one process.
  std::vector<torch::Tensor> ref_in;
  for (auto& f : fulls) ref_in.push_back(f.clone().requires_grad_(grads));
  auto ref_out = ref(ref_in);
  const bool differentiable = grads && ref_out.is_floating_point();
  auto w = full_input(ref_out.sizes().vec(), 7, false);
  std::vector<torch::Tensor> ref_grads(ref_in.size());
  if (differentiable) {
    (ref_out * w).sum().backward();
    for (size_t i = 0; i < ref_in.size(); ++i) ref_grads[i] = ref_in[i].grad().defined() ? ref_in[i].grad() : torch::zeros_like(ref_in[i]);
  }
  // Every combination of placements.
  std::vector<size_t> idx(choices.size(), 0);
  while (true) {
    std::vector<DTensor> in;
    std::string combo;
    for (size_t i = 0; i < choices.size(); ++i) {
      in.push_back(leaf(fulls[i], mesh, choices[i][idx[i]]));
      combo += (i ? " x " : "") + describe(choices[i][idx[i]]);
    }
    SCOPED_TRACE(name + " " + combo + " on " + mesh->str() + " rank " + std::to_string(mesh->get_rank()));
    DTensor out = op(in);
    EXPECT_EQ(out.sizes(), ref_out.sizes().vec());
    auto got = out.full_tensor();
    note_diff(got, ref_out.detach());
    EXPECT_TRUE(got.sizes() == ref_out.sizes() && torch::allclose(got, ref_out.detach(), 1e-5, 1e-5))
        << "output " << describe(out.placements()) << "\n" << got << "\nexpected\n" << ref_out;
    if (differentiable) {
      (got * w).sum().backward();
      for (size_t i = 0; i < in.size(); ++i) {
        auto expect = distribute_tensor(ref_grads[i], mesh, grad_layout(in[i].placements()), std::nullopt).to_local();
        auto g = in[i].to_local().grad();
        if (!g.defined()) g = torch::zeros_like(expect);
        note_diff(g, expect);
        EXPECT_TRUE(g.sizes() == expect.sizes() && torch::allclose(g, expect, 1e-5, 1e-5))
            << "gradient of input " << i << "\n" << g << "\nexpected\n" << expect;
      }
    }
    size_t k = 0;
    while (k < idx.size() && ++idx[k] == choices[k].size()) idx[k++] = 0;
    if (k == idx.size()) break;
  }
}

/// Placement lists for a mesh: every one of `one` on a 1-D mesh; on a 2-D mesh a fixed set of pairs.
inline std::vector<Placements> layouts(const DeviceMeshPtr& mesh, int64_t ndim, bool partial = true) {
  std::vector<Placement> one;
  for (int64_t d = 0; d < ndim; ++d) one.push_back(Shard(d));
  one.push_back(Replicate());
  if (partial) one.push_back(Partial());
  std::vector<Placements> out;
  if (mesh->ndim() == 1) {
    for (auto& p : one) out.push_back({p});
    return out;
  }
  // 2-D: both mesh dims on one tensor dim, on two tensor dims, one replicated, one partial.
  out.push_back({Shard(0), Shard(0)});
  if (ndim > 1) out.push_back({Shard(0), Shard(ndim - 1)});
  if (ndim > 1) out.push_back({Shard(ndim - 1), Shard(0)});
  out.push_back({Replicate(), Shard(ndim - 1)});
  out.push_back({Replicate(), Replicate()});
  if (partial) out.push_back({Partial(), Shard(0)});
  if (partial) out.push_back({Shard(ndim - 1), Partial()});
  return out;
}

/// A mesh of the test's world: 1-D for 2 and 3 ranks, 2x2 for 4.
inline DeviceMeshPtr test_mesh(const ProcessGroupPtr& pg) {
  if (pg->size() == 4) return init_device_mesh(torch::kCPU, {2, 2}, {"a", "b"}, pg);
  return init_device_mesh(torch::kCPU, {pg->size()}, {"a"}, pg);
}

}  // namespace fsdp::testing::dtensor_parity
