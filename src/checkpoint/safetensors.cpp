#include "checkpoint/safetensors.h"
#include "util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fsdp::dcp::detail {

static_assert(sizeof(void*) == 8, "libfsdp checkpoints need a 64-bit platform");

// ---------------------------------------------------------------------------------------------
// dtypes

namespace {

using fsdp::detail::numel_of;

struct DtypeName {
  torch::ScalarType dtype;
  const char* name;
};
constexpr std::array<DtypeName, 10> kDtypes{{
    {torch::kFloat64, "F64"},
    {torch::kFloat32, "F32"},
    {torch::kBFloat16, "BF16"},
    {torch::kFloat16, "F16"},
    {torch::kInt64, "I64"},
    {torch::kInt32, "I32"},
    {torch::kInt16, "I16"},
    {torch::kInt8, "I8"},
    {torch::kUInt8, "U8"},
    {torch::kBool, "BOOL"},
}};
}  // namespace

std::string dtype_name(torch::ScalarType dtype, const char* api, const std::string& fqn) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d.name;
  TORCH_CHECK(false, api, ": '", fqn, "' has dtype ", dtype,
              ", which safetensors cannot store. Fix: convert it (e.g. to a real dtype) or leave it out of the "
              "state dict");
}

std::optional<torch::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// CRC-32C

namespace {

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t crc32c_sw(uint32_t c, const uint8_t* p, size_t n) {
  static const auto table = make_table();
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
bool have_hw_crc() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (have_hw_crc()) return ~crc32c_hw(c, p, n);
#endif
  return ~crc32c_sw(c, p, n);
}

#if defined(__x86_64__)
namespace {
// Three blocks at once: the crc32 instruction has a latency of 3 cycles and a throughput of 1, so three
// independent chains run about three times as fast as one.
__attribute__((target("sse4.2"))) void crc32c_hw_x3(const uint8_t* p, size_t n, uint32_t out[3]) {
  uint64_t c0 = 0xffffffffu, c1 = 0xffffffffu, c2 = 0xffffffffu;
  const uint8_t *a = p, *b = p + n, *c = p + 2 * n;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint64_t x, y, z;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    std::memcpy(&z, c + i, 8);
    c0 = _mm_crc32_u64(c0, x);
    c1 = _mm_crc32_u64(c1, y);
    c2 = _mm_crc32_u64(c2, z);
  }
  uint32_t r[3] = {static_cast<uint32_t>(c0), static_cast<uint32_t>(c1), static_cast<uint32_t>(c2)};
  const size_t tail = n % 8;
  for (int k = 0; k < 3; ++k) {
    if (tail) r[k] = crc32c_hw(r[k], p + k * n + (n - tail), tail);
    out[k] = ~r[k];
  }
}
}  // namespace
#endif

std::vector<uint32_t> block_crcs(const void* data, size_t n, int64_t block_bytes) {
  TORCH_INTERNAL_ASSERT(block_bytes > 0);
  const size_t bb = static_cast<size_t>(block_bytes);
  std::vector<uint32_t> out;
  out.reserve((n + bb - 1) / bb);
  const auto* p = static_cast<const uint8_t*>(data);
  size_t off = 0;
#if defined(__x86_64__)
  if (have_hw_crc()) {
    for (; off + 3 * bb <= n; off += 3 * bb) {
      uint32_t r[3];
      crc32c_hw_x3(p + off, bb, r);
      out.insert(out.end(), r, r + 3);
    }
  }
#endif
  for (; off < n; off += bb) out.push_back(crc32c(0, p + off, std::min(bb, n - off)));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Files

std::string errno_text(int err) {
  std::string name;
  switch (err) {
    case ENOSPC: name = "ENOSPC"; break;
    case EDQUOT: name = "EDQUOT"; break;
    case ENOENT: name = "ENOENT"; break;
    case EACCES: name = "EACCES"; break;
    case EEXIST: name = "EEXIST"; break;
    case EIO: name = "EIO"; break;
    case EROFS: name = "EROFS"; break;
    default: name = "errno " + std::to_string(err);
  }
  return std::string(std::strerror(err)) + " (" + name + ")";
}

File::File(File&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)), api_(o.api_) {}
File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    api_ = o.api_;
  }
  return *this;
}
File::~File() { close(); }

