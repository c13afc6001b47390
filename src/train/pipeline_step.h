// The pipeline-parallel micro-batch phase of a step (dist.pp > 1). The language model's blocks are
// cut into p·vp chunks of contiguous blocks (vp = dist.vp, 1 but under the interleaved schedule
// and zero_bubble on its order);
// chunk c runs on stage c mod p, so stage s holds chunks s, s + p, …, s + (vp − 1)p. Chunk 0 also
// embeds the tokens, the last chunk also holds the final norm, the head and the loss. Each process
// runs its stage's passes in the order parallel/pipeline_schedule.h gives (stage_ops):
//
//   F(i, c)  receive micro-batch i's activation from chunk c − 1's stage (chunk 0 embeds its
//            tokens), run chunk c's forward, send the output on to chunk c + 1's stage
//   B(i, c)  receive the gradient of that output from chunk c + 1's stage (the last chunk starts
//            from its loss), run chunk c's backward (parameter gradients +=), send the input's
//            gradient back to chunk c − 1's stage; under zero_bubble the input gradients and
//            the gradients of the MoE layers and norms only (Transformer::set_split_backward)
//   W(i, c)  zero_bubble: the weight gradients of the dense linears micro-batch i's backward
//            deferred (Transformer::weight_backward); nothing is sent
//
// A micro-batch keeps each chunk's activations from its forward to its backward in an activation
// slot of that chunk: a model object of the chunk's blocks of its own (gpipe holds every
// micro-batch of the step, 1f1b at most p − s on stage s, zero_bubble p — with chunks, at most
// the chunks interleaved's first stage holds — each slot kept until its W). Slot 0 of the stage's first chunk is
// the trainer's model, the one the step engine's controllers see (its MoE layer objects exist for
// every layer); the others take its MoE layers' router biases and capacity factors before each
// forward and hand it their routing counts after the step. Sends are nonblocking and own a copy
// of what they send, so a slot is free again as soon as its backward (zero_bubble: its W) ran,
// and a stage waits only for the receives its schedule orders (the order simulate() proves
// deadlock-free); receives wait, polling with short sleeps, for a neighbour still computing.
//
// A chunk's gradients accumulate over the micro-batches in micro-batch order (every schedule
// runs a chunk's backwards, and zero_bubble its weight passes, in ascending order), as the
// one-process accumulation does, so each parameter gradient has the same bits as there.
//
// Under ZeRO-3 (dist.zero = 3, parallel/zero3_params.h) the stage's parameters are sharded over
// its copies, and every slot's model gathers each unit of its chunk where its forward and its
// backward use it and releases it after (a training forward's head stays until its backward);
// the weight pass reads activations and output gradients only, so it gathers nothing. The
// gathers are collective over the stage's copies, which run the same passes in the same order.
//
// With several pipelines, a stage's copies are its data-parallel ranks and, under dist.ep > 1,
// its expert-parallel groups (train/parallel_setup.h): the MoE layers of every slot run with the
// exchange over the stage's EP group, whose ranks all run this stage's schedule. Under
// dist.overlap the copies reduce the stage's gradient buckets on the communication thread while
// the stage's last backward runs (under zero_bubble its last weight pass, which follows every
// backward; every slot calls the model's grads-ready hook); MPI runs
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

// Blocks [first, end) of part s of p over L blocks: an even split, the first L mod p parts one
// block more (the last carries the head and the loss besides its blocks). The parts are the
// stages (vp = 1), or the p·vp model chunks.
std::pair<int64_t, int64_t> pipe_stage_blocks(int64_t L, int64_t p, int64_t s);

// The model chunks stage s of p holds with vp chunks a stage: s, s + p, …, s + (vp − 1)p.
std::vector<int64_t> pipe_stage_chunks(int64_t p, int64_t vp, int64_t s);

// (L) 1 for each of the L blocks stage s of p holds with vp chunks a stage.
std::vector<char> pipe_stage_layers(int64_t L, int64_t p, int64_t vp, int64_t s);

