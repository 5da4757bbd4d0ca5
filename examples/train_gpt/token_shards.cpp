#include "token_shards.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>

namespace train_gpt {
namespace fs = std::filesystem;

namespace {

constexpr int32_t kMagic16 = 20240520, kVersion16 = 1;  // llm.c "gpt-2": uint16 tokens
constexpr int32_t kMagic32 = 20240801, kVersion32 = 7;  // llm.c "llama-3": uint32 tokens
constexpr size_t kHeaderBytes = 256 * sizeof(int32_t);

bool is_val_name(const std::string& name) { return name.rfind("val", 0) == 0 || name.find("_val_") != std::string::npos; }

}  // namespace

TokenShards::TokenShards(const std::vector<std::string>& files) : files_(files) {
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw UsageError("token shard " + f + " cannot be opened: " + std::strerror(errno));
    struct stat st {};
    ::fstat(fd, &st);
    Mapped m;
    m.bytes = static_cast<size_t>(st.st_size);
    if (m.bytes < kHeaderBytes) {
      ::close(fd);
      throw UsageError("token shard " + f + " has " + std::to_string(m.bytes) + " bytes, less than llm.c's 1024-byte "
                       "header. Fix: shards written by `train_gpt tokenize` or llm.c's dev/data scripts");
    }
    void* p = ::mmap(nullptr, m.bytes, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) throw UsageError("token shard " + f + " cannot be mapped: " + std::strerror(errno));
    m.base = static_cast<const uint8_t*>(p);
    maps_.push_back(m);  // unmapped by the destructor from now on, also if the checks below throw
    int32_t h[3];
    std::memcpy(h, m.base, sizeof h);  // little-endian (x86, ARM): as llm.c writes it
    if (!((h[0] == kMagic16 && h[1] == kVersion16) || (h[0] == kMagic32 && h[1] == kVersion32))) {
      throw UsageError("token shard " + f + " has no llm.c header (magic " + std::to_string(h[0]) + ", version " +
                       std::to_string(h[1]) + "; expected 20240520/1 for uint16 or 20240801/7 for uint32 tokens). "
                       "Fix: shards written by `train_gpt tokenize` or llm.c's dev/data scripts (nanoGPT's "
                       "headerless .bin files are not read)");
    }
    auto& mm = maps_.back();
    mm.width = h[0] == kMagic16 ? 2 : 4;
    mm.tokens = h[2];
    if (h[2] < 0 || kHeaderBytes + static_cast<size_t>(h[2]) * mm.width != m.bytes) {
      throw UsageError("token shard " + f + ": its header says " + std::to_string(h[2]) + " tokens of " +
                       std::to_string(mm.width) + " bytes, but the file has " + std::to_string(m.bytes - kHeaderBytes) +
                       " bytes after the header (truncated or overwritten?). Fix: write it again");
    }
    mm.start = total_;
    total_ += mm.tokens;
  }
}

TokenShards::~TokenShards() {
  for (const auto& m : maps_) ::munmap(const_cast<uint8_t*>(m.base), m.bytes);
}

void TokenShards::read(int64_t offset, int64_t n, int64_t* out) const {
  TORCH_CHECK(offset >= 0 && n >= 0 && offset + n <= total_, "TokenShards: tokens [", offset, ", ", offset + n,
              ") outside the ", total_, " tokens");
  // The file holding `offset`: the last one starting at or before it (files with no tokens are skipped).
  auto it = std::upper_bound(maps_.begin(), maps_.end(), offset, [](int64_t o, const Mapped& m) { return o < m.start; });
  size_t f = static_cast<size_t>(it - maps_.begin()) - 1;
  while (n > 0) {
    const Mapped& m = maps_[f];
    const int64_t at = offset - m.start, take = std::min(n, m.tokens - at);
    const uint8_t* p = m.base + kHeaderBytes + at * m.width;
    if (m.width == 2) {
      for (int64_t i = 0; i < take; ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = v;
      }
    } else {
      for (int64_t i = 0; i < take; ++i) {
        uint32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = v;
      }
    }
    out += take;
    offset += take;
    n -= take;
    ++f;
  }
}

std::pair<std::string, int64_t> TokenShards::locate(int64_t offset) const {
  for (size_t f = 0; f < maps_.size(); ++f) {
    if (offset < maps_[f].start + maps_[f].tokens) return {files_[f], offset - maps_[f].start};
  }
  return {"", -1};
}

ShardWindows::ShardWindows(std::shared_ptr<const TokenShards> shards, int64_t block_size, int64_t vocab_size)
    : shards_(std::move(shards)), block_size_(block_size), vocab_size_(vocab_size) {}

int64_t ShardWindows::size() const { return shards_->size() > 0 ? (shards_->size() - 1) / block_size_ : 0; }

