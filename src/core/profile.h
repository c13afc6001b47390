// Per-phase time of a training step: where the time goes outside (and inside) the GEMMs.
// Off by default: a disabled scope costs one load of a flag. When on, only the thread that turned
// it on records, and only outside OpenMP parallel regions, active or not (a phase is timed by the
// thread that enters it, around the whole parallel region it starts; a region that one thread
// runs, or that its `if` kept serial, counts the same as one that a team runs). Time is
// exclusive: a phase nested in another counts once, in the inner one.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace moetrain {

enum class Phase : int {
  Data,        // filling a batch from the token shard
  GradZero,    // zeroing the gradient buffer
  Embedding,   // token embedding forward and backward
  Norm,        // RMSNorm forward and backward
  Rope,        // rotary position embedding
  Attention,   // the attention core (scores, softmax, weighted sum), not its projections
  Gemm,        // dense GEMMs: attention projections, dense FFN, LM head, router logits
  Activation,  // SwiGLU / SiLU outside the experts' fused loop
  Router,      // routing: scores, top-k, capacity, balance losses
  Dispatch,    // permute / combine of token rows
  Exchange,    // expert all-to-all (blocking part, or the wait for the communication thread)
  Experts,     // the grouped SwiGLU experts: GEMMs, activation and rounding of their operands
  ExpertWgrad, // the experts' weight-gradient GEMMs
  Convert,     // f32 <-> bf16 / fp16 conversions (low-precision weight copies, operands)
  Loss,        // softmax cross-entropy
  Optimizer,   // the optimizer step over the parameter buffer
  Collective,  // a collective on this thread outside an exchange or the gradient reduction
               // (balance statistics, non-finite check, norm, metrics), late peers' waits included
  GradReduce,  // the gradient reduction's blocking part, or the wait for the communication thread
  ParamGather, // ZeRO-3's parameter gathers: blocking, or the wait for the communication thread
  kCount
};

std::string_view phase_name(Phase p);

struct PhaseTotals {
  double seconds = 0;  // exclusive
  int64_t calls = 0;
};
using PhaseTable = std::array<PhaseTotals, static_cast<std::size_t>(Phase::kCount)>;

namespace profile {

namespace detail {
extern std::atomic<bool> g_on;
}  // namespace detail

// Starts recording on the calling thread (and clears what was recorded).
void start();
// Stops recording; returns the table.
PhaseTable stop();
inline bool on() {
  return detail::g_on.load(std::memory_order_relaxed);
}

}  // namespace profile

class PhaseScope {
 public:
  explicit PhaseScope(Phase p) {
    if (profile::on()) enter(p, false);
  }
  // Recorded only where no other phase is open: inside one, the time is the enclosing phase's
  // (a collective that an exchange or the gradient reduction makes counts as theirs).
  struct OutermostOnly {};
  PhaseScope(Phase p, OutermostOnly) {
    if (profile::on()) enter(p, true);
  }
  ~PhaseScope() {
    if (active_) leave();
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  void enter(Phase p, bool outermost_only);
  void leave();
  bool active_ = false;
};

}  // namespace moetrain
