// The one micro-batch accumulation routine of every trainer (the LM trainer, the classifier, a
// parameter-server worker): zero the gradients, then for each of A micro-batches
//   fill → forward → loss finite check → (before the last backward: the overlap hook) →
//   backward with the loss weight
// summing the loss parts, the tokens each expert received, the dropped fractions and the
// all-to-all timings. What differs between trainers comes in as callbacks: how a micro-batch is
// filled (returning the batch the model's forward takes), which MoeStep it runs under (router
// noise is drawn per global token), and what a non-finite loss error says.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/comm.h"
#include "core/profile.h"
#include "model/classifier.h"
#include "model/transformer.h"
#include "moe/moe_layer.h"
#include "optim/sparse_experts.h"
#include "train/stop_signal.h"

namespace moetrain {

// One micro-batch of token windows: inputs, targets (B, T).
struct TokenBatch {
  const int32_t* inputs = nullptr;
  const int32_t* targets = nullptr;
  int64_t B = 0, T = 0;
};

// One micro-batch of images: inputs (N, D), labels (N). Read again by backward.
struct ImageBatch {
  const float* inputs = nullptr;
  const int32_t* labels = nullptr;
  int64_t N = 0;
};

// A micro-batch's loss parts; correct: rows whose arg-max is the label (classifier only).
struct MicroLoss {
  LossParts parts;
  int64_t correct = 0;
};

MicroLoss forward_micro(Transformer& model, const float* params, const TokenBatch& batch,
                        const MoeStep& step);
MicroLoss forward_micro(Classifier& model, const float* params, const ImageBatch& batch,
                        const MoeStep& step);

// The MoeStep of micro-batch `micro` of training step `step` (A micro-batches a step): numbered
// step·A + micro, and a process's rows start at token `token_offset` of the step's global batch,
// so that router noise is the same however the batch is split over processes.
MoeStep micro_batch_step(uint64_t seed, int64_t step, int64_t micro_batches, int64_t micro,
                         int64_t token_offset);

// Everything of a step's accumulation but its batches (the step engine sets these).
struct AccumulateHooks {
  int64_t micro_batches = 1;  // A
  // backward's weight of each micro-batch's total loss (1/(A·W), times the fp16 loss scale).
  float loss_weight = 1;
  // Each layer's dropped fraction is summed divided by this (A·W: the mean over every process's
  // micro-batches once summed over processes).
  double dropped_divisor = 1;
  std::function<MoeStep(int64_t micro)> moe_step;
  // Called right before the last micro-batch's backward (overlapped gradient reduction). May be
  // empty.
  std::function<void()> before_last_backward;
  // Called right before and right after each micro-batch's backward but the last (ZeRO-2 reduces
  // every micro-batch's gradients). May be empty.
  std::function<void(int64_t micro)> before_backward, after_backward;
  // Zeroes the gradients in place of filling the host buffer with zeros: where they live elsewhere
  // (a resident device, which leaves the host buffer alone), or where the buffer skips
  // pages it handed back (ZeRO-2). May be empty.
  std::function<void()> zero_grads;
  // Sparse expert gradients: each micro-batch's routing is recorded here right after its forward
  // (so that before_last_backward can agree on the mask). May be null.
  SparseExperts* sparse = nullptr;
  // The error text for a non-finite loss (what stopped, what to do). Called only then.
  std::function<std::string(const LossParts&)> bad_loss;
  // Asked before each micro-batch after the first: true abandons the step there (a stop was
  // requested; a step of many micro-batches would keep it waiting). Collective where the step
  // is. May be empty.
  std::function<bool()> stop_between;
};

template <class Batch>
struct AccumulateArgs : AccumulateHooks {
  std::function<Batch(int64_t micro)> fill;
};

struct Accumulated {
  LossParts loss;       // ce, aux, z, total: means over the micro-batches; targets: summed
  int64_t correct = 0;  // summed (classifier)
  std::vector<std::vector<int64_t>> tokens_per_expert;  // (MoE layers, E) summed
  std::vector<double> dropped;                          // (MoE layers) Σ fraction / divisor
  // (MoE layers) capacity slots (E · capacity; the rows computed when dropless) and the
  // assignments the experts computed, summed; the capacity factor in effect.
  std::vector<int64_t> capacity_slots, computed;
  std::vector<double> capacity_factor;
  double a2a_s = 0, a2a_wait_s = 0;                     // summed over layers and micro-batches
  int64_t a2a_bytes = 0;  // sent by this process in the exchanges, summed likewise
  StopVotes stop;  // signals asking to stop, summed over processes by reduce_step_figures
  // ≥ 0: stop_between abandoned the step after this many micro-batches; nothing else is set.
  int64_t abandoned_after = -1;

