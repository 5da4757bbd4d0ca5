#include "data.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace train_gpt {
namespace fs = std::filesystem;

namespace {

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw UsageError("data file '" + path + "' does not exist. Fix: pass existing text files to --data, or " +
                     "omit --data to train on the default corpus (" + kDefaultCorpusDir + ")");
  }
  if (fs::is_directory(path, ec)) {
    throw UsageError("--data '" + path + "' is a directory: expected text files. Fix: --data " + path + "/*.txt");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("data file '" + path + "' cannot be read (permissions?)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fortune file is a list of entries separated by lines holding only "%": keep the text, with one
// blank line between entries, so the model learns "end of a fortune" as a paragraph break.
std::string strip_fortune_separators(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    size_t next = end == std::string::npos ? text.size() : end + 1;
    std::string_view line(text.data() + pos, (end == std::string::npos ? text.size() : end) - pos);
    if (line == "%") {
      out += '\n';
    } else {
      out.append(text, pos, next - pos);
    }
    pos = next;
  }
  return out;
}

torch::Tensor bytes_to_tokens(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  std::copy(s.begin(), s.end(), reinterpret_cast<char*>(t.data_ptr<uint8_t>()));
  return t.to(torch::kLong);
}

}  // namespace

Corpus load_default_corpus() {
  std::error_code ec;
  if (!fs::is_directory(kDefaultCorpusDir, ec)) {
    throw UsageError(std::string("the default corpus is not installed: ") + kDefaultCorpusDir +
                     " is missing (Debian packages fortunes and fortunes-min). Fix: run scripts/setup.sh " +
                     "(or apt-get install fortunes fortunes-min), or pass your own text with --data FILE...");
  }
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(kDefaultCorpusDir)) {
    const auto& p = e.path();
    // Regular files only: the *.u8 entries are symlinks to the same text, *.dat are strfile indexes.
    if (!e.is_regular_file() || e.is_symlink() || p.extension() == ".dat" || p.extension() == ".u8") continue;
    files.push_back(p.string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    throw UsageError(std::string("the default corpus directory ") + kDefaultCorpusDir +
                     " holds no fortune files. Fix: apt-get install --reinstall fortunes fortunes-min, or --data FILE...");
  }
  Corpus c;
  for (const auto& f : files) c.text += strip_fortune_separators(read_file(f));
  c.files = files;
  c.name = std::string("fortunes (") + std::to_string(files.size()) + " files in " + kDefaultCorpusDir + ")";
  return c;
}

Corpus load_corpus(const std::vector<std::string>& paths) {
  Corpus c;
  for (const auto& p : paths) {
    c.text += read_file(p);
    c.name += (c.name.empty() ? "" : " ") + p;
  }
  c.files = paths;
  return c;
}

Split split_text(const std::string& text, double val_fraction, int64_t segment_len) {
  TORCH_CHECK(segment_len > 0, "split_text: segment_len must be positive");
  std::string train, val;
  const int64_t n = static_cast<int64_t>(text.size());
  for (int64_t i = 0; i * segment_len < n; ++i) {
    const bool to_val = std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction);
    (to_val ? val : train).append(text, i * segment_len, segment_len);
  }
  return {bytes_to_tokens(train), bytes_to_tokens(val)};
}

// ---- Windows ----------------------------------------------------------------------------------------

TokenWindows::TokenWindows(torch::Tensor tokens, int64_t block_size)
    : tokens_(std::move(tokens)), block_size_(block_size) {
  TORCH_CHECK(tokens_.dim() == 1 && block_size_ > 0, "TokenWindows: expected 1-D tokens and a positive block size");
  size_ = tokens_.numel() > 0 ? (tokens_.numel() - 1) / block_size_ : 0;
}

TokenWindows::TokenWindows(std::shared_ptr<const WindowSource> source, int64_t block_size)
    : source_(std::move(source)), block_size_(block_size) {
  TORCH_CHECK(source_ && block_size_ > 0, "TokenWindows: expected a source and a positive block size");
  size_ = source_->size();
}

