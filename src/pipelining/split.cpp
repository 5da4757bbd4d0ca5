// split_sequential (fsdp/pipelining/split.h).
#include "fsdp/pipelining/split.h"

#include <map>

#include <c10/util/Exception.h>

namespace fsdp::pipelining {

std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<std::string>& split_points) {
  const auto children = model->named_children();
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < children.size(); ++i) position[children[i].key()] = i;
  std::vector<size_t> cuts;
  for (const auto& p : split_points) {
    auto it = position.find(p);
    TORCH_CHECK(it != position.end(), "split_sequential: split point '", p, "' is not a child of the Sequential (",
                children.size(), " children, named ", children.size() ? children[0].key() : "", "..",
                children.size() ? children[children.size() - 1].key() : "", ")");
    TORCH_CHECK(it->second > 0, "split_sequential: split point '", p,
                "' is the first child: the stage before it would be empty");
    TORCH_CHECK(cuts.empty() || it->second > cuts.back(), "split_sequential: split point '", p,
                "' is not after the previous one: give the points in the model's order, each once");
    cuts.push_back(it->second);
  }
  cuts.push_back(children.size());
  std::vector<torch::nn::AnyModule> anys(model->begin(), model->end());
  std::vector<torch::nn::Sequential> stages;
  size_t begin = 0;
  for (size_t end : cuts) {
    torch::nn::Sequential stage;
    for (size_t i = begin; i < end; ++i) {
      // Sequential::push_back(name, module) keeps the child's name, hence the unsplit model's FQNs.
      stage->push_back(children[i].key(), anys[i]);
    }
    stages.push_back(stage);
    begin = end;
  }
  return stages;
}

std::vector<std::string> even_split_points(const torch::nn::Sequential& model, int num_stages) {
  const auto children = model->named_children();
  const int n = static_cast<int>(children.size());
  TORCH_CHECK(num_stages >= 1 && num_stages <= n, "even_split_points: cannot cut ", n, " children into ", num_stages,
              " non-empty stages");
  std::vector<std::string> points;
  int at = 0;
  for (int s = 0; s + 1 < num_stages; ++s) {
    at += n / num_stages + (s < n % num_stages ? 1 : 0);
    points.push_back(children[at].key());
  }
  return points;
}

}  // namespace fsdp::pipelining
