// Pipeline schedules: the order in which each pipeline stage runs the forward, backward and
// weight-gradient passes of a step's micro-batches, and a timeline of that order under given
// pass costs (the bubble, each stage's activations in flight).
//
// The model's layers are cut into p·vp contiguous chunks; chunk c runs on stage c mod p (with
// vp > 1, stage s holds chunks s, s + p, s + 2p, …: Megatron's interleaving). A micro-batch's
// forward runs the chunks in order, its backward in reverse; the activations cross from stage to
// stage point to point.
//
//   gpipe        every forward, then every backward: m micro-batches' activations in flight
//   1f1b         p − s − 1 forwards to fill the pipe, then one forward and one backward in turn,
//                then the remaining backwards: at most p − s in flight on stage s
//   interleaved  1F1B over vp chunks per stage (m a multiple of p): the fill and the drain are
//                vp times shorter, for vp times more point-to-point sends
//   zero_bubble  ZB-H1: each backward split into its input-gradient pass (B, which the stage
//                before waits for) and its weight-gradient pass (W, which nobody waits for);
//                stage s runs its W passes s micro-batches late, so the input gradients travel
//                back sooner and the W passes fill the drain. With equal passes the bubble is a
//                third of 1F1B's. In flight: at most p micro-batches on any stage, the first
//                stage's count under 1F1B (a micro-batch's activations go after its W).
//                With vp > 1 (m a multiple of p) the same on the interleaved order: each
//                backward split into B and W, stage s's W passes as many backwards late as it
//                runs fewer warm-up forwards than stage 0 (2s when m > p), so no stage holds
//                more chunks than stage 0 holds under interleaved; the W passes fill the drain
//
// A stage runs its list in order; every list here is deadlock-free (simulate() checks).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

enum class PipeSchedule { GPipe, OneFOneB, Interleaved, ZeroBubble };

// "gpipe", "1f1b", "interleaved", "zero_bubble"; parse throws naming `key`, the value and what is
// allowed.
std::string_view pipe_schedule_name(PipeSchedule s);
PipeSchedule parse_pipe_schedule(std::string_view value, std::string_view key);

struct PipeShape {
  int64_t stages = 1;          // p
  int64_t micro_batches = 1;   // m, per step
  int64_t virtual_stages = 1;  // vp: model chunks per stage (interleaved and zero_bubble)
  int64_t chunks() const { return stages * virtual_stages; }
};

// Why the schedule cannot run this shape (too few micro-batches, train.grad_accum, for the
// stages, or with virtual stages not a multiple of them; virtual stages under gpipe or 1f1b);
// empty when it can.
std::string pipe_shape_problem(PipeSchedule s, const PipeShape& shape);

struct PipeOp {
  // Forward; Backward: the input and weight gradients together (every schedule but zero_bubble),
  // or the input gradient alone (zero_bubble); Weight: zero_bubble's weight gradient.
  enum Kind : uint8_t { Forward, Backward, Weight };
  Kind kind = Forward;
  int64_t micro = 0;
  int64_t chunk = 0;  // the model chunk, 0 … p·vp − 1 (on stage chunk mod p)
  friend bool operator==(const PipeOp&, const PipeOp&) = default;
};

// Stage s's passes in the order it runs them. Throws what pipe_shape_problem says.
std::vector<PipeOp> stage_ops(PipeSchedule s, const PipeShape& shape, int64_t stage);

// Seconds one pass of one micro-batch takes on one chunk: forward; backward, the input-gradient
// part; weight, the weight-gradient part (a schedule that does not split them runs one pass of
// backward + weight seconds); send: an activation (or its gradient) from one stage to the next.
struct PipeCosts {
  double forward = 1, backward = 1, weight = 1, send = 0;
};

struct PipeEvent {
  PipeOp op;
  double start = 0, end = 0;
};

struct PipeTimeline {
  std::vector<std::vector<PipeEvent>> stages;  // (p) each stage's passes as they ran
  double makespan = 0;                         // the step, from the first pass to the last
  std::vector<double> idle;                    // (p) idle seconds of each stage within it
  // (p) the most micro-batch chunks whose forward ran and whose activations are still held
  // (until the backward, or under zero_bubble the weight pass), in micro-batches' worth of the
  // stage's layers (chunks / vp).
  std::vector<double> peak_in_flight;
  // The idle share of the step over every stage: Σ idle / (p · makespan).
  double bubble() const;
};

// Every stage running its stage_ops list in order, each pass as soon as its inputs are there.
// Throws if a list deadlocks (a pass waits for one that waits for it).
PipeTimeline simulate(PipeSchedule s, const PipeShape& shape, const PipeCosts& costs);
// The same for lists given per stage (tests hand it lists of their own).
PipeTimeline simulate(const std::vector<std::vector<PipeOp>>& ops, const PipeShape& shape,
                      const PipeCosts& costs, bool split_backward);

}  // namespace moetrain