std::pair<torch::Tensor, torch::Tensor> TokenWindows::get(const std::vector<int64_t>& indices) const {
  const auto B = static_cast<int64_t>(indices.size());
  auto x = torch::empty({B, block_size_}, torch::kLong);
  auto y = torch::empty({B, block_size_}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(indices[b] >= 0 && indices[b] < size_, "TokenWindows: window ", indices[b], " out of range [0, ",
                size_, ")");
    if (source_) {
      source_->fill(indices[b], x.data_ptr<int64_t>() + b * block_size_, y.data_ptr<int64_t>() + b * block_size_);
      continue;
    }
    auto w = tokens_.narrow(0, indices[b] * block_size_, block_size_ + 1);
    x[b].copy_(w.narrow(0, 0, block_size_));
    y[b].copy_(w.narrow(0, 1, block_size_));
  }
  return {x, y};
}

// ---- Sampling ---------------------------------------------------------------------------------------

DistributedSampler::DistributedSampler(int64_t num_windows, int64_t batch_size, int rank, int world_size,
                                       uint64_t seed)
    : num_windows_(num_windows),
      batch_size_(batch_size),
      global_batch_(batch_size * world_size),
      rank_(rank),
      world_size_(world_size),
      seed_(seed) {
  if (num_windows_ < global_batch_) {
    throw UsageError("the training split has " + std::to_string(num_windows_) + " windows but one global batch " +
                     "needs --batch-size(" + std::to_string(batch_size) + ") x ranks(" +
                     std::to_string(world_size) + ") = " + std::to_string(global_batch_) +
                     ": more ranks than batches. Fix: fewer ranks, a smaller --batch-size or --block-size, " +
                     "or more text");
  }
}

void DistributedSampler::ensure_permutation() {
  if (perm_epoch_ == state_.epoch) return;  // already drawn
  // A generator of its own, seeded by (seed, epoch): the same permutation on every rank, and
  // independent of everything else the program draws.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003ULL + static_cast<uint64_t>(state_.epoch));
  perm_ = torch::randperm(num_windows_, gen, torch::kLong);
  perm_epoch_ = state_.epoch;
}

std::vector<int64_t> DistributedSampler::next() {
  if (state_.cursor + global_batch_ > num_windows_) {  // the uneven tail: dropped on every rank
    ++state_.epoch;
    state_.cursor = 0;
  }
  ensure_permutation();
  const auto* p = perm_.data_ptr<int64_t>() + state_.cursor;
  std::vector<int64_t> mine;
  mine.reserve(batch_size_);
  for (int64_t i = rank_; i < global_batch_; i += world_size_) mine.push_back(p[i]);
  state_.cursor += global_batch_;
  return mine;
}

void DistributedSampler::set_state(const State& s) {
  TORCH_CHECK(s.epoch >= 0 && s.cursor >= 0 && s.cursor <= num_windows_, "DistributedSampler: invalid state (epoch ",
              s.epoch, ", cursor ", s.cursor, ") for ", num_windows_, " windows");
  state_ = s;
}

fsdp::StateDict DistributedSampler::state_dict() {
  fsdp::StateDict sd;
  sd.insert_or_assign("epoch", fsdp::Value(state_.epoch));
  sd.insert_or_assign("cursor", fsdp::Value(state_.cursor));
  return sd;
}

void DistributedSampler::load_state_dict(const fsdp::StateDict& sd) {
  auto value = [&](const char* key) { return std::get<fsdp::Value>(sd.at(key)).json.get<int64_t>(); };
  set_state({value("epoch"), value("cursor")});
}

std::vector<int64_t> eval_indices(int64_t batch, int64_t batch_size, int rank, int world_size) {
  const int64_t G = batch_size * world_size;
  std::vector<int64_t> mine;
  for (int64_t i = rank; i < G; i += world_size) mine.push_back(batch * G + i);
  return mine;
}

}  // namespace train_gpt