  // Zeroed figures for `layers` MoE layers of `experts` experts each.
  static Accumulated for_layers(std::size_t layers, int64_t experts) {
    Accumulated a;
    a.dropped.assign(layers, 0.0);
    a.capacity_slots.assign(layers, 0);
    a.computed.assign(layers, 0);
    a.capacity_factor.assign(layers, 0.0);
    a.tokens_per_expert.assign(layers,
                               std::vector<int64_t>(static_cast<std::size_t>(experts), 0));
    return a;
  }
};

// grads (n) = Σ over micro-batches of ∂(loss_weight · total)/∂params.
template <class Model, class Batch>
Accumulated accumulate(Model& model, const float* params, float* grads, int64_t n,
                       const AccumulateArgs<Batch>& args);

// Collective over comm: the aux-loss-free router's bias update from the load every process's
// micro-batches gave each expert (E per layer), the same on every process.
void update_router_biases(const std::vector<MoeLayer*>& moe, int64_t E, Comm& comm);

// --- implementation ------------------------------------------------------------------------------

namespace detail {
// Adds the MoE layers' figures of the last forward to acc; null entries (layers that did not
// run on this process) add nothing.
void accumulate_stats(const std::vector<MoeLayer*>& moe, double dropped_divisor, Accumulated& acc);
}  // namespace detail

template <class Model, class Batch>
Accumulated accumulate(Model& model, const float* params, float* grads, int64_t n,
                       const AccumulateArgs<Batch>& args) {
  const int64_t A = args.micro_batches;
  MOETRAIN_CHECK(A > 0, "accumulate: {} micro-batches, needs at least one", A);
  {
    PhaseScope zero(Phase::GradZero);
    if (args.zero_grads) {
      args.zero_grads();
    } else if (args.sparse) {
      args.sparse->zero_grads(grads, n);
    } else {
      std::fill(grads, grads + n, 0.0f);
    }
  }
  const std::vector<MoeLayer*> moe = model.moe_layers();
  Accumulated acc = Accumulated::for_layers(moe.size(), model.config().n_experts);
  LossParts& sum = acc.loss;
  if (args.sparse) args.sparse->start_step();
  for (int64_t micro = 0; micro < A; ++micro) {
    if (micro > 0 && args.stop_between && args.stop_between()) {
      acc.abandoned_after = micro;
      return acc;
    }
    const Batch batch = args.fill(micro);
    const MicroLoss p = forward_micro(model, params, batch, args.moe_step(micro));
    MOETRAIN_CHECK(std::isfinite(p.parts.total), "{}", args.bad_loss(p.parts));
    if (args.sparse) {
      for (std::size_t m = 0; m < moe.size(); ++m)
        args.sparse->record(micro, static_cast<int64_t>(m),
                            moe[m]->stats().tokens_per_expert.data());
    }
    // The last micro-batch's backward finishes the gradients: reduction may start now.
    const bool last = micro == A - 1;
    if (last && args.before_last_backward) args.before_last_backward();
    if (!last && args.before_backward) args.before_backward(micro);
    model.backward(params, grads, args.loss_weight);
    if (!last && args.after_backward) args.after_backward(micro);
    sum.ce += p.parts.ce / A, sum.aux += p.parts.aux / A, sum.z += p.parts.z / A;
    sum.total += p.parts.total / A;
    sum.targets += p.parts.targets;
    acc.correct += p.correct;
    detail::accumulate_stats(moe, args.dropped_divisor, acc);
  }
  return acc;
}

}  // namespace moetrain
