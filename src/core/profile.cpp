#include "core/profile.h"

#include <omp.h>

#include <chrono>
#include <thread>
#include <vector>

namespace moetrain {

namespace {

using Clock = std::chrono::steady_clock;

struct Frame {
  Phase phase;
  Clock::time_point start;
  double children = 0;  // seconds spent in nested phases
};

std::thread::id g_owner;
PhaseTable g_table;
std::vector<Frame> g_stack;

}  // namespace

namespace profile::detail {
std::atomic<bool> g_on{false};
}  // namespace profile::detail

std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::Data: return "data";
    case Phase::GradZero: return "grad zeroing";
    case Phase::Embedding: return "embedding";
    case Phase::Norm: return "rmsnorm";
    case Phase::Rope: return "rope";
    case Phase::Attention: return "attention core";
    case Phase::Gemm: return "dense gemm";
    case Phase::Activation: return "activation";
    case Phase::Router: return "router";
    case Phase::Dispatch: return "permute/combine";
    case Phase::Exchange: return "all-to-all";
    case Phase::Experts: return "experts (fwd, bwd data)";
    case Phase::ExpertWgrad: return "experts weight grads";
    case Phase::Convert: return "dtype conversion";
    case Phase::Loss: return "cross-entropy";
    case Phase::Optimizer: return "optimizer";
    case Phase::Collective: return "collectives";
    case Phase::GradReduce: return "gradient reduction";
    case Phase::ParamGather: return "parameter gather";
    case Phase::kCount: break;
  }
  return "?";
}

namespace profile {

void start() {
  g_owner = std::this_thread::get_id();
  g_table = {};
  g_stack.clear();
  detail::g_on.store(true);
}

PhaseTable stop() {
  detail::g_on.store(false);
  g_stack.clear();
  return g_table;
}

}  // namespace profile

void PhaseScope::enter(Phase p, bool outermost_only) {
  // Inside any parallel construct, active or not (one thread, or an `if` that kept it serial):
  // the time belongs to the phase around the construct, however many threads run it.
  if (omp_get_level() > 0 || std::this_thread::get_id() != g_owner) return;
  if (outermost_only && !g_stack.empty()) return;
  active_ = true;
  g_stack.push_back({p, Clock::now()});
}

void PhaseScope::leave() {
  if (g_stack.empty()) return;  // stopped while inside
  const Frame f = g_stack.back();
  g_stack.pop_back();
  const double total = std::chrono::duration<double>(Clock::now() - f.start).count();
  PhaseTotals& t = g_table[static_cast<std::size_t>(f.phase)];
  t.seconds += total - f.children;
  ++t.calls;
  if (!g_stack.empty()) g_stack.back().children += total;
}

}  // namespace moetrain
