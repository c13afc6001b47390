// What the step engine (train/step_engine.h) needs of a model besides its forward: the one
// parameter table, the MoE blocks, the backward, and the hooks around the weights. The language
// model (Transformer) and the classifier implement it; a new model that implements it (and a
// forward_micro overload in train/accumulate.h) trains through the same step and run loop.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/params.h"
#include "moe/moe_layer.h"

namespace moetrain {

// One MoE block of a model: the layer it sits in (tensor names model.layers.{layer}...), its
// tensors' offsets in the parameter table, and its MoE layer.
struct MoeBlockRef {
  int64_t layer = 0;
  MoeBlockOffsets offsets;
  MoeLayer* moe = nullptr;
};

// Fully sharded parameters (ZeRO-3, parallel/zero3_params.h): a model whose parameters are in
// place only around the work that reads them asks for each unit's (a flat range: the embedding, a
// block, the head) before it computes with them and lets them go after.
class ParamUnits {
 public:
  virtual ~ParamUnits() = default;
  // Unit u's parameters are in place when this returns. `next` (−1: none) is the unit the model
  // will ask for after it: its gather may start now, while u computes.
  virtual void acquire(int64_t unit, int64_t next) = 0;
  // Unit u's parameters are read no more until the next acquire.
  virtual void release(int64_t unit) = 0;
};

class TrainableModel {
 public:
  virtual ~TrainableModel() = default;

  virtual const ParamTable& param_table() const = 0;
  // The MoE layers, one per MoE block, in layer order.
  virtual std::vector<MoeLayer*> moe_layers() = 0;
  virtual std::vector<MoeBlockRef> moe_blocks() = 0;
  // grads += ∂(loss_weight · total)/∂params for the last forward (which had targets).
  virtual void backward(const float* params, float* grads, float loss_weight) = 0;
  // Called during backward whenever the gradients at flat offsets ≥ ready_from are final, so a
  // reduction can start while backward goes on. A model that never calls it is reduced after
  // its backward.
  virtual void set_grads_ready_hook(std::function<void(int64_t ready_from)> /*hook*/) {}
  // Where the model's gather units begin in the flat buffer (ascending, the first at 0), in the
  // order forward uses them; empty: the model cannot run on sharded parameters.
  virtual std::vector<int64_t> unit_starts() const { return {}; }
  // From now on every forward and backward asks `units` for each unit's parameters (null: the
  // parameters are whole). Not owned.
  virtual void set_param_units(ParamUnits* /*units*/) {}
  // The parameters changed in place (an optimizer step, a load): copies made of them are stale.
  virtual void weights_changed() {}
  // The low-precision weight copy for an optimizer step to write as it updates (none in f32).
  virtual LowPrecisionCopy lp_copy_of(const float* /*params*/) { return {}; }
  // After a step that wrote every parameter it changed into that copy: the copy stays current.
  virtual void weights_changed_copy_kept() {}
};

}  // namespace moetrain
