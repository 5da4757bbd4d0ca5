// --ft-*: see fault_tolerance.h.
#include "fault_tolerance.h"

#include <cstdlib>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "reporting.h"

namespace train_gpt {

std::unique_ptr<fsdp::ft::Manager> make_ft_manager(const Options& o, const fsdp::ProcessGroupPtr& pg, int64_t initial_step,
                                                   std::function<fsdp::StateDict()> state_dict,
                                                   std::function<void(const fsdp::StateDict&)> load_state_dict) {
  std::string where = o.ft_lighthouse;
  if (where.empty()) {
    const char* env = std::getenv("TORCHFT_LIGHTHOUSE");
    where = env ? env : "";
  }
  if (where.rfind("http://", 0) == 0) where = where.substr(7);  // TorchFT's form of the variable
  const auto colon = where.rfind(':');
  if (where.empty() || colon == std::string::npos || colon == 0 || colon + 1 == where.size()) {
    throw UsageError("--ft-replica-id needs the lighthouse's address: --ft-lighthouse HOST:PORT or TORCHFT_LIGHTHOUSE "
                     "(got '" + where + "'). Fix: start fsdp_lighthouse --port PORT and pass its HOST:PORT");
  }
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(std::stoi(where.substr(colon + 1)));
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.ft_quorum_timeout * 1000));
  fsdp::ft::ManagerOptions mo;
  mo.store = c10::make_intrusive<c10d::TCPStore>(where.substr(0, colon), so);
  mo.replica_group = pg;
  mo.replica_id = o.ft_replica_id;
  mo.num_replica_groups = o.ft_group_size;
  mo.min_replica_size = o.ft_min_replica_size > 0 ? o.ft_min_replica_size : o.ft_group_size;
  mo.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.ft_join_timeout * 1000));
  mo.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.ft_timeout * 1000));
  mo.quorum_timeout = so.timeout;
  mo.initial_step = initial_step;
  mo.state_dict = std::move(state_dict);
  mo.load_state_dict = std::move(load_state_dict);
  return std::make_unique<fsdp::ft::Manager>(std::move(mo));
}

void average_over_replica_groups(fsdp::ft::Manager& ft, const std::vector<torch::Tensor>& params,
                                 const torch::Tensor& loss_sum) {
  std::vector<torch::Tensor> tensors;
  for (const auto& p : params) {
    if (p.grad().defined()) tensors.push_back(p.grad());
  }
  tensors.push_back(loss_sum);
  ft.allreduce(tensors);
}

std::string describe_heal(const fsdp::ft::QuorumInfo& q) {
  std::string joiners;
  for (int r : q.joiners) joiners += (joiners.empty() ? "" : ", ") + std::to_string(r);
  return "ft: round " + std::to_string(q.round) + " healed replica group(s) " + joiners + " from replica group " +
         std::to_string(q.donor) + " at step " + std::to_string(q.step) + ": " +
         fmt("%.2f", static_cast<double>(q.heal_bytes) / (1 << 20)) + " MiB in " + fmt("%.3f", q.heal_seconds) +
         " s (this rank)";
}

}  // namespace train_gpt