void File::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

File File::open_read(const std::string& path, const char* api) {
  File f;
  f.path_ = path;
  f.api_ = api;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd_ >= 0, api, ": cannot open ", path, ": ", errno_text(errno));
  return f;
}

File File::create(const std::string& path, const char* api) {
  File f;
  f.path_ = path;
  f.api_ = api;
  f.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(f.fd_ >= 0, api, ": cannot create ", path, ": ", errno_text(errno));
  return f;
}

void File::pread_exact(void* buf, size_t n, int64_t offset, const std::string& what) const {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    size_t piece = std::min<size_t>(n - done, size_t(1) << 30);
    ssize_t r = ::pread(fd_, p + done, piece, offset + static_cast<int64_t>(done));
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r >= 0, api_, ": reading ", what, " from ", path_, " failed: ", errno_text(errno));
    TORCH_CHECK(r > 0, api_, ": ", path_, " is truncated: reading ", what, " needs bytes [", offset, ", ",
                offset + static_cast<int64_t>(n), ") but the file ends at byte ", offset + static_cast<int64_t>(done),
                ". The checkpoint is incomplete or was damaged; restore the file or use another checkpoint");
    done += static_cast<size_t>(r);
  }
}

void File::write_all(const void* buf, size_t n, const std::string& what) {
  const auto* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < n) {
    size_t piece = std::min<size_t>(n - done, size_t(64) << 20);
    ssize_t w = ::write(fd_, p + done, piece);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int err = errno;
      TORCH_CHECK(false, api_, ": writing ", what, " to ", path_, " failed after ", done, " of ", n,
                  " bytes: ", errno_text(err),
                  err == ENOSPC || err == EDQUOT ? ". The disk is full: free space or save elsewhere" : "");
    }
    done += static_cast<size_t>(w);
  }
}

void File::fsync() {
  int r;
  do {
    r = ::fsync(fd_);
  } while (r < 0 && errno == EINTR);
  TORCH_CHECK(r == 0, api_, ": fsync of ", path_, " failed: ", errno_text(errno),
              errno == ENOSPC ? ". The disk is full: free space or save elsewhere" : "");
}

void File::drop_cache() {
#ifdef POSIX_FADV_DONTNEED
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
#endif
}

int64_t File::size() const {
  struct stat st;
  TORCH_CHECK(::fstat(fd_, &st) == 0, api_, ": cannot stat ", path_, ": ", errno_text(errno));
  return static_cast<int64_t>(st.st_size);
}

void fsync_dir(const std::string& path, const char* api) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, api, ": cannot open folder ", path, " to fsync it: ", errno_text(errno));
  int r;
  do {
    r = ::fsync(fd);
  } while (r < 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  TORCH_CHECK(r == 0, api, ": fsync of folder ", path, " failed: ", errno_text(err));
}

std::string random_nonce(size_t n) {
  static std::mutex mu;
  static std::mt19937_64 gen(std::random_device{}() ^
                             static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                             static_cast<uint64_t>(::getpid()));
  static const char* hex = "0123456789abcdef";
  std::lock_guard<std::mutex> lock(mu);
  std::string s;
  for (size_t i = 0; i < n; ++i) s.push_back(hex[gen() & 15]);
  return s;
}

void write_file_atomic(const std::string& path, const std::string& content, bool do_fsync, const char* api) {
  std::string tmp = path + ".tmp-" + random_nonce(8);
  try {
    File f = File::create(tmp, api);
    f.write_all(content.data(), content.size(), "the contents");
    if (do_fsync) f.fsync();
    f.close();
    TORCH_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, api, ": renaming ", tmp, " to ", path,
                " failed: ", errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (do_fsync) {
    auto slash = path.find_last_of('/');
    fsync_dir(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)), api);
  }
}

