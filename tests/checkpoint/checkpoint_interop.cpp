// The C++ side of tests/python/test_checkpoint_interop.py, run under fsdprun (or torchrun --no-python):
//
//   checkpoint_interop save  --dir D --ref R [--steps K] [--format distcp] [--mesh 2,2]
//        [--optim adamw|adagrad|rmsprop] [--next N]           train the test model K steps, save model +
//                                                             optimizer into D (ours, or PyTorch's .distcp
//                                                             format; FSDP, or HSDP on a 2-D mesh); rank 0
//                                                             writes the full tensors into the safetensors
//                                                             file R (Values: R.values.json); with --next,
//                                                             one more step on batch K, whose tensors
//                                                             ("batch.idx", "batch.targets") and the
//                                                             parameters after it ("model.<fqn>") rank 0
//                                                             writes into N
//   checkpoint_interop load  --dir D --out O [--prefix P] [--optim 1] [--mesh 2,2]
//                                                             load D (any world size and format; P + FQN
//                                                             keys, model only, or with --optim model and
//                                                             optimizer) into a differently initialised
//                                                             model; rank 0 writes its full tensors into O
//                                                             (with --optim, its Values into O.values.json)
//   checkpoint_interop crash-save --parent P --ref R --kill-rank r --kill-stage S
//                                                             save P/step-1 (reference R), then die by
//                                                             SIGKILL on rank r at stage S of P/step-2
//   checkpoint_interop copy-file --in A --out B               one process: dcp::load_file(A), then
//                                                             dcp::save_file(B) with the metadata
//                                                             {"producer": "checkpoint_interop"}
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>

#include "checkpoint/safetensors.h"
#include "checkpoint_test_util.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

void write_full(const std::string& path, const std::map<std::string, torch::Tensor>& tensors) {
  dcp::save_file(tensors, path, {{"format", "pt"}});
}