void ShardWindows::fill(int64_t index, int64_t* x, int64_t* y) const {
  const int64_t T = block_size_;
  std::vector<int64_t> w(T + 1);
  shards_->read(index * T, T + 1, w.data());
  for (int64_t i = 0; i <= T; ++i) {
    if (w[i] >= vocab_size_) {
      const auto [file, at] = shards_->locate(index * T + i);
      throw UsageError("token " + std::to_string(w[i]) + " at index " + std::to_string(at) + " of " + file +
                       " is outside the model's vocabulary of " + std::to_string(vocab_size_) +
                       ": the shards were written with another tokenizer. Fix: --tokenizer the model they were "
                       "written with (or --vocab-size)");
    }
  }
  std::copy(w.begin(), w.begin() + T, x);
  std::copy(w.begin() + 1, w.end(), y);
}

ShardFiles find_shard_files(const std::string& spec) {
  std::vector<std::string> all;
  std::error_code ec;
  if (fs::is_directory(spec, ec)) {
    for (const auto& e : fs::directory_iterator(spec, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".bin") all.push_back(e.path().string());
    }
  } else {
    glob_t g{};
    if (::glob(spec.c_str(), 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) all.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
  }
  std::sort(all.begin(), all.end());
  ShardFiles out;
  for (const auto& f : all) (is_val_name(fs::path(f).filename().string()) ? out.val : out.train).push_back(f);
  if (all.empty()) {
    throw UsageError("--data-shards " + spec + " matches no token file (a directory of *.bin files, or a glob). Fix: "
                     "write them with `train_gpt tokenize --out DIR FILES...`");
  }
  if (out.train.empty() || out.val.empty()) {
    throw UsageError("--data-shards " + spec + " has no " + (out.train.empty() ? "training" : "validation") +
                     " file: the validation files are those named val* or *_val_*, the others train. Fix: "
                     "`train_gpt tokenize` writes both (train_NNNNNN.bin, val_NNNNNN.bin)");
  }
  return out;
}

void write_token_shard(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size) {
  TORCH_CHECK(tokens.size() < (1ull << 31), "write_token_shard: llm.c's header counts tokens in an int32");
  const bool narrow = vocab_size <= 65536;
  int32_t header[256] = {};
  header[0] = narrow ? kMagic16 : kMagic32;
  header[1] = narrow ? kVersion16 : kVersion32;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  if (narrow) {
    std::vector<uint16_t> v(tokens.begin(), tokens.end());
    out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 2));
  } else {
    std::vector<uint32_t> v(tokens.begin(), tokens.end());
    out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  }
  out.close();
  if (!out) throw UsageError("tokenize: " + path + " cannot be written");
}

int tokenize_main(int argc, char** argv) {
  std::string tokenizer, out_dir;
  int64_t shard_tokens = 100'000'000;  // llm.c's FineWeb shards: 1e8 tokens
  double val_fraction = 0.1;
  std::vector<std::string> files;
  CLI::App app("train_gpt tokenize: text files -> llm.c token shards (train_NNNNNN.bin, val_NNNNNN.bin) for "
               "train_gpt --data-shards DIR", "train_gpt tokenize");
  app.add_option("--tokenizer", tokenizer, "SentencePiece .model (Default: byte-level tokens)");
  std::string decode;
  app.add_option("--out", out_dir, "Output directory");
  app.add_option("--decode", decode, "Instead: print the text of this token file, decoded with --tokenizer, to stdout "
                 "(to read a shard; the test of id parity with Python's sentencepiece decodes through it)");
  app.add_option("--shard-tokens", shard_tokens, "Tokens per file at most")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  app.add_option("--val-fraction", val_fraction, "Fraction of the tokens in the validation files")
      ->capture_default_str()->check(CLI::Range(0.001, 0.5));
  app.add_option("files", files, std::string("Text files (Default: the fortunes in ") + kDefaultCorpusDir + ")");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    throw UsageError(std::string("tokenize: ") + e.what());
  }
  const auto tok = load_tokenizer(tokenizer);
  if (!decode.empty()) {
    TokenShards shard({decode});
    std::vector<int64_t> ids(static_cast<size_t>(shard.size()));
    shard.read(0, shard.size(), ids.data());
    std::cout << tok->decode(ids) << std::flush;
    return 0;
  }
  if (out_dir.empty()) throw UsageError("tokenize: --out DIR is required (or --decode FILE.bin)");
  const Corpus corpus = files.empty() ? load_default_corpus() : load_corpus(files);
  // One document per file, each followed by EOS (when the tokenizer has one): the model sees where one
  // text ends, as llm.c's EOT does. The default corpus is one text.
  std::vector<int64_t> ids;
  const std::vector<std::string> texts = files.empty() ? std::vector<std::string>{corpus.text} : [&] {
    std::vector<std::string> t;
    for (const auto& f : files) t.push_back(load_corpus({f}).text);
    return t;
  }();
  for (const auto& text : texts) {
    const auto e = tok->encode(text);
    ids.insert(ids.end(), e.begin(), e.end());
    if (tok->eos_id()) ids.push_back(*tok->eos_id());
  }
  // Segments of 8192 tokens, segment i to validation when floor((i + 1) f) > floor(i f) (split_text's rule).
  std::vector<int64_t> train, val;
  constexpr int64_t kSegment = 8192;
  const auto n = static_cast<int64_t>(ids.size());
  for (int64_t i = 0; i * kSegment < n; ++i) {
    auto& dst = std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction) ? val : train;
    dst.insert(dst.end(), ids.begin() + i * kSegment, ids.begin() + std::min(n, (i + 1) * kSegment));
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (!fs::is_directory(out_dir)) throw UsageError("tokenize: --out " + out_dir + " cannot be created: " + ec.message());
  int64_t written = 0;
  for (const auto& [name, stream] : {std::pair<const char*, const std::vector<int64_t>*>{"train", &train}, {"val", &val}}) {
    for (int64_t k = 0; k == 0 || k * shard_tokens < static_cast<int64_t>(stream->size()); ++k) {
      const auto b = stream->begin() + std::min<int64_t>(k * shard_tokens, stream->size());
      const auto e = stream->begin() + std::min<int64_t>((k + 1) * shard_tokens, stream->size());
      char file[32];
      std::snprintf(file, sizeof file, "%s_%06lld.bin", name, static_cast<long long>(k));
      write_token_shard((fs::path(out_dir) / file).string(), std::vector<int64_t>(b, e), tok->vocab_size());
      ++written;
    }
  }
  std::cout << "tokenize: " << corpus.name << ", " << corpus.text.size() << " bytes -> " << n << " tokens ("
            << tok->describe() << "): " << train.size() << " train, " << val.size() << " val, in " << written
            << " files in " << out_dir << std::endl;
  return 0;
}

}  // namespace train_gpt

