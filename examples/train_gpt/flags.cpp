// train_gpt's command line: the flags (CLI11), their checks and parse_options(). The presets and the
// checks that need several flags are in options.cpp.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include <CLI/CLI.hpp>

#include "options.h"

namespace train_gpt {

namespace {

// ---- Flag values -------------------------------------------------------------------------------------
//
// Checks of numeric flags that fail with one line naming the flag, what it expects and what it got.
// CLI11's own PositiveNumber/NonNegativeNumber/Range print the type's whole range (1.8e308 written out
// in full) on a second line, and let NaN through (every comparison with NaN is false).

/// An integer of type T, at least `min`.
template <typename T>
CLI::Validator integer_at_least(T min) {
  const std::string expected = "expected an integer >= " + std::to_string(min);
  return CLI::Validator(
      [min, expected](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const bool is_signed = std::numeric_limits<T>::is_signed;
        // strtoull accepts "-1" (as 2^64 - 1): refuse a sign for unsigned types.
        if (s.empty() || std::isspace(static_cast<unsigned char>(s[0])) || (!is_signed && s[0] == '-')) {
          return expected + ", got '" + s + "'";
        }
        long long v = 0;
        unsigned long long u = 0;
        if (is_signed) {
          v = std::strtoll(s.c_str(), &end, 10);
        } else {
          u = std::strtoull(s.c_str(), &end, 10);
        }
        if (*end != '\0') return expected + ", got '" + s + "'";
        const bool too_large = errno == ERANGE || (is_signed ? v > static_cast<long long>(std::numeric_limits<T>::max())
                                                             : u > static_cast<unsigned long long>(
                                                                       std::numeric_limits<T>::max()));
        if (too_large || (is_signed && v < static_cast<long long>(std::numeric_limits<T>::min()))) {
          return expected + ", got " + s + ", which is out of range";
        }
        if (is_signed ? v < static_cast<long long>(min) : u < static_cast<unsigned long long>(min)) {
          return expected + ", got " + s;
        }
        return "";
      },
      "", "");
}

/// Adds an integer flag `name` >= `min` to `group` (a CLI::App or option group), its default shown in --help.
template <typename T, typename Group>
CLI::Option* add_integer(Group* group, const std::string& name, T& value, const std::string& help, T min) {
  return group->add_option(name, value, help)->capture_default_str()->check(integer_at_least<T>(min));
}

/// A finite number in [lo, hi] (or (lo, hi] with lo_open, [lo, hi) with hi_open; hi = inf: no bound).
CLI::Validator number_in(double lo, bool lo_open, double hi = std::numeric_limits<double>::infinity(),
                         bool hi_open = false) {
  auto num = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  std::string expected = "expected a finite number ";
  if (std::isinf(hi)) {
    expected += (lo_open ? "> " : ">= ") + num(lo);
  } else {
    expected += std::string("in ") + (lo_open ? "(" : "[") + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
  }
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
        if (s.empty() || std::isspace(static_cast<unsigned char>(s[0])) || *end != '\0') {
          return expected + ", got '" + s + "'";
        }
        const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
        return ok ? "" : expected + ", got " + s;
      },
      "", "");
}

/// --resume's value: none (the flag alone), or auto.
CLI::Validator resume_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        return s == "always" || s == "auto" ? "" : "expected no value or 'auto', got '" + s + "'";
      },
      "", "");
}

