#include "fsdp/consistency.h"

#include <map>
#include <sstream>

#include "fsdp/c10d/collectives.h"
#include "fsdp/fsdp_init.h"
#include "fsdp/fsdp_state.h"

namespace fsdp::detail {
namespace {

// FNV-1a over 64-bit words, kept non-negative so that it travels as an int64 in a SUM all-reduce of
// one-hot rows (every other rank contributes 0 to this rank's slot).
struct Hash {
  uint64_t h = 1469598103934665603ull;
  void add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  void add_bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h ^= b[i];
      h *= 1099511628211ull;
    }
  }
  int64_t value() const { return static_cast<int64_t>(h & 0x3fffffffffffffffull); }
};

// Every rank's `row` (same length on every rank), as a [world, row.size()] table: each rank writes
// its row into its own slot and a SUM all-reduce assembles the table. An all-reduce rather than an
// all-gather keeps the all-gather counts of the group those of FSDP2.
torch::Tensor exchange_rows(ProcessGroup& group, const std::vector<int64_t>& row) {
  const int64_t k = static_cast<int64_t>(row.size());
  auto table = torch::zeros({group.size(), k}, torch::kInt64);
  table[group.rank()].copy_(torch::tensor(row, torch::kInt64));
  auto dev = table.to(group.device());
  all_reduce(dev, group, ReduceOp::SUM);
  return dev.to(torch::kCPU);
}

// Parameters and buffers of `modules` outside the subtrees of already-sharded submodules (those were
// handled by their own fully_shard call), with module-relative names.
std::vector<std::pair<std::string, torch::Tensor>> own_buffers(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for_each_managed_module(modules, [&](size_t, const std::string& prefix, const std::string& path,
                                       torch::nn::Module& module) {
    for (const auto& b : module.named_buffers(/*recurse=*/false)) {
      if (b.value().defined()) out.emplace_back(prefix + (path.empty() ? b.key() : path + "." + b.key()), b.value());
    }
  });
  return out;
}

// Broadcasts `tensors` from group rank 0, one flat buffer (one broadcast) per dtype.
void broadcast_flat(const std::vector<torch::Tensor>& tensors, ProcessGroup& group) {
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& t : tensors) {
    if (t.numel() > 0) by_dtype[t.scalar_type()].push_back(t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, ts] : by_dtype) {
    std::vector<torch::Tensor> flat;
    for (const auto& t : ts) flat.push_back(t.detach().reshape({-1}).to(group.device()));
    auto buf = torch::cat(flat);
    broadcast(buf, 0, group);
    int64_t off = 0;
    for (auto& t : ts) {
      t.detach().copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

int64_t checksum(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kCPU).contiguous();
  Hash h;
  h.add(static_cast<uint64_t>(c.scalar_type()));
  for (auto d : c.sizes()) h.add(static_cast<uint64_t>(d));
  h.add_bytes(c.data_ptr(), c.nbytes());
  return h.value();
}

// One row per group, compared across ranks at the root's first forward. What every field decides:
// the sizes and dtypes of the group's all-gather and reduce-scatter (a difference makes Gloo abort the
// process from its own thread), or which groups exist (a difference pairs one group's collective with
// another's).
constexpr int64_t kRow = 10;
const char* const kFieldNames[kRow] = {
    "whether it holds parameters", "number of parameters",
    "all_gather_into_tensor elements per rank", "all-gather dtype",
    "reduce_scatter_tensor elements per rank (trainable parameters)", "reduce dtype",
    "shard group size", "replicate group size",
    "reshard_after_forward (0: false, 1: true, k: groups of k ranks)", "parameter shapes or requires_grad flags"};

std::vector<int64_t> layout_row(FSDPState& s) {
  std::vector<int64_t> row(kRow, 0);
  row[6] = s.mesh ? s.mesh->size(s.mesh->ndim() - 1) : 1;
  row[7] = s.mesh && s.mesh->ndim() == 2 ? s.mesh->size(0) : 1;
  row[8] = s.reshard_after_forward_k;
  if (!s.group) return row;
  const auto& params = s.group->params();
  row[0] = 1;
  row[1] = static_cast<int64_t>(params.size());
  Hash shapes;
  for (const auto& p : params) {
    row[2] += p.padded_numel();
    if (p.requires_grad()) row[4] += p.padded_numel();
    shapes.add(p.orig_size.size());
    for (auto d : p.orig_size) shapes.add(static_cast<uint64_t>(d));
    shapes.add(p.requires_grad() ? 1 : 0);
    shapes.add(static_cast<uint64_t>(p.shard_dim));
    for (const auto& [dt, n] : p.extension_layout) {  // an all-gather extension's pieces (its bytes on the wire)
      shapes.add(static_cast<uint64_t>(dt));
      shapes.add(static_cast<uint64_t>(n));
    }
  }
  row[3] = params.empty() ? -1 : static_cast<int64_t>(params[0].param_dtype);
  row[5] = static_cast<int64_t>(s.group->reduce_dtype());
  row[9] = shapes.value();
  return row;
}

std::string field_value(int64_t field, int64_t v) {
  if ((field == 3 || field == 5) && v >= 0) {
    std::ostringstream os;
    os << static_cast<c10::ScalarType>(v);
    return os.str();
  }
  if (field == 9) return "digest " + std::to_string(v);
  return std::to_string(v);
}

}  // namespace

