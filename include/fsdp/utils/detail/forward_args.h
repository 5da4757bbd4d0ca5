// Internal (installed because public templates use it; not part of the API): flattening of a forward
// call's arguments and results into tensors and back, which is what FSDP's hooks and activation
// checkpointing see of an arbitrary module forward signature.
#pragma once

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace fsdp::detail {

// Collects the tensor arguments (by position) and rebuilds them after transformation.
inline void collect(std::vector<torch::Tensor>& out, const torch::Tensor& t) { out.push_back(t); }
template <typename T, typename = std::enable_if_t<!std::is_same_v<std::decay_t<T>, torch::Tensor>>>
void collect(std::vector<torch::Tensor>&, const T&) {}
inline torch::Tensor replace(const torch::Tensor&, const std::vector<torch::Tensor>& v, size_t& i) { return v[i++]; }
template <typename T, typename = std::enable_if_t<!std::is_same_v<std::decay_t<T>, torch::Tensor>>>
T&& replace(T&& x, const std::vector<torch::Tensor>&, size_t&) {
  return std::forward<T>(x);
}

// Visits the tensors of an output: a Tensor, a std::vector<Tensor>, or a std::tuple/std::pair of those.
inline void collect_out(std::vector<torch::Tensor>& v, const torch::Tensor& t) { v.push_back(t); }
inline void collect_out(std::vector<torch::Tensor>& v, const std::vector<torch::Tensor>& ts) {
  v.insert(v.end(), ts.begin(), ts.end());
}
template <typename T>
void collect_out(std::vector<torch::Tensor>&, const T&) {}
template <typename... Ts>
void collect_out(std::vector<torch::Tensor>& v, const std::tuple<Ts...>& t) {
  std::apply([&](const auto&... xs) { (collect_out(v, xs), ...); }, t);
}
template <typename A, typename B>
void collect_out(std::vector<torch::Tensor>& v, const std::pair<A, B>& p) {
  collect_out(v, p.first);
  collect_out(v, p.second);
}
inline void restore_out(torch::Tensor& t, const std::vector<torch::Tensor>& v, size_t& i) { t = v[i++]; }
inline void restore_out(std::vector<torch::Tensor>& ts, const std::vector<torch::Tensor>& v, size_t& i) {
  for (auto& t : ts) t = v[i++];
}
template <typename T>
void restore_out(T&, const std::vector<torch::Tensor>&, size_t&) {}
template <typename... Ts>
void restore_out(std::tuple<Ts...>& t, const std::vector<torch::Tensor>& v, size_t& i) {
  std::apply([&](auto&... xs) { (restore_out(xs, v, i), ...); }, t);
}
template <typename A, typename B>
void restore_out(std::pair<A, B>& p, const std::vector<torch::Tensor>& v, size_t& i) {
  restore_out(p.first, v, i);
  restore_out(p.second, v, i);
}

}  // namespace fsdp::detail
