// The pipeline-parallel micro-batch phase of a step (dist.pp > 1). The language model's blocks are
// cut into dist.pp stages of contiguous blocks, one per process of a pipe: the first stage also
// embeds the tokens, the last also holds the final norm, the head and the loss. Each process runs
// its stage's passes in the order parallel/pipeline_schedule.h gives (stage_ops):
//
//   F(i)  receive micro-batch i's activation from the previous stage (the first embeds its
//         tokens), run the stage's forward, send the output on
//   B(i)  receive the gradient of that output from the next stage (the last starts from its
//         loss), run the stage's backward (parameter gradients +=), send the input's gradient
//         back
//
// A micro-batch keeps its activations from its forward to its backward in an activation slot: a
// model object of the stage's blocks of its own (gpipe holds every micro-batch of the step,
// 1f1b at most p − s on stage s). Slot 0 is the trainer's model, the one the step engine's
// controllers see; the others take its MoE layers' router biases and capacity factors before
// each forward. Sends are nonblocking (a stage sends its output and goes on to its next pass;
// blocking sends deadlock 1F1B's steady state); receives wait, polling with short sleeps, for a
// neighbour that is still computing.
//
// A stage's gradients accumulate over the micro-batches in micro-batch order, as the
// one-process accumulation does, so each parameter gradient has the same bits as there.
//
// With several pipelines, a stage's copies are its data-parallel ranks and, under dist.ep > 1,
// its expert-parallel groups (train/parallel_setup.h): the MoE layers of every slot run with the
// exchange over the stage's EP group, whose ranks all run this stage's schedule. Under
// dist.overlap the copies reduce the stage's gradient buckets on the communication thread while
// the stage's last backward runs (every slot calls the model's grads-ready hook); MPI runs
// SERIALIZED, so from then on the stage's last send and the waits for its earlier ones go
// through that thread too, behind the buckets already posted.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "model/transformer.h"
#include "io/trace_events.h"
#include "parallel/comm_thread.h"
#include "parallel/pipeline_schedule.h"
#include "train/accumulate.h"
#include "train/parallel_setup.h"

namespace moetrain {

// Blocks [first, end) of stage s of p over L blocks: an even split, the first L mod p stages one
// block more (the last stage carries the head and the loss besides its blocks).
std::pair<int64_t, int64_t> pipe_stage_blocks(int64_t L, int64_t p, int64_t s);

// The flat range [offset, offset + size) of the parameters stage s of p holds (its blocks; the
// embedding on the first; the final norm and the head on the last).
struct PipeParams {
  int64_t offset = 0, size = 0;
};
PipeParams pipe_stage_params(const Transformer& model, int64_t p, int64_t s);

class PipelineRunner {
 public:
  // model: the trainer's model, set_stage'd to this stage's blocks; ctx: what its MoE layers run
  // with (the slots' layers run with it too: statistics over the stage's copies).
  PipelineRunner(PipeSetup setup, Transformer& model, const MoeContext& ctx);
  ~PipelineRunner();

  int64_t stage() const { return setup_.stage; }
  int64_t stages() const { return setup_.stages; }
  int64_t replica() const { return setup_.replica; }
  int64_t replicas() const { return setup_.replicas; }
  PipeSchedule schedule() const { return setup_.schedule; }
  // Activation slots this stage uses for A micro-batches a step; the slots it has made so far.
  int64_t slots(int64_t micro_batches) const;
  int64_t slots_made() const { return 1 + static_cast<int64_t>(extra_.size()); }
  // The communication thread the stage copies' reduction overlaps the last backward on (null:
  // it runs after accumulate(), and the pipe's calls stay on the calling thread).
  void set_overlap(CommThread* thread) { overlap_ = thread; }

  // The micro-batch phase: grads (n) = Σ over micro-batches of this stage's parameter gradients
  // of loss_weight · total. The loss parts are this stage's (cross-entropy and targets on the
  // last stage only; each stage its MoE layers' shares of aux and z), as are the MoE figures
  // (other stages' layers stay zero): summed over the pipe they are the whole model's.
  Accumulated accumulate(Transformer& model, const float* params, float* grads, int64_t n,
                         const AccumulateArgs<TokenBatch>& args);
  // Collective over the pipe: the passes of the last accumulate() on every stage as a trace
  // (parallel/pipeline_trace.h: one lane a stage), seconds from the earliest pass; every stage
  // returns it. A pass runs from the moment its input is there (its receive done) to the end of
  // its compute, so a stage's waits are its idle time. The stages' times are the machine's
  // monotonic clock: on one host they agree; across hosts each stage's offset is unknown.
  TraceFile last_step_trace(const std::string& title);

  // A forward without backward through the pipe (evaluation): the last stage's loss parts,
  // zeros elsewhere.
  LossParts forward_only(Transformer& model, const float* params, const int32_t* inputs,
                         const int32_t* targets, int64_t B, int64_t T, const MoeStep& step);

 private:
  Transformer& slot_model(Transformer& model, int64_t k);
  // Slot k's MoE layers take the trainer's model's router biases and capacity factors.
  void sync_slot(Transformer& model, int64_t k);

  PipeSetup setup_;
  MoeContext ctx_;
  std::vector<std::unique_ptr<Transformer>> extra_;  // slots 1, 2, …
  std::vector<float> act_in_, grad_in_;               // (B·T, C) receive buffers
  std::vector<PipeEvent> events_;                     // the last accumulate()'s passes
  CommThread* overlap_ = nullptr;
};

}  // namespace moetrain