// The flat ranges of the parameters stage s of p holds with vp chunks a stage, ascending and
// disjoint: each chunk's blocks, the embedding with chunk 0, the final norm and the head with the
// last chunk (one range when vp = 1).
std::vector<FlatRange> pipe_stage_params(const Transformer& model, int64_t p, int64_t vp,
                                         int64_t s);

class PipelineRunner {
 public:
  // model: the trainer's model, set_stage'd to the blocks of this stage's first chunk; ctx: what its MoE layers run
  // with (the slots' layers run with it too: statistics over the stage's copies).
  PipelineRunner(PipeSetup setup, Transformer& model, const MoeContext& ctx);
  ~PipelineRunner();

  int64_t stage() const { return setup_.stage; }
  int64_t stages() const { return setup_.stages; }
  int64_t replica() const { return setup_.replica; }
  int64_t replicas() const { return setup_.replicas; }
  PipeSchedule schedule() const { return setup_.schedule; }
  // zero_bubble: backward passes compute input gradients, weight passes the deferred weight
  // gradients (Transformer::set_split_backward on every slot).
  bool splits_backward() const { return setup_.schedule == PipeSchedule::ZeroBubble; }
  int64_t chunks_per_stage() const { return setup_.chunks_per_stage; }
  // The pipe's processes (rank q = stage q), one of each stage.
  Comm& pipe_comm() const { return *setup_.comm; }
  // Activation slots this stage uses for A micro-batches a step, the most of any of its chunks;
  // the most slots any of its chunks has made so far.
  int64_t slots(int64_t micro_batches) const;
  int64_t slots_made() const;
  // The communication thread the stage copies' reduction overlaps the last backward on (null:
  // it runs after accumulate(), and the pipe's calls stay on the calling thread).
  void set_overlap(CommThread* thread) { overlap_ = thread; }
  // ZeRO-3 (parallel/zero3_params.h): every activation slot's model, made or still to be made,
  // asks `units` for each unit it computes with (the trainer's model is the step engine's to
  // set); null: the parameters are whole.
  void set_param_units(ParamUnits* units);

  // The micro-batch phase: grads (n) = Σ over micro-batches of this stage's parameter gradients
  // of loss_weight · total. The loss parts are this stage's (cross-entropy and targets on the
  // last stage only; each stage its MoE layers' shares of aux and z), as are the MoE figures
  // (other stages' layers stay zero): summed over the pipe they are the whole model's.
  // args.sparse records each forward's routing of this stage's MoE layers under its micro-batch.
  // Of the reducer's hooks only args.before_last_backward runs (before the pass that makes the
  // stage's gradients final); before_backward and after_backward do not: a micro-batch's backward
  // leaves no gradient final while other micro-batches' passes still add to it, so every reducer,
  // ZeRO-2's too, reduces the stage's accumulated gradients once a step.
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
  // Slot k of the stage's local chunk j (chunk stage + j·stages); slot 0 of chunk 0 is `model`.
  Transformer& slot_model(Transformer& model, int64_t j, int64_t k);
  // A slot's MoE layers take the trainer's model's router biases and capacity factors.
  void sync_slot(Transformer& model, Transformer& slot);
  // The slot models made so far, the trainer's model not among them.
  std::vector<Transformer*> made();
  // A nonblocking send of a copy of data[0, floats) (the slot it comes from may run again before
  // the neighbour takes it); every send of the step is waited for at its end.
  void send(const float* data, int64_t floats, int peer, int tag);

  PipeSetup setup_;
  MoeContext ctx_;
  // (vp) each local chunk's slot models: chunk 0's from slot 1, the others' from slot 0.
  std::vector<std::vector<std::unique_ptr<Transformer>>> slots_;
  std::vector<std::vector<float>> send_copies_;  // one per send of the step, kept for the next
  std::vector<std::unique_ptr<Transfer>> sending_;
  std::vector<float> act_in_, grad_in_;               // (B·T, C) receive buffers
  std::vector<PipeEvent> events_;                     // the last accumulate()'s passes
  CommThread* overlap_ = nullptr;
  ParamUnits* units_ = nullptr;  // ZeRO-3's gathers, which every slot's model asks (null: none)
};

}  // namespace moetrain