CLI::Option* add_flags(CLI::App& app, Options& o) {
  std::string presets;
  for (const auto& n : preset_names()) presets += (presets.empty() ? "" : "|") + n;
  auto* g = app.add_option_group("Model");
  auto* model_flag = g->add_option("--model", o.model, "Preset: " + presets + " (llama-*: the Llama "
                                   "architecture, model_llama.h)")->capture_default_str();
  g->add_option("--n-layer", o.n_layer, "Transformer blocks (overrides the preset)")->check(integer_at_least<int64_t>(1));
  g->add_option("--n-head", o.n_head, "Attention heads (overrides the preset)")->check(integer_at_least<int64_t>(1));
  g->add_option("--n-embd", o.n_embd, "Embedding width, a multiple of --n-head (overrides the preset)")
      ->check(integer_at_least<int64_t>(1));
  g->add_option("--block-size", o.block_size, "Context length in bytes (overrides the preset)")
      ->check(integer_at_least<int64_t>(1));
  g->add_option("--dropout", o.dropout, "Dropout probability (Default: 0)")->check(number_in(0, false, 1, true));
  g->add_option("--tie-weights", o.tie_weights, "Share the embedding and head weights (Default: the preset's: true "
                "for GPT-2, false for Llama)");
  g->add_option("--init-from", o.init_from,
                "A Hugging Face model folder (config.json + model.safetensors or its index and shards, as "
                "save_pretrained writes; LlamaForCausalLM or GPT2LMHeadModel): the model's shape from config.json, "
                "its weights loaded into the shards (each rank reads its own rows). Unsupported config fields are "
                "refused by name. A resume (--resume, a restart) loads the checkpoint instead");
  g->add_option("--export-hf", o.export_hf,
                "After training, write the model as a Hugging Face folder DIR (config.json + model.safetensors, fp32) "
                "that transformers' from_pretrained loads");
  g->add_option("--export-max-file-mb", o.export_max_file_mb,
                "--export-hf: split the weights into files of at most this many MiB (a larger tensor alone in its "
                "file), listed by model.safetensors.index.json")
      ->capture_default_str()->check(number_in(0, true));
  g->add_option("--logits-tokens", o.logits_tokens,
                "A safetensors file holding int64 \"tokens\" [B, T]: their logits are computed after initialisation "
                "(and --init-from or a resume) and after training, and written to --dump-logits");
  g->add_option("--dump-logits", o.dump_logits,
                "Write the fp32 logits of --logits-tokens to FILE (safetensors: \"logits_init\" before the first "
                "step, \"logits\" after the last; rank 0)");
  g->add_option("--model-impl", o.model_impl,
                "How the model's code meets FSDP (the same GPT, parameter names, weights and losses either way): "
                "holder (model.h: blocks declared as fsdp::FSDPModule<Block>, FSDP runs around each call) or "
                "plain (model_plain.h: unchanged LibTorch, a ModuleList of blocks and a Sequential MLP, no "
                "libfsdp type; FSDP works at tensor level)")
      ->capture_default_str()->check(CLI::IsMember({"holder", "plain"}));

  g = app.add_option_group("Data");
  g->add_option("--data", o.data, std::string("Text files to train on (Default: the fortunes in ") +
                                      kDefaultCorpusDir + ", installed by scripts/setup.sh)");
  g->add_option("--val-fraction", o.val_fraction, "Fraction of the text held out for evaluation")
      ->capture_default_str()->check(number_in(0.001, false, 0.5));
  g->add_option("--tokenizer", o.tokenizer, "SentencePiece .model (scripts/train_tokenizer.sh): the text, --sft and "
                "the sample are encoded and decoded with it, and the model's vocabulary is its; `bytes`: byte ids "
                "(Default: --init-from DIR's tokenizer.model when it has one, else bytes)");
  g->add_option("--vocab-size", o.vocab_size, "The model's vocabulary, at least the tokenizer's (e.g. padded to a "
                "multiple of 64) (Default: the tokenizer's; presets keep theirs)")->check(integer_at_least<int64_t>(1));
  g->add_option("--data-shards", o.data_shards, "Pre-tokenized llm.c token files (train_gpt tokenize): a directory of "
                "*.bin or a glob; val* and *_val_* files are the validation split; memory-mapped");
  g->add_option("--sft", o.sft, "Fine-tune on a JSONL of {\"prompt\": ..., \"response\": ...} lines: the loss is the "
                "mean over the response tokens of the global batch (prompt and padding masked)");

  g = app.add_option_group("Optimisation");
  add_integer(g, "--steps", o.steps, "Optimizer steps", int64_t(1));
  add_integer(g, "--batch-size", o.batch_size, "Sequences per rank per microbatch", int64_t(1));
  add_integer(g, "--global-batch-size", o.global_batch_size,
              "Sequences per microbatch over all data-parallel ranks, instead of --batch-size: each rank takes its "
              "share for the world size at hand, so a run restarted on another number of ranks (fsdprun --nnodes "
              "MIN:MAX) trains the same batches (0: use --batch-size)",
              int64_t(0));
  add_integer(g, "--grad-accum-steps", o.grad_accum_steps, "Microbatches per step", int64_t(1));
  g->add_option("--lr", o.lr, "Peak learning rate (AdamW)")->capture_default_str()->check(number_in(0, true));
  g->add_option("--min-lr", o.min_lr, "Learning rate at the end of the cosine decay")
      ->capture_default_str()->check(number_in(0, false));
  add_integer(g, "--warmup-steps", o.warmup_steps, "Steps of linear warmup", int64_t(0));
  g->add_option("--weight-decay", o.weight_decay, "AdamW weight decay (matrices and embeddings only)")
      ->capture_default_str()->check(number_in(0, false));
  g->add_option("--clip-grad", o.clip_grad, "Clip the global gradient norm to this (0: no clipping)")
      ->capture_default_str()->check(number_in(0, false));

  g = app.add_option_group("Parallelism and memory");
  g->add_option("--mixed-precision", o.mixed_precision, "Compute dtype (parameters and optimizer stay fp32)")
      ->capture_default_str()->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  g->add_option("--all-gather-dtype", o.all_gather_dtype,
                "All-gather the weight matrices in bf16 or float8 (e4m3, a scale per shard) and upcast them after "
                "the gather (fsdp::low_precision_all_gather): half or a quarter of fp32's bytes on the wire; "
                "compute stays in --mixed-precision")
      ->capture_default_str()->check(CLI::IsMember({"fp32", "bf16", "float8"}));
  add_integer(g, "--shard-dim", o.shard_dim, "Shard each 2-D weight on this dim (0 or 1) where its size divides by the "
              "FSDP ranks, the others on dim 0 (fully_shard's shard_placement_fn) (Default: 0)", int(0));
  g->add_option("--freeze", o.freeze,
                "Freeze the parameters whose name matches this regex (e.g. 'wpe'): no gradient, no update, "
                "not reduced (fine-tuning part of a model)");
  g->add_option("--frozen-dtype", o.frozen_dtype,
                "Store the frozen parameters in this dtype: bf16 beside fp32 weights makes groups of two dtypes, "
                "which fully_shard all-gathers as bytes in one collective, as FSDP2")
      ->capture_default_str()->check(CLI::IsMember({"fp32", "bf16"}));
  g->add_option("--reshard-after-forward", o.reshard_after_forward,
                "Free the blocks' gathered parameters after forward: true|false|N (N ranks keep a slice)")
      ->capture_default_str();
  g->add_option("--activation-checkpointing", o.activation_checkpointing,
                "Recompute activations in backward instead of keeping them (torchtitan's modes): none; full (every "
                "block recomputed); selective-op (per op: matmul and attention outputs kept, every other matmul and "
                "the rest recomputed); layer:K (every K-th block recomputed in full)")
      ->capture_default_str()
      ->check([](const std::string& v) -> std::string {
        if (v == "none" || v == "full" || v == "selective-op") return "";
        if (v.rfind("layer:", 0) == 0 && v.size() > 6 && v.find_first_not_of("0123456789", 6) == std::string::npos &&
            std::stoll(v.substr(6)) >= 1) {
          return "";
        }
        return "expected none, full, selective-op or layer:K (K >= 1), got '" + v + "'";
      });
  g->add_flag("--activation-offload", o.activation_offload,
              "Keep the tensors the forward saves for backward in host memory (save_on_cpu; pinned on CUDA)");
  g->add_option("--checkpoint-impl", o.checkpoint_impl,
                "With --activation-checkpointing full or layer:K: no_reentrant (saved-tensor hooks, PyTorch's default) or reentrant "
                "(--model-impl holder only) "
                "(an autograd function re-running the block in a nested backward), as checkpoint_wrapper's "
                "CheckpointImpl")
      ->capture_default_str()->check(CLI::IsMember({"no_reentrant", "reentrant"}));
  g->add_flag("--cpu-offload", o.cpu_offload, "Keep shards, gradients and optimizer state on the CPU");
  add_integer(g, "--tp", o.tp, "Tensor-parallel ranks: each block's heads and MLP columns split across them; "
              "WORLD_SIZE = --dp-replicate x FSDP ranks x --tp (Default: 1)", int(1));
  add_integer(g, "--cp", o.cp, "Context-parallel ranks: each sequence split across them (load-balanced for causal "
              "attention; ring attention over them); WORLD_SIZE = FSDP ranks x --cp x --tp; --block-size must be "
              "a multiple of 2 x --cp (Default: 1)", int(1));
  add_integer(g, "--dp-replicate", o.dp_replicate, "HSDP: replicas of the FSDP group (Default: 1)", int(1));
  add_integer(g, "--pp", o.pp, "Pipeline-parallel ranks: the blocks split into --pp x --stages-per-rank stages, "
              "each fully_shard'ed over its data-parallel ranks; WORLD_SIZE = --pp x --dp-replicate x FSDP ranks x --tp (Default: 1)", int(1));
  g->add_option("--pp-schedule", o.pp_schedule,
                "With --pp: the pipeline schedule (torch.distributed.pipelining's): gpipe, 1f1b, interleaved-1f1b, "
                "interleaved-zero-bubble or zbv-zero-bubble")
      ->capture_default_str()
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"}));
  g->add_option("--pp-microbatches", o.pp_microbatches,
                "With --pp: microbatches per step, each --batch-size / M sequences (Default: the number of stages, "
                "--pp x --stages-per-rank)")
      ->check(integer_at_least<int>(1));
  g->add_option("--stages-per-rank", o.stages_per_rank,
                "With --pp: pipeline stages per pipeline rank (Default: 2 for interleaved-1f1b, "
                "interleaved-zero-bubble and zbv-zero-bubble, else 1)")
      ->check(integer_at_least<int>(1));
  g->add_option("--data-parallel", o.data_parallel,
                "fully_shard (shard parameters, gradients and optimizer state over the data-parallel ranks) or "
                "replicate (every rank keeps the whole model; gradients all-reduced per block: fsdp::replicate, "
                "PyTorch's DDP semantics)")
      ->capture_default_str()->check(CLI::IsMember({"fully_shard", "replicate"}));
  g->add_flag("--keep-unsharded-between-microbatches", o.keep_unsharded,
              "With --grad-accum-steps: set_reshard_after_backward(false) on every microbatch but the last (FSDP2's "
              "recipe): the next microbatch's forward reuses the gathered parameters instead of all-gathering "
              "them again (more memory between microbatches)");
  g->add_flag("--reduce-scatter-each-microbatch", o.reduce_scatter_each_microbatch,
              "With --grad-accum-steps: reduce-scatter every microbatch's gradients (sharded sums: less memory "
              "than keeping unsharded gradients until the last); with --dp-replicate, all-reduce over the "
              "replicas on the last microbatch only (FSDPModule::set_requires_all_reduce)");
  g->add_flag("--sequence-parallel", o.sequence_parallel,
              "With --tp: LayerNorms and residuals on sequence-sharded activations (less activation memory)");
  auto* lp = g->add_flag("--loss-parallel", o.loss_parallel,
              "With --tp: wte and the tied lm_head vocabulary-parallel, the loss computed on the vocabulary-sharded "
              "logits without gathering them (loss_parallel; Default: on with --tp for GPT-2 with a tied head, "
              "a vocabulary that divides by --tp and no --pp)");
  g->add_flag("--no-loss-parallel", o.no_loss_parallel, "With --tp: gather the logits (no loss_parallel)")->excludes(lp);
  g->add_flag("--dtensor-rng", o.dtensor_rng,
              "Dropout masks from the DTensor RNG (fsdp::manual_seed on the mesh: what one process would draw, "
              "whatever the --tp layout); always on with --tp and --dropout > 0");
  g->add_flag("--estimate-memory", o.estimate_memory,
              "Print the predicted per-rank peak memory (fsdp::estimate_memory, one row per component) for "
              "this model, world size and options, and exit without training");
  g->add_option("--device", o.device, "cuda (each rank on cuda:LOCAL_RANK, NCCL) or cpu (Gloo) (Default: cuda "
                                      "when a CUDA device is usable, else cpu)")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  g->add_option("--optimizer-impl", o.optimizer_impl, "AdamW's kernels: foreach (PyTorch's default on CUDA: a few "
                                                      "multi-tensor kernels per group, PyTorch's arithmetic) or "
                                                      "libtorch (torch::optim::AdamW::step, ~8 kernels per "
                                                      "parameter) (Default: foreach on CUDA, libtorch on the CPU)")
      ->check(CLI::IsMember({"auto", "foreach", "libtorch"}));
  g->add_option("--peak-tflops", o.peak_tflops, "Peak dense bf16 TFLOP/s of one GPU, for the MFU (model FLOPs "
                                                "utilisation) in the log and metrics; H100/H200 SXM: 989")
      ->capture_default_str()->check(CLI::PositiveNumber);
  add_integer(g, "--threads", o.threads, "Intra-op threads per rank (0: OMP_NUM_THREADS, 1 under fsdprun)", int(0));

  g = app.add_option_group("Output");
  // The periodic flags agree: N > 0 every N steps (and at the end), 0 only at the end (--ckpt-every too).
  add_integer(g, "--log-every", o.log_every, "Steps between log lines (0: only after the last step)", int64_t(0));
  add_integer(g, "--eval-every", o.eval_every,
              "Steps between evaluations, which also run before the first step and after the last (0: only those two)",
              int64_t(0));
  add_integer(g, "--eval-batches", o.eval_batches, "Batches per rank per evaluation", int64_t(1));
  g->add_option("--metrics", o.metrics, "Write JSON lines (step, loss, lr, grad_norm, tokens_per_s, step_ms, "
                                        "peak_rss_mb, peak_gpu_mem_mb, mfu, eval_loss) to FILE (rank 0)");
  g->add_flag("--no-progress", o.no_progress, "No progress bar even on a terminal");

  g = app.add_option_group("Sampling");
  g->add_option("--sample-prompt", o.sample_prompt, "Text the sample continues")->capture_default_str();
  add_integer(g, "--sample-tokens", o.sample_tokens, "Bytes to generate (0: no sample)", int64_t(0));
  g->add_option("--temperature", o.temperature, "Sampling temperature (0: greedy)")
      ->capture_default_str()->check(number_in(0, false));
  add_integer(g, "--top-k", o.top_k, "Sample among the k likeliest bytes (0: all)", int64_t(0));
  add_integer(&app, "--seed", o.seed, "Seed of the weights, the data order and the sample", uint64_t(0));

  // [checkpoints]
  g = app.add_option_group("Checkpoints");
  g->add_option("--ckpt-dir", o.ckpt_dir, "Save distributed checkpoints in DIR/step-N (every rank writes its "
                                          "shards; DIR/latest names the newest)");
  add_integer(g, "--ckpt-every", o.ckpt_every, "Steps between checkpoints (0: only after the last step)", int64_t(0));
  add_integer(g, "--keep-last", o.keep_last, "Keep only the newest N checkpoints (0: all)", int(0));
  g->add_option("--ckpt-format", o.ckpt_format,
                "Layout of saved checkpoints: safetensors (libfsdp's, checksummed; PyTorch reads it with "
                "HuggingFaceStorageReader) or distcp (PyTorch's dcp.save default, read by dcp.load). --resume "
                "reads either")
      ->capture_default_str()
      ->check(CLI::IsMember({"safetensors", "distcp"}));
  g->add_option("--resume", o.resume,
                "Continue from the newest checkpoint in --ckpt-dir, on any number of ranks (model and optimizer "
                "resharded, the data position carried over); an error if there is none. --resume auto: continue "
                "if --ckpt-dir holds a checkpoint, else start a new run. A restart by fsdprun/torchrun "
                "(TORCHELASTIC_RESTART_COUNT > 0) resumes as with auto")
      ->expected(0, 1)
      ->default_str("always")
      ->check(resume_value());
  g->add_option("--stop-at", o.stop_at, "Stop after step N, as an interrupted run (the learning-rate schedule "
                                        "still spans --steps; continue with --resume)")
      ->check(integer_at_least<int64_t>(0));

  g = app.add_option_group("Fault tolerance across replica groups (fsdp::ft, after TorchFT)");
  g->add_option("--ft-replica-id", o.ft_replica_id, "This job is replica group N of --ft-group-size: every step its "
                "gradients are averaged with the other replica groups'; a replica group that fails does not stop the "
                "others, and when it starts again it receives the current state from a live one (no checkpoint read)")
      ->check(integer_at_least<int>(0));
  g->add_option("--ft-group-size", o.ft_group_size, "Replica groups of the job (with --ft-replica-id)")
      ->check(integer_at_least<int>(1));
  g->add_option("--ft-min-replica-size", o.ft_min_replica_size, "A step runs with at least this many replica groups "
                "(0: all of them; fewer: the others train on while one is lost, skipping its part of the batch)")
      ->check(integer_at_least<int>(0));
  g->add_option("--ft-lighthouse", o.ft_lighthouse, "HOST:PORT of the fsdp_lighthouse the replica groups share "
                "(default: TORCHFT_LIGHTHOUSE)");
  g->add_option("--ft-join-timeout", o.ft_join_timeout, "Seconds a step waits for the previous step's replica groups "
                "before it goes on without the missing ones")->capture_default_str()->check(number_in(0, true));
  g->add_option("--ft-timeout", o.ft_timeout, "Seconds the commit vote and the replica groups' collectives may take")
      ->capture_default_str()->check(number_in(0, true));
  g->add_option("--ft-quorum-timeout", o.ft_quorum_timeout, "Seconds to wait for --ft-min-replica-size replica groups "
                "(e.g. while a lost one restarts), or to be admitted")->capture_default_str()->check(number_in(0, true));

  g = app.add_option_group("Comparison with PyTorch (bench/compare_fsdp2.py)");
  g->add_option("--save-init", o.save_init, "Write the initial weights (full, before sharding) to FILE as "
                                             "safetensors (rank 0)");
  g->add_option("--dump-batches", o.dump_batches, "Write the token batches each rank trains on to "
                                                  "DIR/rank<R>.safetensors, and DIR/run.json");
  g->add_flag("--no-shard", o.no_shard, "No FSDP: one process, plain LibTorch (bf16 by CPU autocast); the floor "
                                        "of the benchmark");
  // A flag given twice takes its last value, so that scripts can put defaults first and pass the
  // user's arguments after them (scripts/train.sh).
  std::vector<CLI::App*> sections = app.get_subcommands([](CLI::App*) { return true; });  // the option groups
  sections.push_back(&app);
  for (auto* section : sections) {
    for (auto* opt : section->get_options()) {
      if (opt->get_expected_max() == 1) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
  return model_flag;
}

}  // namespace

std::optional<int> parse_options(int argc, char** argv, Options& o) {
  CLI::App app{"train_gpt: trains a GPT-2-style byte-level language model on English text with FSDP2 (libfsdp).\n"
               "Launch: fsdprun --standalone --nproc-per-node N -- train_gpt [OPTIONS]\n"
               "Token shards for --data-shards: train_gpt tokenize --help"};
  CLI::Option* model_flag = add_flags(app, o);
  try {
    app.parse(argc, argv);
    o.model_given = model_flag->count() > 0;
    o.batch_size_given = app.get_option("--batch-size")->count() > 0;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // One line, like every other usage error (CLI11 adds "Run with --help ..." on a second line).
    // Our checks of flag values say what they expect; other parse errors (an unknown flag, a missing
    // value) point to --help.
    const bool says_expected = dynamic_cast<const CLI::ValidationError*>(&e) != nullptr;
    throw UsageError(one_line(e.what()) + (says_expected ? "" : ". Fix: see train_gpt --help"));
  }
  return std::nullopt;
}

}  // namespace train_gpt
