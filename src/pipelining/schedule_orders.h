// The order of each rank's actions for every schedule (PyTorch's pipeline_order, without its
// communication actions). Internal: the schedules' constructors call them.
#pragma once

#include <map>

#include "fsdp/pipelining/schedules.h"

namespace fsdp::pipelining::detail {

std::map<int, RankOrder> gpipe_order(int pp_size, int n_microbatches);
std::map<int, RankOrder> one_f_one_b_order(int pp_size, int n_microbatches);
/// Interleaved 1F1B (zero_bubble false) and interleaved zero bubble (true), n_local_stages per rank.
std::map<int, RankOrder> interleaved_order(int pp_size, int n_local_stages, int n_microbatches, bool zero_bubble);
std::map<int, RankOrder> zbv_order(int pp_size, int n_microbatches);

}  // namespace fsdp::pipelining::detail
