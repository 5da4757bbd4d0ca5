// The split backward of the zero-bubble schedules (src/pipelining/backward_split.h).
#include "pipelining/backward_split.h"

#include <functional>
#include <map>
#include <set>
#include <unordered_map>

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp::pipelining::detail {

namespace ag = torch::autograd;

struct WeightGradWork {
  struct Intermediate {
    ag::Node* node = nullptr;
    ag::edge_list weight_edges;  // the weights this node's branches lead to
    std::shared_ptr<ag::variable_list> grads = std::make_shared<ag::variable_list>();  // what entered it in I
  };
  bool split = false;
  std::vector<Intermediate> intermediates;
};

namespace {

/// Records, once, the gradients that enter a node (its pre-hook runs with them before the node does).
struct CapturePreHook : ag::FunctionPreHook {
  explicit CapturePreHook(std::shared_ptr<ag::variable_list> into) : into_(std::move(into)) {}
  ag::variable_list operator()(const ag::variable_list& grads) override {
    if (into_->empty()) *into_ = grads;
    return grads;
  }
  std::shared_ptr<ag::variable_list> into_;
};

}  // namespace

std::shared_ptr<WeightGradWork> backward_input(const torch::Tensor& output, const torch::Tensor& grad_output,
                                               const torch::Tensor& input, const std::vector<torch::Tensor>& weights,
                                               bool split, torch::Tensor* input_grad) {
  auto work = std::make_shared<WeightGradWork>();
  std::vector<torch::Tensor> gouts;
  if (grad_output.defined()) gouts.push_back(grad_output);
  if (split && output.grad_fn()) {
    // The graph from the output: P = the nodes from which the input's gradient edge is reachable (the
    // input's path). An intermediate is a node of P with a branch (an edge to a node outside P) that reaches
    // weights: I computes the gradient entering it anyway; W feeds that gradient back into it with only the
    // weights as outputs, so autograd runs the weight branches and nothing of the input's path again.
    // Each weight must hang below exactly one intermediate (else W would count it twice): otherwise no split.
    const ag::Node* input_node = ag::impl::gradient_edge(input).function.get();
    std::map<const ag::Node*, ag::Edge> weight_nodes;  // AccumulateGrad node -> its edge
    for (const auto& w : weights) {
      if (!w.requires_grad()) continue;
      auto acc = ag::impl::try_get_grad_accumulator(w);
      if (acc) weight_nodes.emplace(acc.get(), ag::Edge(acc, 0));
    }
    std::unordered_map<const ag::Node*, bool> reaches_input;
    std::function<bool(ag::Node*)> on_path = [&](ag::Node* n) -> bool {
      if (!n) return false;
      if (n == input_node) return true;
      auto it = reaches_input.find(n);
      if (it != reaches_input.end()) return it->second;
      reaches_input[n] = false;  // (a graph is acyclic; this only stops revisits)
      bool r = false;
      for (const auto& e : n->next_edges()) r = on_path(e.function.get()) || r;
      reaches_input[n] = r;
      return r;
    };
    ag::Node* root = output.grad_fn().get();
    bool ok = on_path(root);
    std::map<const ag::Node*, int> owner;  // weight node -> intermediate index
    std::set<const ag::Node*> visited_p;
    std::vector<ag::Node*> stack{root};
    while (ok && !stack.empty()) {
      ag::Node* n = stack.back();
      stack.pop_back();
      if (!visited_p.insert(n).second) continue;
      WeightGradWork::Intermediate im;
      im.node = n;
      std::set<const ag::Node*> mine;
      for (const auto& e : n->next_edges()) {
        ag::Node* t = e.function.get();
        if (!t) continue;
        if (reaches_input.count(t) && reaches_input[t]) {
          stack.push_back(t);
          continue;
        }
        // A branch off the input's path: collect the weights below it.
        std::vector<ag::Node*> s2{t};
        std::set<const ag::Node*> seen;
        while (!s2.empty()) {
          ag::Node* b = s2.back();
          s2.pop_back();
          if (!b || !seen.insert(b).second) continue;
          if (auto w = weight_nodes.find(b); w != weight_nodes.end()) {
            mine.insert(b);
            continue;
          }
          for (const auto& e2 : b->next_edges()) s2.push_back(e2.function.get());
        }
      }
      if (mine.empty()) continue;
      for (const auto* w : mine) {
        if (owner.count(w)) ok = false;  // a weight under two intermediates (tied): no split
        owner[w] = static_cast<int>(work->intermediates.size());
        im.weight_edges.push_back(weight_nodes.at(w));
      }
      work->intermediates.push_back(std::move(im));
    }
    // Weights reachable only from nodes off the input's path from the root itself are not owned by any
    // intermediate: then no split either (W would miss them).
    if (ok) {
      std::set<const ag::Node*> all;
      std::vector<ag::Node*> s3{root};
      while (!s3.empty()) {
        ag::Node* b = s3.back();
        s3.pop_back();
        if (!b || !all.insert(b).second) continue;
        for (const auto& e : b->next_edges()) s3.push_back(e.function.get());
      }
      for (const auto& [w, _] : weight_nodes)
        if (all.count(w) && !owner.count(w)) ok = false;
    }
    work->split = ok && !work->intermediates.empty();
    if (!work->split) work->intermediates.clear();
    for (auto& im : work->intermediates) im.node->add_pre_hook(std::make_unique<CapturePreHook>(im.grads));
  }
  auto grads = ag::grad({output}, {input}, gouts, /*retain_graph=*/true, /*create_graph=*/false,
                        /*allow_unused=*/true);
  *input_grad = grads[0];
  if (work->split) {
    for (const auto& im : work->intermediates) {
      if (im.grads->empty()) {  // the node did not run in I (cannot happen on the input's path): no split
        work->split = false;
        break;
      }
    }
  }
  return work;
}

bool is_split(const std::shared_ptr<WeightGradWork>& work) { return work && work->split; }

void backward_weight(const std::shared_ptr<WeightGradWork>& work, const torch::Tensor& output,
                     const torch::Tensor& grad_output) {
  if (!work || !work->split) {
    if (grad_output.defined()) {
      ag::backward({output}, {grad_output});
    } else {
      ag::backward({output});
    }
    return;
  }
  auto& engine = ag::Engine::get_default_engine();
  for (size_t i = 0; i < work->intermediates.size(); ++i) {
    auto& im = work->intermediates[i];
    ag::edge_list roots;
    ag::variable_list inputs;
    for (uint32_t k = 0; k < im.grads->size(); ++k) {
      if (!(*im.grads)[k].defined()) continue;
      roots.emplace_back(im.node->getptr(), k);
      inputs.push_back((*im.grads)[k]);
    }
    if (roots.empty()) continue;
    // Only the weights as outputs, accumulated into .grad (backward(inputs=weights)): autograd runs the
    // node for its weight branches only (its input's gradient is not needed) and nothing below it.
    engine.execute(roots, inputs, /*keep_graph=*/i + 1 < work->intermediates.size(), /*create_graph=*/false,
                   /*accumulate_grad=*/true, im.weight_edges);
    im.grads->clear();
  }
}

}  // namespace fsdp::pipelining::detail