#include "sft.h"

namespace train_gpt {

TokenizedData load_tokenized_data(const std::string& data_shards, const std::string& sft,
                                  const std::vector<std::string>& text_files, const Tokenizer& tok,
                                  int64_t block_size, int64_t vocab_size, double val_fraction) {
  const std::vector<std::pair<std::string, bool>> given{
      {"--data-shards", !data_shards.empty()}, {"--sft", !sft.empty()}, {"--data", !text_files.empty()}};
  std::string first;
  for (const auto& [flag, on] : given) {
    if (!on) continue;
    if (!first.empty()) {
      throw UsageError(first + " and " + flag + " are two sources of training data; a run reads one. Fix: drop one");
    }
    first = flag;
  }
  const int64_t T = block_size;
  if (!data_shards.empty()) {
    const ShardFiles files = find_shard_files(data_shards);
    auto train = std::make_shared<TokenShards>(files.train);
    auto val = std::make_shared<TokenShards>(files.val);
    int64_t bytes = 0;
    for (const auto* list : {&files.train, &files.val}) {
      for (const auto& f : *list) bytes += static_cast<int64_t>(fs::file_size(f));
    }
    TokenizedData d{TokenWindows(std::make_shared<ShardWindows>(train, T, vocab_size), T),
                    TokenWindows(std::make_shared<ShardWindows>(val, T, vocab_size), T),
                    "token shards " + data_shards + " (" + std::to_string(files.train.size()) + " train files, " +
                        std::to_string(train->size()) + " tokens; " + std::to_string(files.val.size()) +
                        " val files, " + std::to_string(val->size()) + " tokens; memory-mapped)",
                    bytes};
    return d;
  }
  if (!sft.empty()) {
    SftData s = load_sft(sft, tok, T, val_fraction);
    std::error_code ec;
    return {TokenWindows(s.train, T), TokenWindows(s.val, T), s.name + ", " + tok.describe(),
            static_cast<int64_t>(fs::file_size(sft, ec)), true};
  }
  const Corpus corpus = text_files.empty() ? load_default_corpus() : load_corpus(text_files);
  const auto ids = tok.encode(corpus.text);
  // The byte path's split (split_text), on tokens: segments of 8 windows alternate between the splits.
  std::vector<int64_t> train, val;
  const int64_t seg = 8 * (T + 1), n = static_cast<int64_t>(ids.size());
  for (int64_t i = 0; i * seg < n; ++i) {
    auto& dst = std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction) ? val : train;
    dst.insert(dst.end(), ids.begin() + i * seg, ids.begin() + std::min(n, (i + 1) * seg));
  }
  auto tensor = [](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong); };
  return {TokenWindows(tensor(train), T), TokenWindows(tensor(val), T),
          corpus.name + ", " + std::to_string(n) + " tokens (" + tok.describe() + ")",
          static_cast<int64_t>(corpus.text.size())};
}

}  // namespace train_gpt
