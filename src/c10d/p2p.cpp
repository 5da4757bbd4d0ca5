// Point-to-point sends and receives (fsdp/c10d/p2p.h).
#include "fsdp/c10d/p2p.h"

#include <vector>

namespace fsdp {
namespace {

std::string p2p_desc(const char* op, const char* dir, int peer, const ProcessGroup& group, int tag,
                     const torch::Tensor& t, const std::string& what) {
  std::string s = std::string(op) + (what.empty() ? "" : " of the " + what) + " on " + group.str() + " " + dir +
                  " rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + "): tensor " + describe(t);
  return s;
}

void check_p2p(const std::string& desc, const torch::Tensor& t, int peer, const ProcessGroup& group, int tag) {
  TORCH_CHECK(t.defined(), desc, ": the tensor is undefined");
  TORCH_CHECK(peer >= 0 && peer < group.size(), desc, ": the peer rank is out of range [0, ", group.size(), ")");
  TORCH_CHECK(peer != group.rank(), desc, ": a rank cannot send to or receive from itself");
  TORCH_CHECK(t.is_contiguous(), desc, ": the tensor must be contiguous");
  TORCH_CHECK(tag >= 0, desc, ": the tag must be >= 0");
}

}  // namespace

Work isend(const torch::Tensor& tensor, int group_dst, ProcessGroup& group, int tag, const std::string& what) {
  const std::string desc = p2p_desc("isend", "to", group_dst, group, tag, tensor, what);
  check_p2p(desc, tensor, group_dst, group, tag);
  std::vector<at::Tensor> ts{tensor};
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = group.backend()->send(ts, group_dst, tag);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, desc, " failed: ", e.what());
  }
  return Work(std::move(w), desc);
}

Work irecv(const torch::Tensor& tensor, int group_src, ProcessGroup& group, int tag, const std::string& what) {
  const std::string desc = p2p_desc("irecv", "from", group_src, group, tag, tensor, what);
  check_p2p(desc, tensor, group_src, group, tag);
  std::vector<at::Tensor> ts{tensor};
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = group.backend()->recv(ts, group_src, tag);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, desc, " failed: ", e.what());
  }
  return Work(std::move(w), desc);
}

}  // namespace fsdp
