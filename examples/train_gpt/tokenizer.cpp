#include "tokenizer.h"

#include <filesystem>

#include "data.h"

#ifdef TRAIN_GPT_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace train_gpt {
namespace {

/// Bytes: id = the byte's value. decode(encode(s)) == s for any string.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int64_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int64_t id : ids) {
      if (id < 0 || id > 255) throw UsageError("byte tokenizer: id " + std::to_string(id) + " is not a byte (0..255)");
      out.push_back(static_cast<char>(id));
    }
    return out;
  }
  int64_t vocab_size() const override { return 256; }
  std::optional<int64_t> eos_id() const override { return std::nullopt; }
  std::string describe() const override { return "bytes (vocab 256)"; }
};

#ifdef TRAIN_GPT_WITH_SENTENCEPIECE
class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok()) {
      throw UsageError("--tokenizer " + path + " is not a SentencePiece model (" + status.ToString() +
                       "). Fix: a .model file written by spm_train (scripts/train_tokenizer.sh)");
    }
  }
  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw UsageError("--tokenizer " + path_ + ": encoding failed: " + status.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> v;
    v.reserve(ids.size());
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size()) {
        throw UsageError("--tokenizer " + path_ + ": id " + std::to_string(id) + " outside the vocabulary [0, " +
                         std::to_string(vocab_size()) + ")");
      }
      v.push_back(static_cast<int>(id));
    }
    std::string text;
    const auto status = sp_.Decode(v, &text);
    if (!status.ok()) throw UsageError("--tokenizer " + path_ + ": decoding failed: " + status.ToString());
    return text;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int64_t> eos_id() const override {
    const int id = sp_.eos_id();  // -1 when the model was trained with --eos_id=-1
    return id >= 0 ? std::optional<int64_t>(id) : std::nullopt;
  }
  std::string describe() const override {
    return "sentencepiece, vocab " + std::to_string(vocab_size()) + " (" + path_ + ")";
  }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  std::string path_;
};
#endif

}  // namespace

bool sentencepiece_available() {
#ifdef TRAIN_GPT_WITH_SENTENCEPIECE
  return true;
#else
  return false;
#endif
}

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& path) {
  if (path.empty()) return std::make_shared<ByteTokenizer>();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw UsageError("--tokenizer " + path + " does not exist or is not a file. Fix: a SentencePiece .model file " +
                     "(scripts/train_tokenizer.sh trains one), or omit --tokenizer for byte-level tokens");
  }
#ifdef TRAIN_GPT_WITH_SENTENCEPIECE
  return std::make_shared<SentencePieceTokenizer>(path);
#else
  throw UsageError("--tokenizer " + path + ": this train_gpt was built without SentencePiece (CMake did not find " +
                   "sentencepiece_processor.h and libsentencepiece). Fix: apt-get install libsentencepiece-dev " +
                   "(scripts/setup.sh does) and rebuild, or omit --tokenizer for byte-level tokens");
#endif
}

int64_t apply_tokenizer_vocab(int64_t preset_vocab, std::optional<int64_t> vocab_flag, const Tokenizer& tok) {
  const int64_t need = tok.vocab_size();
  if (vocab_flag) {
    if (*vocab_flag < need) {
      throw UsageError("--vocab-size " + std::to_string(*vocab_flag) + " is smaller than the tokenizer's vocabulary (" +
                       tok.describe() + "): its ids up to " + std::to_string(need - 1) + " would have no embedding. "
                       "Fix: --vocab-size >= " + std::to_string(need) + ", or omit it (the tokenizer's is used)");
    }
    return *vocab_flag;
  }
  if (preset_vocab == 256) return need;  // the byte-level shape: the tokenizer decides
  if (preset_vocab < need) {
    throw UsageError("the model's vocab_size " + std::to_string(preset_vocab) + " (its preset or --init-from " +
                     "config.json) is smaller than the tokenizer's vocabulary (" + tok.describe() + "). Fix: a " +
                     "tokenizer of at most " + std::to_string(preset_vocab) + " ids, or a model with a vocabulary " +
                     "of at least " + std::to_string(need));
  }
  return preset_vocab;
}

}  // namespace train_gpt
