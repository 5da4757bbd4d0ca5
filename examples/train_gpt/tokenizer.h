// train_gpt's tokenizers: bytes (the default: vocabulary 256, any UTF-8 text, no file) or a SentencePiece
// model (--tokenizer FILE.model, through SentencePiece's own C++ library, sentencepiece_processor.h: the
// ids are the Python `sentencepiece` package's for the same file, tested in tests/python/test_tokenizer.py).
// scripts/train_tokenizer.sh trains one on a corpus with spm_train (BPE, byte fallback).
//
// The model's vocab_size follows the tokenizer (apply_tokenizer_vocab); the text the run trains on, its
// SFT examples (sft.h) and the shards `train_gpt tokenize` writes (token_shards.h) are encoded with it, and
// the sample is decoded with it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model.h"

namespace train_gpt {

/// Text <-> token ids. Implementations are immutable after construction (encode/decode are const and
/// thread-compatible).
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// The ids of `text` (each in [0, vocab_size())), without BOS/EOS.
  virtual std::vector<int64_t> encode(std::string_view text) const = 0;
  /// The text of `ids`. Throws UsageError for an id outside [0, vocab_size()).
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  /// Number of ids (the model's vocab_size must be at least this).
  virtual int64_t vocab_size() const = 0;
  /// The end-of-sequence id, when the vocabulary has one (bytes: none).
  virtual std::optional<int64_t> eos_id() const = 0;
  /// "bytes (256)" or "sentencepiece BPE 1000 (PATH)", for the log.
  virtual std::string describe() const = 0;
};

/// Whether this train_gpt was built with SentencePiece (libsentencepiece-dev found by CMake).
bool sentencepiece_available();

/// `path` empty: the byte tokenizer. Else the SentencePiece model `path`. Throws UsageError when the file
/// is missing or not a SentencePiece model, or when this build has no SentencePiece (naming the package).
/// Example: `auto tok = load_tokenizer(o.tokenizer); auto ids = tok->encode("héllo");`
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& path);

/// The model's vocab_size for `tok`: a byte-level shape (vocab_size 256: the GPT-2 presets) takes the
/// tokenizer's; an explicit one (`vocab_flag`: --vocab-size; or a preset's / --init-from's other than 256)
/// is kept when it is at least the tokenizer's (the extra rows are never targets: padding the vocabulary
/// to a multiple of 64 is common) and refused, naming both, when smaller. Throws UsageError.
/// Example: `cfg.vocab_size = apply_tokenizer_vocab(cfg.vocab_size, o.vocab_size, *tok);`
int64_t apply_tokenizer_vocab(int64_t preset_vocab, std::optional<int64_t> vocab_flag, const Tokenizer& tok);

}  // namespace train_gpt
