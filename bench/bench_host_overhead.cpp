// bench_host_overhead: libfsdp's host (CPU) time per FSDP group and per step, without communication to hide it
// (issue 37, item 3). bench/host_overhead.py runs it beside the same measurement of PyTorch's FSDP2 and prints
// the table of docs/BENCHMARKS.md ("Host overhead per group").
//
//   build/bin/fsdprun --standalone --nproc-per-node 1 -- build/bin/bench_host_overhead --groups 32 --json
//
// The model is --groups layers of Linear(--dim, --dim) + relu on a [--batch, --dim] input: tiny matrices, so a
// step's time is almost all host work. Each layer is one fully_shard group (the root holds none of its own), on a
// world of one rank (FSDP's all-gathers and reduce-scatters run, over one rank: the machinery without the wire).
// Four models of the same weights, timed in turn (ABAB... over --repeats rounds, --steps steps per round):
//   plain     unsharded LibTorch (the floor)
//   holder    layers declared as fsdp::FSDPModule<Layer> (FSDP runs around each call)
//   implicit  the unchanged model: FSDP follows the ops that use each group's parameters (interception)
// and two phases per model: "forward" (forward under NoGradGuard: FSDP's pre-forward / post-forward, the
// all-gather and the reshard) and "step" (forward with grad + backward: also pre-backward / post-backward and the
// reduce-scatter). Per group = (sharded - plain) / groups, the median over rounds of per-step medians.
// Output: one JSON object (--json) or a readable table. --profile NAME: only NAME's steps (for perf), then the ops
// one step of each model dispatches, counted by name (how the per-group cost was found: [Note: small copies by
// memcpy] in src/fsdp/fsdp_collectives.cpp).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/record_function.h>
#include <CLI/CLI.hpp>

#include "fsdp/fsdp.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(int64_t d) : fc(register_module("fc", torch::nn::Linear(d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Layer);

// L: Layer (plain and implicit) or fsdp::FSDPModule<Layer> (holder).
template <typename L>
struct NetImpl : torch::nn::Module {
  NetImpl(int groups, int64_t d) {
    for (int i = 0; i < groups; ++i) {
      layers.push_back(L(Layer(d)));
      register_module(std::to_string(i), layers.back().ptr());
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = l(x);
    return x;
  }
  std::vector<L> layers;
};

// Same weights in every model (seeded per layer).
template <typename Net>
void init_weights(Net& net) {
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net.parameters()) p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat32) * 0.37 + i++).view_as(p) * 0.3);
}

