// Debug mode's fingerprints of collectives (see fingerprint.h).
#include "c10d/fingerprint.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/flight_recorder.h"

namespace fsdp::detail {
namespace {

// What the ranks compare in debug mode: one fixed-size int64 row per collective.
// [seq, op, arg (reduce op or root), in dtype, in ndim, in dims x8, out dtype, out ndim, out dims x8]
constexpr int64_t kMaxDims = 8;
constexpr int64_t kFingerprint = 3 + 2 * (2 + kMaxDims);
const std::vector<std::string> kOps = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast",
                                       "barrier"};

void encode_tensor(std::vector<int64_t>& row, const torch::Tensor* t) {
  row.push_back(t ? static_cast<int64_t>(t->scalar_type()) : -1);
  row.push_back(t ? t->dim() : -1);
  for (int64_t d = 0; d < kMaxDims; ++d) row.push_back(t && d < t->dim() ? t->size(d) : -1);
}

std::string decode_tensor(const int64_t* f) {
  if (f[0] < 0) return "";
  std::ostringstream os;
  os << "[";
  for (int64_t d = 0; d < f[1] && d < kMaxDims; ++d) os << (d ? ", " : "") << f[2 + d];
  os << "] " << static_cast<c10::ScalarType>(f[0]);
  return os.str();
}

// The name of a ReduceOp as the user wrote it (the fingerprint stores its enum value).
const char* reduce_op_name(int64_t op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::PRODUCT: return "PRODUCT";
  }
  return "?";
}

std::string decode(const int64_t* f) {
  std::ostringstream os;
  int64_t op = f[1];
  os << (op >= 0 && op < static_cast<int64_t>(kOps.size()) ? kOps[op] : "?") << " #" << f[0] << "(";
  std::string in = decode_tensor(f + 3), out = decode_tensor(f + 3 + 2 + kMaxDims);
  os << (in.empty() ? "" : "input " + in) << (out.empty() ? "" : ", output " + out);
  if (op == 1 || op == 2) os << ", reduce op " << reduce_op_name(f[2]);
  if (op == 3) os << ", src " << f[2];
  os << ")";
  return os.str();
}

}  // namespace

void check_fingerprint(ProcessGroup& group, const std::string& op, uint64_t seq, int64_t arg,
                       const torch::Tensor* in, const torch::Tensor* out) {
  std::vector<int64_t> row{static_cast<int64_t>(seq),
                           std::find(kOps.begin(), kOps.end(), op) - kOps.begin(), arg};
  encode_tensor(row, in);
  encode_tensor(row, out);
  auto mine = torch::tensor(row, torch::kInt64);
  auto all = torch::empty({group.size() * kFingerprint}, torch::kInt64);
  try {
    group.debug_backend()->_allgather_base(all, mine, c10d::AllgatherOptions())->wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "FSDP_DEBUG: the fingerprint exchange before ", op, " #", seq, " on ", group.str(),
                " failed (a rank did not reach this collective within the timeout?): ", e.what_without_backtrace());
  }
  const int64_t* t = all.data_ptr<int64_t>();
  static const char* fields[] = {"sequence number", "op", "reduce op / root", "input dtype", "input shape",
                                 "output dtype", "output shape"};
  for (int r = 1; r < group.size(); ++r) {
    const int64_t* a = t;
    const int64_t* b = t + r * kFingerprint;
    for (int64_t i = 0; i < kFingerprint; ++i) {
      if (a[i] == b[i]) continue;
      int field = i < 3 ? static_cast<int>(i)
                  : i == 3 ? 3
                  : i < 3 + 2 + kMaxDims ? 4
                  : i == 3 + 2 + kMaxDims ? 5
                                          : 6;
      group.flight_recorder().failed(seq, "fingerprint mismatch");
      TORCH_CHECK(false, "FSDP_DEBUG: collective mismatch on ", group.str(), ": rank 0 calls ", decode(a), " but rank ",
                  r, " calls ", decode(b), " (", fields[field], " differs). Every rank must issue the same ",
                  "collectives in the same order with the same shapes and dtypes");
    }
  }
}

}  // namespace fsdp::detail