std::string read_small_file(const std::string& path, const char* api) {
  File f = File::open_read(path, api);
  int64_t n = f.size();
  std::string s(static_cast<size_t>(n), '\0');
  if (n > 0) f.pread_exact(s.data(), static_cast<size_t>(n), 0, "its contents");
  return s;
}

// ---------------------------------------------------------------------------------------------
// Headers

int64_t WriteEntry::nbytes() const { return numel_of(shape) * static_cast<int64_t>(c10::elementSize(dtype)); }

namespace {

/// The header length and the JSON after it (h.raw, h.data_start).
nlohmann::json read_header_json(const File& file, int64_t file_size, const char* api, Header& h) {
  const std::string& path = file.path();
  TORCH_CHECK(file_size >= 8, api, ": ", path, " is truncated: ", file_size,
              " bytes, fewer than the 8-byte header length of a safetensors file");
  uint64_t n = 0;
  unsigned char len[8];
  file.pread_exact(len, 8, 0, "the header length");
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];  // little-endian
  TORCH_CHECK(n <= (uint64_t(100) << 20), api, ": ", path, " is not a safetensors file: header length ", n,
              " exceeds 100 MiB");
  TORCH_CHECK(static_cast<int64_t>(8 + n) <= file_size, api, ": ", path, " is truncated: its header needs ", 8 + n,
              " bytes but the file has ", file_size);
  h.raw.resize(8 + n);
  std::memcpy(h.raw.data(), len, 8);
  file.pread_exact(h.raw.data() + 8, n, 8, "the header");
  h.data_start = static_cast<int64_t>(8 + n);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(h.raw.begin() + 8, h.raw.end());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, api, ": ", path, " has a malformed safetensors header (not JSON: ", e.what(), ")");
  }
  TORCH_CHECK(j.is_object(), api, ": ", path, " has a malformed safetensors header (not a JSON object)");
  return j;
}

/// "__metadata__" into h.metadata (and h.has_sharding_info); returns DCP_SHARDING_INFO parsed (null if none).
nlohmann::json read_metadata(const nlohmann::json& j, const std::string& path, const char* api, Header& h) {
  h.metadata = nlohmann::json::object();
  nlohmann::json sharding;
  if (!j.contains("__metadata__")) return sharding;
  h.metadata = j["__metadata__"];
  TORCH_CHECK(h.metadata.is_object(), api, ": ", path, ": __metadata__ is not an object");
  if (h.metadata.contains("DCP_SHARDING_INFO")) {
    const auto& s = h.metadata["DCP_SHARDING_INFO"];
    TORCH_CHECK(s.is_string(), api, ": ", path, ": DCP_SHARDING_INFO is not a string");
    try {
      sharding = nlohmann::json::parse(s.get<std::string>());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, api, ": ", path, ": DCP_SHARDING_INFO is not valid JSON: ", e.what());
    }
    // PyTorch treats an empty value as absent.
    h.has_sharding_info = !s.get<std::string>().empty();
  }
  return sharding;
}

