#include "sft.h"

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

namespace train_gpt {

std::vector<SftExample> read_sft_jsonl(const std::string& path, const Tokenizer& tok) {
  std::ifstream in(path);
  if (!in) throw UsageError("--sft " + path + " cannot be read (missing?). Fix: a JSONL file of {\"prompt\", \"response\"} lines");
  std::vector<SftExample> out;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](const std::string& why) {
      return UsageError("--sft " + path + ": line " + std::to_string(number) + " " + why +
                        ". Fix: one JSON object per line, {\"prompt\": \"...\", \"response\": \"...\"}");
    };
    if (j.is_discarded()) throw bad("is not valid JSON");
    if (!j.is_object()) throw bad("is not a JSON object");
    for (const char* key : {"prompt", "response"}) {
      if (!j.contains(key)) throw bad(std::string("has no \"") + key + "\"");
      if (!j.at(key).is_string()) throw bad(std::string("has a \"") + key + "\" that is not a string");
    }
    SftExample e;
    e.tokens = tok.encode(j.at("prompt").get<std::string>());
    e.prompt_tokens = static_cast<int64_t>(e.tokens.size());
    const auto r = tok.encode(j.at("response").get<std::string>());
    e.tokens.insert(e.tokens.end(), r.begin(), r.end());
    if (tok.eos_id()) e.tokens.push_back(*tok.eos_id());
    out.push_back(std::move(e));
  }
  if (out.empty()) throw UsageError("--sft " + path + " holds no example. Fix: {\"prompt\": ..., \"response\": ...} lines");
  return out;
}

SftWindows::SftWindows(std::vector<SftExample> examples, int64_t block_size, int64_t pad_id)
    : examples_(std::move(examples)), block_size_(block_size), pad_id_(pad_id) {}

void SftWindows::fill(int64_t index, int64_t* x, int64_t* y) const {
  const SftExample& e = examples_.at(static_cast<size_t>(index));
  const int64_t T = block_size_;
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(e.tokens.size()), T + 1);  // truncated
  for (int64_t i = 0; i < T; ++i) {
    x[i] = i < len ? e.tokens[i] : pad_id_;
    // Position i predicts token i + 1: learned only when that token is the response's (or its EOS).
    const int64_t next = i + 1;
    y[i] = next < len && next >= e.prompt_tokens ? e.tokens[next] : -100;
  }
}

SftData load_sft(const std::string& path, const Tokenizer& tok, int64_t block_size, double val_fraction) {
  auto examples = read_sft_jsonl(path, tok);
  std::vector<SftExample> train, val;
  int64_t truncated = 0, tokens = 0;
  for (size_t i = 0; i < examples.size(); ++i) {
    truncated += static_cast<int64_t>(examples[i].tokens.size()) > block_size + 1;
    tokens += static_cast<int64_t>(examples[i].tokens.size());
    const bool to_val = std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction);
    (to_val ? val : train).push_back(std::move(examples[i]));
  }
  const int64_t pad = tok.eos_id().value_or(0);
  SftData d;
  d.name = "sft " + path + ": " + std::to_string(examples.size()) + " examples (" + std::to_string(truncated) +
           " truncated to " + std::to_string(block_size + 1) + " tokens), padded, prompt tokens masked";
  d.tokens = tokens;
  d.train = std::make_shared<SftWindows>(std::move(train), block_size, pad);
  d.val = std::make_shared<SftWindows>(std::move(val), block_size, pad);
  return d;
}

torch::Tensor lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets, const fsdp::DeviceMeshPtr& vocab_mesh) {
  namespace F = torch::nn::functional;
  auto flat = logits.to(torch::kFloat32).reshape({-1, logits.size(-1)});
  if (vocab_mesh) {  // loss_parallel: this TP rank's vocabulary columns
    return fsdp::tp::vocab_parallel_cross_entropy(flat, targets.reshape({-1}), vocab_mesh,
                                                  fsdp::tp::LossParallelOptions().set_reduction("sum").set_ignore_index(-100));
  }
  return F::cross_entropy(flat, targets.reshape({-1}),
                          F::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
}

double masked_loss_scale(const std::vector<torch::Tensor>& targets, fsdp::ProcessGroup& pg, int tp) {
  int64_t mine = 0;
  for (const auto& y : targets) mine += y.ne(-100).sum().item<int64_t>();
  auto count = torch::tensor({static_cast<double>(mine)}, torch::TensorOptions(torch::kDouble)).to(pg.device());
  fsdp::all_reduce(count, pg, fsdp::ReduceOp::SUM);
  const double n = count.item<double>() / tp;
  const double data_world = static_cast<double>(pg.size() / tp);
  return n > 0 ? data_world / n : 0.0;
}

}  // namespace train_gpt