std::vector<Batch> batches() { return make_batches(4, kCkptBatch, kCkptSeq, 4321); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"C++ side of the checkpoint interop and crash tests"};
  app.require_subcommand(1);
  std::string dir, ref, out, prefix = "model.", parent, stage = "write", optim = "adamw", next;
  int steps = 2, kill_rank = 1;
  std::string format = "safetensors", mesh_arg;
  auto* save = app.add_subcommand("save", "train and save");
  save->add_option("--dir", dir)->required();
  save->add_option("--ref", ref)->required();
  save->add_option("--steps", steps);
  save->add_option("--format", format, "safetensors (ours) or distcp (PyTorch's FileSystemWriter)");
  save->add_option("--mesh", mesh_arg, "e.g. 2,2: HSDP (replicate, shard)");
  save->add_option("--optim", optim)->check(CLI::IsMember({"adamw", "adagrad", "rmsprop"}));
  save->add_option("--next", next);
  auto* load = app.add_subcommand("load", "load and dump full tensors");
  load->add_option("--dir", dir)->required();
  load->add_option("--out", out)->required();
  load->add_option("--prefix", prefix);
  load->add_option("--mesh", mesh_arg, "e.g. 2,2: HSDP (replicate, shard)");
  bool with_optim = false, strict = false;
  std::string resave, value_key;
  load->add_option("--optim", with_optim, "also load the optimizer state (then O holds it under optim.)");
  load->add_option("--strict", strict, "with --optim: strict load (PyTorch's extra param-group options fail it)");
  load->add_option("--resave", resave, "with --optim: then save the state into this folder in PyTorch's format");
  load->add_option("--value", value_key, "with --optim: also load this key as a Value");
  bool nested = false;
  load->add_option("--nested", nested, "with --optim: PyTorch's nested optimizer layout (flatten_optimizer_state_dict "
                                       "false), also for --resave and O.values.json");
  auto* crash = app.add_subcommand("crash-save", "save, then die mid-save");
  crash->add_option("--parent", parent)->required();
  crash->add_option("--ref", ref)->required();
  crash->add_option("--kill-rank", kill_rank);
  crash->add_option("--kill-stage", stage);
  std::string in;
  auto* copy = app.add_subcommand("copy-file", "load_file, then save_file");
  copy->add_option("--in", in)->required();
  copy->add_option("--out", out)->required();
  CLI11_PARSE(app, argc, argv);

  try {
    if (*copy) {
      dcp::save_file(dcp::load_file(in), out, {{"producer", "checkpoint_interop"}});
      return 0;
    }
    auto pg = init_process_group();
    const int rank = pg->rank();
    std::vector<int64_t> mesh;
    for (size_t p = 0; !mesh_arg.empty() && p != std::string::npos;) {
      auto q = mesh_arg.find(',', p);
      mesh.push_back(std::stoll(mesh_arg.substr(p, q == std::string::npos ? q : q - p)));
      p = q == std::string::npos ? q : q + 1;
    }
    const auto opts = dcp::SaveOptions().update_latest(true).storage_format(
        format == "distcp" ? dcp::StorageFormat::Distcp : dcp::StorageFormat::Safetensors);
    if (*save || *crash) {
      const auto kind = optim == "adagrad" ? OptimKind::ADAGRAD : optim == "rmsprop" ? OptimKind::RMSPROP : OptimKind::ADAMW;
      Trainer t(pg, 7, kind, mesh);
      for (int i = 0; i < steps; ++i) t.step(batches()[i]);
      const std::string target = *save ? dir : parent + "/step-1";
      dcp::save(get_state_dict(t.net, *t.opt), target, opts);
      auto full = full_state(t);
      if (rank == 0) {
        write_full(ref, full.tensors);
        std::ofstream(ref + ".values.json") << nlohmann::json(full.values).dump(1);
      }
      if (!next.empty()) {
        const Batch b = batches()[steps];  // batches() returns a fresh vector: copy, not a reference into it
        t.step(b);
        auto params = get_model_state_dict(t.net, StateDictOptions().full_state_dict(true));
        std::map<std::string, torch::Tensor> m{{"batch.idx", b.idx}, {"batch.targets", b.targets}};
        for (const auto& [k, v] : params) m["model." + k] = std::get<torch::Tensor>(v);
        if (rank == 0) write_full(next, m);
      }
      if (*crash) {
        char own[32];
        std::snprintf(own, sizeof(own), "shard-%05d-", rank + 1);
        dcp::detail::set_fault_hook([&](const dcp::detail::FaultPoint& p) {
          const bool mine = p.stage != "write" || p.path.find(own) != std::string::npos;
          if (p.stage == stage && rank == kill_rank && mine) {
            std::cerr << "rank " << rank << ": SIGKILL at " << stage << " of " << p.path << " after "
                      << p.bytes_written << " bytes" << std::endl;
            ::kill(::getpid(), SIGKILL);
          }
        });
        t.step(batches()[steps]);
        dcp::save(get_state_dict(t.net, *t.opt), parent + "/step-2", opts);
        std::cerr << "rank " << rank << ": the save that should have crashed completed" << std::endl;
        return 3;
      }
    } else {
      Trainer t(pg, 8, OptimKind::ADAMW, mesh);
      if (with_optim) {
        // Model and optimizer (the flattened layout, as get_state_dict keys it): every key must load.
        const auto layout = StateDictOptions().flatten_optimizer_state_dict(!nested);
        auto sd = get_state_dict(t.net, *t.opt, layout);
        if (!value_key.empty()) sd.insert_or_assign(value_key, Value(nullptr));
        // A PyTorch checkpoint's param groups also hold options LibTorch's AdamW lacks (foreach, fused,
        // maximize, ...): not strict, but every key of the state dict must be loaded.
        auto r = dcp::load(sd, dir, dcp::LoadOptions().strict(strict));
        TORCH_CHECK(r.missing_keys.empty(), "checkpoint_interop: ", r.missing_keys.size(), " key(s) not in ", dir, ": ",
                    r.missing_keys[0]);
        if (!value_key.empty()) sd.erase(value_key);
        set_state_dict(t.net, *t.opt, sd, layout);
        if (!resave.empty()) {
          dcp::save(get_state_dict(t.net, *t.opt, layout), resave,
                    dcp::SaveOptions().storage_format(dcp::StorageFormat::Distcp));
        }
        auto full = full_state(t);
        if (rank == 0) {
          write_full(out, full.tensors);
          std::ofstream(out + ".values.json") << nlohmann::json(full.values).dump(1);
        }
        barrier(*pg);
        return 0;
      }
      StateDict sd;
      sd.update(get_model_state_dict(t.net), prefix);
      // Model only: a checkpoint with optimizer state holds more keys than this dict (strict off), but
      // every key of the dict must be loaded.
      auto r = dcp::load(sd, dir, dcp::LoadOptions().strict(false));
      TORCH_CHECK(r.missing_keys.empty(), "checkpoint_interop: ", r.missing_keys.size(), " model key(s) not in ", dir);
      set_model_state_dict(t.net, sd.with_prefix(prefix));
      auto full = get_model_state_dict(t.net, StateDictOptions().full_state_dict(true).cpu_offload(true));
      if (rank == 0) {
        std::map<std::string, torch::Tensor> m;
        for (const auto& [k, v] : full) m[prefix + k] = std::get<torch::Tensor>(v);
        write_full(out, m);
      }
    }
    barrier(*pg);
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
