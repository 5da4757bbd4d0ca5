// Pre-tokenized data for train_gpt: token shards in llm.c's file format, memory-mapped, and the
// `train_gpt tokenize` subcommand that writes them.
//
// File format (llm.c's dev/data/data_common.py, so that its shards, e.g. FineWeb's, read as they are): a
// header of 256 little-endian int32 (magic, version, token count, zeros), then the tokens, flat little-endian:
//   magic 20240520, version 1: uint16 tokens (vocabularies up to 65536: llm.c's GPT-2 files and ours);
//   magic 20240801, version 7: uint32 tokens (larger vocabularies: llm.c's Llama 3 files).
// (nanoGPT's headerless .bin files are not read: without a header their dtype and length are a guess.)
//
// --data-shards DIR_OR_GLOB: the *.bin files of DIR (or the files the glob matches), in name order; those
// whose name starts with "val" or contains "_val_" (llm.c's naming, and `tokenize`'s) are the validation
// split, the others the training split. Each split is one token stream, the files concatenated in order,
// and its windows are the non-overlapping block_size + 1 token windows of that stream (as TokenWindows over
// text): a window may span the boundary between two files (a shard boundary is only a cut of the stream,
// as `tokenize` writes it, and llm.c's shards start every document with EOT). The files are mapped with
// mmap and never read into memory: a window is read (and converted to int64) when its batch is built.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data.h"
#include "tokenizer.h"

namespace train_gpt {

/// One or more llm.c token files mapped read-only, seen as one stream of tokens.
class TokenShards {
 public:
  /// Maps `files` (in this order). Throws UsageError naming a file that is missing, has no llm.c header,
  /// or whose size disagrees with its header's token count.
  explicit TokenShards(const std::vector<std::string>& files);
  ~TokenShards();
  TokenShards(const TokenShards&) = delete;
  TokenShards& operator=(const TokenShards&) = delete;
  /// Tokens in all files together.
  int64_t size() const { return total_; }
  /// Copies tokens [offset, offset + n) of the stream (across files) into `out`, as int64.
  void read(int64_t offset, int64_t n, int64_t* out) const;
  /// The file and the index within it of stream token `offset` (for error messages).
  std::pair<std::string, int64_t> locate(int64_t offset) const;
  const std::vector<std::string>& files() const { return files_; }

 private:
  struct Mapped {
    const uint8_t* base = nullptr;  // the whole file
    size_t bytes = 0;
    int64_t tokens = 0, start = 0;  // token count, first stream index
    int width = 2;                  // bytes per token
  };
  std::vector<std::string> files_;
  std::vector<Mapped> maps_;
  int64_t total_ = 0;
};

/// The windows of a TokenShards stream: window i is tokens [i * block_size, i * block_size + block_size + 1).
/// fill() throws UsageError for a token >= vocab_size (shards of another tokenizer), naming file and index.
class ShardWindows final : public WindowSource {
 public:
  ShardWindows(std::shared_ptr<const TokenShards> shards, int64_t block_size, int64_t vocab_size);
  int64_t size() const override;
  void fill(int64_t index, int64_t* x, int64_t* y) const override;

 private:
  std::shared_ptr<const TokenShards> shards_;
  int64_t block_size_, vocab_size_;
};

/// The training and validation files of --data-shards `spec` (a directory or a glob), split by name as
/// above, sorted. Throws UsageError when nothing matches or a split has no file.
struct ShardFiles {
  std::vector<std::string> train, val;
};
ShardFiles find_shard_files(const std::string& spec);

/// Writes `tokens` to `path` in llm.c's format (uint16 when every id fits, i.e. vocab_size <= 65536, else
/// uint32). Throws UsageError when the file cannot be written.
/// Example: `write_token_shard("out/train_000000.bin", ids, 1000);`
void write_token_shard(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size);

/// `train_gpt tokenize [--tokenizer M] --out DIR [--shard-tokens N] [--val-fraction F] FILES...`: encodes the
/// text FILES (default: the fortunes corpus) with the tokenizer (default: bytes), each file followed by the
/// EOS id when the tokenizer has one, and writes DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin of at most N
/// tokens each. The validation split is taken as train_gpt takes it from text: segments of 8192 tokens,
/// an evenly spread fraction F of them. `argv[0]` is "tokenize". Returns the exit code; throws UsageError.
int tokenize_main(int argc, char** argv);

}  // namespace train_gpt

namespace train_gpt {

/// The data of a run that is not byte-level text (prepare_run): --data-shards, --sft, or text (--data
/// files, or the default corpus when `text_files` is empty) encoded with a --tokenizer.
struct TokenizedData {
  TokenWindows train, val;
  std::string name;           ///< for the log
  int64_t bytes = 0;          ///< on disk (shards, JSONL) or of the text
  bool masked_targets = false;  ///< --sft: targets hold -100 (the loss is the mean over unmasked tokens)
};
/// Exactly one of `data_shards`, `sft`, `text_files` may be given (throws UsageError naming both otherwise).
/// Text is encoded whole and split as split_text splits bytes (segments of 8 windows). Throws UsageError.
TokenizedData load_tokenized_data(const std::string& data_shards, const std::string& sft,
                                  const std::vector<std::string>& text_files, const Tokenizer& tok,
                                  int64_t block_size, int64_t vocab_size, double val_fraction);

}  // namespace train_gpt
