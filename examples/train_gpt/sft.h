// Supervised fine-tuning data for train_gpt (--sft FILE.jsonl) and the loss over unmasked tokens.
//
// Each line of FILE.jsonl is {"prompt": "...", "response": "..."}. An example is tokenized as
// encode(prompt) + encode(response) (+ EOS when the tokenizer has one): prompt and response are encoded
// separately, so their boundary is a token boundary and the mask is exact. Examples are padded, not packed:
// each is one window of block_size + 1 tokens (longer ones are truncated, and counted in the log), the rest
// padding (EOS, else id 0). The targets of the prompt's tokens and of the padding are -100 (cross_entropy's
// ignore_index): only the response's tokens (and its EOS) are learned. Padding wastes compute on short
// examples but keeps one example per row, which is what makes the mask trivially right (no attention
// across packed examples).
//
// The loss is the mean over the unmasked tokens of the whole step: all microbatches of all data-parallel
// ranks (not the mean of each rank's mean, which weights a token by how many others share its rank's
// batch): see MaskedLossScale. A 2-rank run then equals a 1-rank run on the same global batch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "data.h"
#include "fsdp/fsdp.h"
#include "tokenizer.h"

namespace train_gpt {

/// One example: its tokens (prompt, response, EOS) and how many of them are the prompt.
struct SftExample {
  std::vector<int64_t> tokens;
  int64_t prompt_tokens = 0;
};

/// The examples of `path`, tokenized with `tok`. Throws UsageError naming the line number of a line that
/// is not a JSON object with string fields "prompt" and "response", or when the file has no example.
/// Blank lines are skipped.
/// Example: `auto ex = read_sft_jsonl("data.jsonl", *load_tokenizer(""));`
std::vector<SftExample> read_sft_jsonl(const std::string& path, const Tokenizer& tok);

/// Windows of SFT examples: window i is example i, truncated to block_size + 1 tokens and padded with
/// `pad_id`; targets -100 on the prompt and the padding.
class SftWindows final : public WindowSource {
 public:
  SftWindows(std::vector<SftExample> examples, int64_t block_size, int64_t pad_id);
  int64_t size() const override { return static_cast<int64_t>(examples_.size()); }
  void fill(int64_t index, int64_t* x, int64_t* y) const override;

 private:
  std::vector<SftExample> examples_;
  int64_t block_size_, pad_id_;
};

/// --sft: the training and validation windows of `path` (example i to validation when
/// floor((i + 1) f) > floor(i f), f = `val_fraction`), and a description for the log. Throws UsageError.
struct SftData {
  std::shared_ptr<const SftWindows> train, val;
  std::string name;  ///< "sft FILE: N examples, K truncated to 129 tokens"
  int64_t tokens = 0;
};
SftData load_sft(const std::string& path, const Tokenizer& tok, int64_t block_size, double val_fraction);

/// The summed cross-entropy of `logits` [..., V] against `targets` [...] (int64; -100 ignored), in fp32.
torch::Tensor lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                          const fsdp::DeviceMeshPtr& vocab_mesh = nullptr);

/// The factor that makes the global mean over unmasked tokens out of per-rank sums: FSDP (and DDP)
/// average the ranks' gradients, so rank r's loss is (its summed token loss) x data_world / N, N the
/// unmasked targets of the whole step (all microbatches, all ranks). Then the averaged gradient is the
/// gradient of (sum over all tokens) / N, and the sum of the ranks' losses / data_world is the global mean.
/// Collective: one all-reduce of the count over `pg` (every rank of a TP group counts the same targets,
/// hence / tp). N = 0 (every target masked) gives 0: a zero loss and zero gradients, not 0/0.
/// Example: `double k = masked_loss_scale(targets, pg, tp); loss = lm_loss_sum(logits, y) * k;`
double masked_loss_scale(const std::vector<torch::Tensor>& targets, fsdp::ProcessGroup& pg, int tp);

}  // namespace train_gpt