/// One tensor's header entry: dtype, shape, data_offsets that match the shape's byte count, and its
/// DCP_SHARDING_INFO offsets when the file has them (`sharding` non-null).
HeaderEntry read_entry(const std::string& name, const nlohmann::json& v, const nlohmann::json* sharding,
                       const std::string& path, const char* api) {
  HeaderEntry e;
  e.name = name;
  try {
    auto dt = dtype_from_name(v.at("dtype").get<std::string>());
    TORCH_CHECK(dt, api, ": ", path, ": tensor '", e.name, "' has dtype ", v.at("dtype").get<std::string>(),
                ", which libfsdp does not read (expected one of F64 F32 BF16 F16 I64 I32 I16 I8 U8 BOOL)");
    e.dtype = *dt;
    e.shape = v.at("shape").get<std::vector<int64_t>>();
    auto offs = v.at("data_offsets").get<std::vector<int64_t>>();
    TORCH_CHECK(offs.size() == 2, api, ": ", path, ": tensor '", e.name, "' has malformed data_offsets");
    e.begin = offs[0];
    e.end = offs[1];
  } catch (const nlohmann::json::exception& ex) {
    TORCH_CHECK(false, api, ": ", path, ": tensor '", e.name, "' has a malformed header entry: ", ex.what());
  }
  for (auto s : e.shape) TORCH_CHECK(s >= 0, api, ": ", path, ": tensor '", e.name, "' has a negative size");
  int64_t expect = numel_of(e.shape) * static_cast<int64_t>(c10::elementSize(e.dtype));
  TORCH_CHECK(e.begin >= 0 && e.end - e.begin == expect, api, ": ", path, ": tensor '", e.name,
              "' has data_offsets [", e.begin, ", ", e.end, ") for ", expect, " bytes of shape ",
              c10::IntArrayRef(e.shape));
  if (!sharding) return e;
  TORCH_CHECK(sharding->is_object() && sharding->contains(e.name), api, ": ", path, ": tensor '", e.name,
              "' has no entry in DCP_SHARDING_INFO");
  try {
    e.saved_offsets = (*sharding)[e.name].at("saved_offsets").get<std::vector<int64_t>>();
  } catch (const nlohmann::json::exception& ex) {
    TORCH_CHECK(false, api, ": ", path, ": DCP_SHARDING_INFO of '", e.name, "' is malformed: ", ex.what());
  }
  TORCH_CHECK(e.saved_offsets->size() == e.shape.size(), api, ": ", path, ": DCP_SHARDING_INFO of '", e.name,
              "' has ", e.saved_offsets->size(), " offsets for a ", e.shape.size(), "-D tensor");
  for (auto o : *e.saved_offsets)
    TORCH_CHECK(o >= 0, api, ": ", path, ": DCP_SHARDING_INFO of '", e.name, "' has a negative offset");
  return e;
}

/// Sorts h.entries by offset, checks that they tile the data buffer and that the file ends with it
/// (h.data_bytes).
void check_layout(Header& h, int64_t file_size, const std::string& path, const char* api) {
  std::sort(h.entries.begin(), h.entries.end(),
            [](const HeaderEntry& a, const HeaderEntry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  int64_t pos = 0;
  for (const auto& e : h.entries) {
    TORCH_CHECK(e.begin == pos, api, ": ", path, ": tensor '", e.name, "' starts at data byte ", e.begin,
                " but the previous tensor ends at ", pos, " (data_offsets must tile the data buffer)");
    pos = e.end;
  }
  h.data_bytes = pos;
  const int64_t expect_size = h.data_start + h.data_bytes;
  if (file_size < expect_size) {
    std::string victim;
    for (const auto& e : h.entries)
      if (h.data_start + e.end > file_size) {
        victim = e.name;
        break;
      }
    TORCH_CHECK(false, api, ": ", path, " is truncated: its header describes ", expect_size, " bytes but the file has ",
                file_size, " (tensor '", victim, "' is cut off). The checkpoint is incomplete or was damaged; "
                "restore the file or use another checkpoint");
  }
  TORCH_CHECK(file_size == expect_size, api, ": ", path, " has ", file_size - expect_size,
              " bytes past the data its header describes (", expect_size, " bytes): not a valid safetensors file");
}

}  // namespace

Header read_header(const File& file, int64_t file_size, const char* api) {
  Header h;
  const nlohmann::json j = read_header_json(file, file_size, api, h);
  const nlohmann::json sharding = read_metadata(j, file.path(), api, h);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    h.entries.push_back(read_entry(it.key(), it.value(), h.has_sharding_info ? &sharding : nullptr, file.path(), api));
  }
  check_layout(h, file_size, file.path(), api);
  return h;
}