struct Model {
  std::string name;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<void()> zero_grad;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Host time per FSDP group (holder and implicit paths) against an unsharded model; run under fsdprun."};
  int groups = 32, steps = 200, repeats = 5, warmup = 20;
  int64_t dim = 8, batch = 4;
  bool json = false;
  std::string profile;
  app.add_option("--groups", groups, "Layers, one fully_shard group each")->check(CLI::Range(1, 100000));
  app.add_option("--dim", dim, "Linear(dim, dim) per layer")->check(CLI::Range(1, 1 << 20));
  app.add_option("--batch", batch, "Rows of the input")->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", steps, "Timed steps per model per round")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", warmup, "Untimed steps per model before the rounds")->check(CLI::Range(0, 1000000));
  app.add_option("--repeats", repeats, "Rounds (models interleaved); the median round is reported")->check(CLI::Range(1, 1000));
  app.add_flag("--json", json, "One JSON object on stdout");
  app.add_option("--profile", profile, "Run only this model's steps (plain, holder or implicit), --steps x --repeats "
                 "of them (for perf record), then print each model's ops of one step by name to stderr")->check(CLI::IsMember({"plain", "holder", "implicit"}));
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto pg = fsdp::init_process_group();
    auto mesh = fsdp::init_device_mesh(pg->device_type(), {pg->size()}, {}, pg);
    auto opts = fsdp::FullyShardOptions().mesh(mesh);

    auto plain = std::make_shared<NetImpl<Layer>>(groups, dim);
    auto implicit = std::make_shared<NetImpl<Layer>>(groups, dim);
    auto holder = std::make_shared<NetImpl<fsdp::FSDPModule<Layer>>>(groups, dim);
    init_weights(*plain);
    init_weights(*implicit);
    init_weights(*holder);
    for (auto& l : implicit->layers) fsdp::fully_shard(l, opts);
    fsdp::fully_shard(implicit, opts);
    for (auto& l : holder->layers) fsdp::fully_shard(l, opts);
    fsdp::FSDPModule<torch::nn::ModuleHolder<NetImpl<fsdp::FSDPModule<Layer>>>> holder_root(holder);
    fsdp::fully_shard(holder_root, opts);

    std::vector<Model> models = {
        {"plain", [&](const torch::Tensor& x) { return plain->forward(x); }, [&] { plain->zero_grad(); }},
        {"holder", [&](const torch::Tensor& x) { return holder_root(x); }, [&] { holder->zero_grad(); }},
        {"implicit", [&](const torch::Tensor& x) { return implicit->forward(x); }, [&] { implicit->zero_grad(); }},
    };
    auto x = torch::sin(torch::arange(batch * dim, torch::kFloat32) * 0.11).view({batch, dim});
    // One timed phase of `steps` steps; returns the median step in microseconds.
    auto phase = [&](Model& m, bool with_backward, int n) {
      std::vector<double> us;
      us.reserve(static_cast<size_t>(n));
      for (int s = 0; s < n; ++s) {
        m.zero_grad();
        const auto t0 = Clock::now();
        if (with_backward) {
          m.forward(x).sum().backward();
        } else {
          torch::NoGradGuard no_grad;
          m.forward(x);
        }
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      return median(us);
    };
    // Same results from every model (the sharded paths compute what the plain one does).
    std::map<std::string, torch::Tensor> out;
    for (auto& m : models) out[m.name] = m.forward(x).detach();
    for (auto& m : models) {
      TORCH_CHECK(torch::allclose(out[m.name], out["plain"], 1e-6, 1e-6), "bench_host_overhead: ", m.name,
                  "'s output differs from the plain model's");
    }
    if (!profile.empty()) {
      for (auto& m : models) {
        if (m.name == profile) phase(m, true, steps * repeats);
      }
      // The ops of one step (forward + backward) of each model, by name, to stderr: what the machinery adds.
      for (auto& m : models) {
        static thread_local std::map<std::string, int>* counts = nullptr;
        std::map<std::string, int> c;
        counts = &c;
        auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (counts) ++(*counts)[fn.name()];
              return nullptr;
            }).scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
        m.zero_grad();
        m.forward(x).sum().backward();
        at::removeCallback(handle);
        counts = nullptr;
        int total = 0;
        for (const auto& [k, v] : c) total += v;
        std::fprintf(stderr, "%s: %d ops per step\n", m.name.c_str(), total);
        std::vector<std::pair<int, std::string>> top;
        for (const auto& [k, v] : c) top.emplace_back(v, k);
        std::sort(top.rbegin(), top.rend());
        for (size_t i = 0; i < top.size() && i < 25; ++i) std::fprintf(stderr, "  %6d %s\n", top[i].first, top[i].second.c_str());
      }
      fsdp::destroy_process_group();
      return 0;
    }
    for (auto& m : models) {
      phase(m, false, warmup);
      phase(m, true, warmup);
    }
    std::map<std::string, std::vector<double>> fwd, step;
    for (int r = 0; r < repeats; ++r) {
      for (auto& m : models) {
        fwd[m.name].push_back(phase(m, false, steps));
        step[m.name].push_back(phase(m, true, steps));
      }
    }
    auto med = [](std::map<std::string, std::vector<double>>& v, const std::string& k) { return median(v[k]); };
    const double g = groups;
    const double fwd_plain = med(fwd, "plain"), step_plain = med(step, "plain");
    const double fwd_h = med(fwd, "holder"), step_h = med(step, "holder");
    const double fwd_i = med(fwd, "implicit"), step_i = med(step, "implicit");
    if (pg->rank() == 0) {
      if (json) {
        std::printf(
            "{\"groups\": %d, \"dim\": %lld, \"batch\": %lld, \"world\": %d, \"steps\": %d, \"repeats\": %d, "
            "\"forward_us\": {\"plain\": %.2f, \"holder\": %.2f, \"implicit\": %.2f}, "
            "\"step_us\": {\"plain\": %.2f, \"holder\": %.2f, \"implicit\": %.2f}, "
            "\"per_group_us\": {\"holder_forward\": %.3f, \"holder_backward\": %.3f, \"holder_step\": %.3f, "
            "\"implicit_forward\": %.3f, \"implicit_backward\": %.3f, \"implicit_step\": %.3f}}\n",
            groups, static_cast<long long>(dim), static_cast<long long>(batch), pg->size(), steps, repeats, fwd_plain,
            fwd_h, fwd_i, step_plain, step_h, step_i, (fwd_h - fwd_plain) / g,
            ((step_h - fwd_h) - (step_plain - fwd_plain)) / g, (step_h - step_plain) / g, (fwd_i - fwd_plain) / g,
            ((step_i - fwd_i) - (step_plain - fwd_plain)) / g, (step_i - step_plain) / g);
      } else {
        std::printf("%d groups of Linear(%lld, %lld) + relu, batch %lld, world %d; median of %d rounds x %d steps\n",
                    groups, static_cast<long long>(dim), static_cast<long long>(dim), static_cast<long long>(batch),
                    pg->size(), repeats, steps);
        std::printf("%-9s %12s %12s %18s %18s\n", "model", "forward us", "step us", "fwd us/group", "step us/group");
        for (const auto& [name, f, s] : {std::tuple{"plain", fwd_plain, step_plain}, std::tuple{"holder", fwd_h, step_h},
                                         std::tuple{"implicit", fwd_i, step_i}}) {
          std::printf("%-9s %12.1f %12.1f %18.2f %18.2f\n", name, f, s, (f - fwd_plain) / g, (s - step_plain) / g);
        }
      }
    }
    fsdp::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_host_overhead: %s\n", e.what());
    return 1;
  }
}
