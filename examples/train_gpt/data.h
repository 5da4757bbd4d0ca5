// Data for train_gpt: the text corpus, its train/validation split, fixed-length token windows and a
// distributed sampler.
//
// Tokens are bytes (vocabulary 256), so any UTF-8 text trains without a tokenizer. Each split is cut
// into non-overlapping windows of block_size + 1 tokens (input = the first block_size, target = the
// last block_size). Every rank loads the whole corpus (a few MB) and builds the same windows; the
// sampler decides which windows each rank trains on.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fsdp/checkpoint/stateful.h"

namespace train_gpt {

/// A mistake in the command line or its inputs: reported as "train_gpt: error: <message>" on every
/// rank before training starts. Messages name the offending value and the fix.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Where scripts/setup.sh installs the default corpus (Debian packages `fortunes` and `fortunes-min`).
inline constexpr const char* kDefaultCorpusDir = "/usr/share/games/fortunes";

struct Corpus {
  std::string text;                 ///< all files concatenated, in the order given
  std::vector<std::string> files;   ///< the files read
  std::string name;                 ///< "fortunes (52 files)" or the --data paths, for the log
};

/// The default corpus: every fortune file in kDefaultCorpusDir (not the *.dat indexes, not the *.u8
/// links), sorted by name, with the `%` lines that separate fortunes replaced by blank lines.
/// Throws UsageError when the directory is missing (Fix: scripts/setup.sh, or --data).
Corpus load_default_corpus();
/// The files `paths`, read verbatim and concatenated. Throws UsageError naming a missing or unreadable file.
Corpus load_corpus(const std::vector<std::string>& paths);

/// The train and validation token streams (1-D int64, values 0..255).
struct Split {
  torch::Tensor train, val;
};
/// Cuts `text` into segments of `segment_len` bytes and sends an evenly spread fraction
/// `val_fraction` of them (segment i when floor((i + 1) f) > floor(i f)) to validation, the rest to
/// training: both splits sample the whole corpus, not just its last files.
Split split_text(const std::string& text, double val_fraction, int64_t segment_len);

/// Windows that do not live in one in-memory tensor: memory-mapped token shards (token_shards.h) or SFT
/// examples with masked targets (sft.h). TokenWindows reads through it.
class WindowSource {
 public:
  virtual ~WindowSource() = default;
  /// Number of windows.
  virtual int64_t size() const = 0;
  /// Writes window `index`'s input and target, block_size int64 each, to `x` and `y` (a target of -100,
  /// cross_entropy's ignore_index, adds nothing to the loss). Throws UsageError for bad data on disk.
  virtual void fill(int64_t index, int64_t* x, int64_t* y) const = 0;
};

/// Non-overlapping windows of block_size + 1 tokens over a 1-D token stream, or the windows of a
/// WindowSource.
class TokenWindows {
 public:
  TokenWindows(torch::Tensor tokens, int64_t block_size);
  /// The windows of `source` (each block_size tokens of input and of target).
  TokenWindows(std::shared_ptr<const WindowSource> source, int64_t block_size);
  /// Number of windows: (tokens - 1) / block_size, or the source's.
  int64_t size() const { return size_; }
  int64_t block_size() const { return block_size_; }
  /// Inputs and targets [indices.size(), block_size] (int64) of the windows `indices`.
  std::pair<torch::Tensor, torch::Tensor> get(const std::vector<int64_t>& indices) const;

 private:
  torch::Tensor tokens_;  // 1-D int64 (undefined with a source)
  std::shared_ptr<const WindowSource> source_;
  int64_t block_size_;
  int64_t size_;
};

/// torch.utils.data.DistributedSampler semantics over the windows of the training split, one global
/// batch at a time: each epoch is a permutation of all windows seeded by (seed, epoch), identical on
/// every rank; a global batch is the next batch_size * world_size indices of it, and rank r takes
/// indices[r::world_size] of that window. The tail of an epoch that does not fill a global batch is
/// dropped (on every rank alike), then the next epoch starts.
/// Consequence (tested): one process with batch_size B * W sees exactly the union of what W ranks
/// with batch_size B see, step by step, so the sharded and unsharded runs train on the same data.
/// It is the data loader's fsdp::Stateful (checkpointing.cpp saves it as "train.sampler": its state_dict()
/// is {epoch, cursor}, the same on every rank and independent of the world size, so it loads on any).
class DistributedSampler : public fsdp::Stateful {
 public:
  /// Where the sampler stands, independent of the world size (what a checkpoint must carry to resume
  /// the data position, also on another world size).
  struct State {
    int64_t epoch = 0;   ///< epochs completed
    int64_t cursor = 0;  ///< windows of the current epoch's permutation already handed out, all ranks together
  };
  /// Throws UsageError if one global batch needs more windows than `num_windows` ("more ranks than batches").
  DistributedSampler(int64_t num_windows, int64_t batch_size, int rank, int world_size, uint64_t seed);
  /// This rank's window indices of the next global batch (batch_size of them).
  std::vector<int64_t> next();
  /// Global batches per epoch: num_windows / (batch_size * world_size).
  int64_t batches_per_epoch() const { return num_windows_ / global_batch_; }
  State state() const { return state_; }
  /// Throws c10::Error for a position outside this epoch's windows.
  void set_state(const State& s);
  /// fsdp::Stateful: {"epoch", "cursor"} as Values.
  fsdp::StateDict state_dict() override;
  /// fsdp::Stateful: set_state() from the loaded {"epoch", "cursor"}.
  void load_state_dict(const fsdp::StateDict& sd) override;

 private:
  void ensure_permutation();
  int64_t num_windows_, batch_size_, global_batch_;
  int rank_, world_size_;
  uint64_t seed_;
  State state_;
  int64_t perm_epoch_ = -1;
  torch::Tensor perm_;  // 1-D int64, the permutation of epoch perm_epoch_
};

/// The fixed evaluation batches of the validation split: global batch b covers windows
/// [b * G, (b + 1) * G) with G = batch_size * world_size, rank r takes every world_size-th of them
/// from r. Same windows for every evaluation and every world size with the same G.
std::vector<int64_t> eval_indices(int64_t batch, int64_t batch_size, int rank, int world_size);

}  // namespace train_gpt