std::string build_header(const std::vector<WriteEntry>& entries, bool sharding_info, const Metadata* metadata) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (sharding_info) {
    nlohmann::ordered_json info = nlohmann::ordered_json::object();
    for (const auto& e : entries) {
      TORCH_INTERNAL_ASSERT(e.saved_offsets, "saved_offsets missing for ", e.name);
      info[e.name] = {{"saved_offsets", *e.saved_offsets}};
    }
    j["__metadata__"] = {{"DCP_SHARDING_INFO", info.dump()}, {"DCP_VERSION", "1.0"}, {"format", "pt"}};
  } else if (!metadata) {
    j["__metadata__"] = {{"format", "pt"}};
  } else if (!metadata->empty()) {
    j["__metadata__"] = *metadata;
  }
  int64_t pos = 0;
  for (const auto& e : entries) {
    int64_t n = e.nbytes();
    j[e.name] = {{"dtype", dtype_name(e.dtype, "safetensors", e.name)}, {"shape", e.shape}, {"data_offsets", {pos, pos + n}}};
    pos += n;
  }
  std::string body = j.dump();
  while (body.size() % 8 != 0) body.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = body.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

FileRecord write_safetensors(const std::string& path, const std::vector<WriteEntry>& entries,
                             const std::function<torch::Tensor(size_t)>& data, bool sharding_info,
                             int64_t block_bytes, bool do_fsync, const char* api, const Metadata* metadata) {
  FileRecord rec;
  auto slash = path.find_last_of('/');
  rec.name = slash == std::string::npos ? path : path.substr(slash + 1);
  std::string header = build_header(entries, sharding_info, metadata);
  File f = File::create(path, api);
  f.write_all(header.data(), header.size(), "the header");
  rec.header_crc = crc32c(0, header.data(), header.size());
  int64_t written = static_cast<int64_t>(header.size());
  fault_point({"write", path, written});
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    torch::Tensor t = data(i);
    TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == e.dtype &&
                              t.numel() * static_cast<int64_t>(t.element_size()) == e.nbytes(),
                          "write_safetensors: data of ", e.name, " does not match its entry");
    const size_t n = static_cast<size_t>(e.nbytes());
    const auto* p = n ? static_cast<const char*>(t.data_ptr()) : nullptr;
    // In pieces of whole checksum blocks: each piece is checksummed, then written while still in cache.
    const size_t piece = static_cast<size_t>(std::max<int64_t>(1, (int64_t(8) << 20) / block_bytes) * block_bytes);
    rec.tensor_crcs.emplace_back();
    for (size_t off = 0; off < n; off += piece) {
      const size_t len = std::min(piece, n - off);
      auto crcs = block_crcs(p + off, len, block_bytes);
      rec.tensor_crcs.back().insert(rec.tensor_crcs.back().end(), crcs.begin(), crcs.end());
      f.write_all(p + off, len, "'" + e.name + "'");
    }
    written += static_cast<int64_t>(n);
    fault_point({"write", path, written});
  }
  if (do_fsync) f.fsync();
  rec.bytes = written;
  return rec;
}

// ---------------------------------------------------------------------------------------------
// Fault hook

namespace {
std::mutex& hook_mu() {
  static std::mutex mu;
  return mu;
}
FaultHook& hook() {
  static FaultHook h;
  return h;
}
}  // namespace

void set_fault_hook(FaultHook h) {
  std::lock_guard<std::mutex> lock(hook_mu());
  hook() = std::move(h);
}

void fault_point(const FaultPoint& point) {
  FaultHook h;
  {
    std::lock_guard<std::mutex> lock(hook_mu());
    h = hook();
  }
  if (h) h(point);
}

}  // namespace fsdp::dcp::detail