void sync_before_sharding(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                          const std::vector<std::shared_ptr<torch::nn::Module>>& modules, const DeviceMeshPtr& mesh,
                          const FullyShardOptions& options, const std::string& module_name) {
  if (options.sync_module_states()) {
    // FSDP1's sync_module_states: rank 0's parameters and buffers everywhere, before sharding.
    ProcessGroup& world = *mesh->world();
    if (world.size() == 1) return;
    // Meta tensors (fsdp::deferred_init) have no values to send; materialize_module gives every rank the
    // same ones.
    std::vector<torch::Tensor> ts;
    for (const auto& [name, t] : params) {
      if (!t.is_meta()) ts.push_back(t);
    }
    for (const auto& [name, t] : own_buffers(modules)) {
      if (!t.is_meta()) ts.push_back(t);
    }
    broadcast_flat(ts, world);
    return;
  }
  if (!debug_mode()) return;
  // Debug mode: the ranks of a shard group each contribute their own rows of every parameter, so
  // they must start from the same full values (replicas are broadcast over the replicate dim later).
  ProcessGroup& shard = *mesh->get_group(mesh->ndim() - 1);
  if (shard.size() == 1 || params.empty()) return;
  std::vector<int64_t> row;
  for (const auto& [name, t] : params) row.push_back(t.is_meta() ? -1 : checksum(t));  // meta: deferred_init
  auto table = exchange_rows(shard, row);
  auto acc = table.accessor<int64_t, 2>();
  for (size_t i = 0; i < params.size(); ++i) {
    for (int r = 1; r < shard.size(); ++r) {
      if (acc[r][i] == acc[0][i]) continue;
      const auto& [name, t] = params[i];
      TORCH_CHECK(false, "fully_shard: parameter '", name, "' of ", module_name, " (shape ", t.sizes(),
                  ") differs between rank ", shard.global_ranks()[0], " and rank ", shard.global_ranks()[r],
                  " before sharding (FSDP_DEBUG checksum check; this is rank ", mesh->get_rank(),
                  "). Every rank of a shard group keeps its own rows of every parameter, so ranks that start from "
                  "different weights train a mixture of them. Fix: seed every rank's generator identically before "
                  "building the model (torch::manual_seed(seed) on every rank), load the same weights on every "
                  "rank, or pass FullyShardOptions().sync_module_states(true) to broadcast rank 0's parameters "
                  "and buffers");
    }
  }
}

void check_group_layout(FSDPState& root) {
  if (!root.mesh || !root.ctx) return;
  ProcessGroup& world = *root.mesh->world();
  if (world.size() == 1) return;
  const auto& states = root.ctx->states;
  std::vector<std::vector<int64_t>> rows;
  Hash digest;
  for (FSDPState* s : states) {
    rows.push_back(layout_row(*s));
    for (auto v : rows.back()) digest.add(static_cast<uint64_t>(v));
  }
  auto summary = exchange_rows(world, {static_cast<int64_t>(states.size()), digest.value()});
  bool same = true;
  int64_t max_states = 0;
  for (int r = 0; r < world.size(); ++r) {
    same = same && summary[r][0].item<int64_t>() == summary[0][0].item<int64_t>() &&
           summary[r][1].item<int64_t>() == summary[0][1].item<int64_t>();
    max_states = std::max(max_states, summary[r][0].item<int64_t>());
  }
  if (same) return;
  // Mismatch (every rank sees it): a second exchange of the full rows, padded to the largest
  // number of groups, to name the first difference.
  std::vector<int64_t> flat(max_states * kRow, -1);
  for (size_t i = 0; i < rows.size(); ++i) std::copy(rows[i].begin(), rows[i].end(), flat.begin() + i * kRow);
  auto table = exchange_rows(world, flat);
  auto acc = table.accessor<int64_t, 2>();
  auto local_name = [&](int64_t i) {
    return i < static_cast<int64_t>(states.size()) ? states[i]->name() : std::string("(none)");
  };
  std::ostringstream groups;
  bool same_count = true;
  for (int r = 0; r < world.size(); ++r) {
    groups << (r ? ", " : "") << "rank " << r << ": " << summary[r][0].item<int64_t>();
    same_count = same_count && summary[r][0].item<int64_t>() == summary[0][0].item<int64_t>();
  }
  for (int64_t i = 0; i < max_states; ++i) {
    for (int r = 1; r < world.size(); ++r) {
      for (int64_t f = 0; f < kRow; ++f) {
        int64_t a = acc[0][i * kRow + f], b = acc[r][i * kRow + f];
        if (a == b) continue;
        std::ostringstream what;
        if (f == 0 && (a == -1 || b == -1)) {
          what << "rank " << (a == -1 ? 0 : r) << " has no FSDP group #" << i;
        } else {
          what << "FSDP group #" << i << " (in pre-order under the root) has " << kFieldNames[f] << " "
               << field_value(f, a) << " on rank 0 but " << field_value(f, b) << " on rank " << r;
        }
        if (!same_count) what << " (FSDP groups per rank: " << groups.str() << ")";
        TORCH_CHECK(false, "fully_shard: the ranks disagree about the collectives of their FSDP groups, so the "
                    "all_gather_into_tensor/reduce_scatter_tensor of one rank would meet a different one on another "
                    "(which aborts the process inside Gloo): ", what.str(), ". On this rank (rank ", world.rank(),
                    ") group #", i, " is ", local_name(i), " and the root is ", root.module_type,
                    ". Every rank must build the same model (same parameter shapes), apply the same fully_shard "
                    "calls with the same options (ignored_params, mp_policy, reshard_after_forward, mesh) and "
                    "freeze the same parameters");
      }
    }
  }
}

}  // namespace fsdp::detail
