// Each schedule's order of actions per rank. The algorithms are PyTorch's (schedules.py of the 2.13
// wheel: Schedule1F1B's phases, _get_1f1b_rank_ops, _get_warmup_ops, ScheduleZBVZeroBubble's
// _calculate_single_rank_operations), written again here so that a model trained with libfsdp meets its
// microbatches in the order PyTorch's would; tests/python/test_pipelining_orders.py checks the result
// against the wheel's pipeline_order for many (ranks, stages, microbatches).
#include "pipelining/schedule_orders.h"

#include <algorithm>

namespace fsdp::pipelining::detail {
namespace {

using CT = ComputationType;
Action act(int stage, CT t, int mb) { return Action{stage, t, mb}; }

}  // namespace

std::map<int, RankOrder> gpipe_order(int p, int m) {
  std::map<int, RankOrder> order;
  for (int r = 0; r < p; ++r) {
    RankOrder& ops = order[r];
    for (int i = 0; i < m; ++i) ops.push_back(act(r, CT::FORWARD, i));
    for (int i = 0; i < m; ++i) ops.push_back(act(r, CT::FULL_BACKWARD, i));
  }
  return order;
}

std::map<int, RankOrder> one_f_one_b_order(int p, int m) {
  std::map<int, RankOrder> order;
  for (int r = 0; r < p; ++r) {
    RankOrder& ops = order[r];
    // Stage r warms up with p - r forwards (the last stage with one), then alternates backward and
    // forward, then drains the backwards.
    const int warmup = std::min(m, p - r);
    int f = 0, b = 0;
    for (; f < warmup; ++f) ops.push_back(act(r, CT::FORWARD, f));
    for (;;) {
      ops.push_back(act(r, CT::FULL_BACKWARD, b++));
      if (f == m) break;
      ops.push_back(act(r, CT::FORWARD, f++));
    }
    while (b < m) ops.push_back(act(r, CT::FULL_BACKWARD, b++));
  }
  return order;
}

std::map<int, RankOrder> interleaved_order(int p, int v, int m, bool zero_bubble) {
  const int rounds = std::max(1, m / p);
  const int per_round = m / rounds;
  std::map<int, RankOrder> order;
  for (int rank = 0; rank < p; ++rank) {
    // Warmup: the last rank runs (v - 1) rounds of forwards before its first backward; each hop towards
    // rank 0 adds 2 (1F1B) or 1 (zero bubble), capped at all forwards.
    const int factor = zero_bubble ? 1 : 2;
    const int warmup = std::min((v - 1) * per_round + factor * (p - 1 - rank), m * v);
    const int mb_ops = v * m;
    const int fwd_bwd = mb_ops - warmup;
    const int cooldown = mb_ops - fwd_bwd;
    const int total = warmup + fwd_bwd + cooldown;
    auto fwd_stage = [&](int step) { return ((step / per_round) % v) * p + rank; };
    auto bwd_stage = [&](int step) { return (v - 1 - ((step - warmup) / per_round) % v) * p + rank; };
    std::map<int, int> fwd_mb, bwd_mb, w_mb;
    RankOrder& ops = order[rank];
    ops.assign(rank, std::nullopt);
    const int post_warmup = zero_bubble ? p - rank - 1 : (v * p + 2 * (p - 1 - rank)) - (warmup + rank);
    const CT backward = zero_bubble ? CT::BACKWARD_INPUT : CT::FULL_BACKWARD;
    const int n_1f1b = rank;  // zero bubble: how many backwards run before the first W
    std::vector<int> backward_ops;
    size_t w_done = 0;
    auto push_w = [&] {
      const int s = bwd_stage(backward_ops[w_done++]);
      ops.push_back(act(s, CT::BACKWARD_WEIGHT, w_mb[s]++));
    };
    for (int op = 0; op < total; ++op) {
      if (op < warmup) {
        const int s = fwd_stage(op);
        ops.push_back(act(s, CT::FORWARD, fwd_mb[s]++));
        if (op == warmup - 1) ops.insert(ops.end(), std::max(0, post_warmup), std::nullopt);
      } else if (op < warmup + fwd_bwd) {
        const int fs = fwd_stage(op);
        ops.push_back(act(fs, CT::FORWARD, fwd_mb[fs]++));
        const int bs = bwd_stage(op);
        ops.push_back(act(bs, backward, bwd_mb[bs]++));
        backward_ops.push_back(op);
        if (zero_bubble && op - warmup >= n_1f1b) push_w();
      } else {
        if (!zero_bubble) ops.push_back(std::nullopt);
        const int bs = bwd_stage(op);
        ops.push_back(act(bs, backward, bwd_mb[bs]++));
        backward_ops.push_back(op);
        if (zero_bubble && op - warmup >= n_1f1b) push_w();
      }
    }
    while (zero_bubble && w_done < backward_ops.size()) push_w();
  }
  return order;
}

std::map<int, RankOrder> zbv_order(int p, int m) {
  const int num_stages = 2 * p;
  const int n = std::max(2 * p - 1, m);  // enough microbatches to fill the V; the extra ones are dropped
  std::map<int, RankOrder> order;
  for (int rank = 0; rank < p; ++rank) {
    RankOrder ops(rank, std::nullopt);
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    const int s0 = rank, s1 = num_stages - 1 - rank;
    for (int i = 0; i < 2 * (p - rank) - 1; ++i) ops.push_back(act(s0, CT::FORWARD, f0++));
    for (int i = 0; i < rank; ++i) {
      ops.push_back(act(s1, CT::FORWARD, f1++));
      ops.push_back(act(s0, CT::FORWARD, f0++));
    }
    for (int i = 0; i < p - rank; ++i) {
      ops.push_back(act(s1, CT::FORWARD, f1++));
      ops.push_back(act(s1, CT::BACKWARD_INPUT, b1));
      ops.push_back(act(s1, CT::BACKWARD_WEIGHT, b1++));
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) ops.push_back(act(s0, CT::FORWARD, f0++));
      ops.push_back(act(s0, CT::BACKWARD_INPUT, b0));
      ops.push_back(act(s0, CT::BACKWARD_WEIGHT, b0++));
      ops.push_back(act(s1, CT::FORWARD, f1++));
      ops.push_back(act(s1, CT::BACKWARD_INPUT, b1));
      ops.push_back(act(s1, CT::BACKWARD_WEIGHT, b1++));
    }
    int w0 = b0, w1 = b1;
    for (int i = 0; i < rank; ++i) {
      ops.push_back(act(s0, CT::BACKWARD_INPUT, b0++));
      ops.push_back(act(s1, CT::BACKWARD_INPUT, b1++));
    }
    for (int i = 0; i < p - rank; ++i) {
      ops.push_back(act(s0, CT::BACKWARD_INPUT, b0++));
      ops.push_back(act(s0, CT::BACKWARD_WEIGHT, w0++));
    }
    while (w1 < b1) ops.push_back(act(s1, CT::BACKWARD_WEIGHT, w1++));
    while (w0 < b0) ops.push_back(act(s0, CT::BACKWARD_WEIGHT, w0++));
    TORCH_INTERNAL_ASSERT(w0 == b0 && b0 == f0 && w1 == b1 && b1 == f1, "zbv_order: unbalanced order for rank ", rank);
    for (auto& a : ops) {
      if (a && a->microbatch_index >= m) a.reset();
    }
    order[rank] = std::move(ops);
  }
  return order;
}

}  // namespace fsdp::pipelining::detail
