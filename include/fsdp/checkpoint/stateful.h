// Stateful objects in a checkpoint: a data loader, an LR scheduler, an RNG, any user object with state.
//
//   struct Loader : fsdp::Stateful { ... };
//   auto sd = fsdp::get_state_dict(model, opt);
//   sd.insert_or_assign("loader", loader);                 // a std::shared_ptr<Loader>
//   fsdp::dcp::save(sd, "ckpt/step-100");                  // stores loader->state_dict() under "loader."
//   fsdp::dcp::load(sd, "ckpt/step-100");                  // then calls loader->load_state_dict(...)
//
// Mirrors torch.distributed.checkpoint.stateful.Stateful, which dcp.save and dcp.load treat the same way.
#pragma once

#include <string>

#include "fsdp/checkpoint/state_dict.h"

namespace fsdp {

/// An object whose state a checkpoint carries. dcp::save and dcp::async_save call state_dict() on the
/// calling thread (async_save then copies what it returns, so the object may change right after) and
/// store its entries under "<key>." (key: where the object was inserted into the StateDict). dcp::load
/// calls state_dict() for destinations, loads into them (tensors in place, Values replaced, resharded as
/// any entry), then calls load_state_dict() with the loaded entries.
///
/// State that differs between ranks (a loader's position in its shard of the data) goes in per-rank
/// Values (fsdp::per_rank_value). Loading it on another world size cannot simply hand each rank its old
/// value: unless the object reshards (reshardable() true, load_state_dict_resharded() overridden), such
/// a load is refused before anything is loaded, naming the object.
/// Example: `sd.insert_or_assign("loader", std::make_shared<MyLoader>())`
class Stateful {
 public:
  virtual ~Stateful() = default;

  /// The object's state: tensors (loaded in place, so they should alias the object's own), Values,
  /// per-rank Values. Keys are relative ("position", not "loader.position"). Called on every rank, which
  /// must return the same keys in the same order.
  virtual StateDict state_dict() = 0;

  /// Restores the state from `state_dict`: the dict state_dict() returned, loaded (its tensors hold the
  /// checkpoint's data; its Values the checkpoint's values, per-rank ones this rank's own). Called on
  /// every rank after everything else was loaded; an exception propagates from dcp::load on that rank.
  virtual void load_state_dict(const StateDict& state_dict) = 0;

  /// Whether load_state_dict_resharded() handles per-rank Values saved by another world size.
  /// (Default: false: such a load is refused, naming the object.)
  virtual bool reshardable() const { return false; }

  /// Instead of load_state_dict() when the checkpoint's per-rank Values were saved by `saved_world_size`
  /// ranks and this job has `world_size`: each per-rank Value of `state_dict` holds the JSON array of
  /// every saving rank's value (index: saving rank); everything else is as for load_state_dict(). This
  /// rank (`rank`) computes its own state from them, e.g. a loader's new position from the total
  /// consumed. Only called when reshardable() is true; the default throws.
  virtual void load_state_dict_resharded(const StateDict& state_dict, int saved_world_size, int world_size, int rank);
};

}  // namespace fsdp
