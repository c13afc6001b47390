#include "parallel/mpi_exchange.h"

#include <algorithm>

#include "core/check.h"
#include "core/fault.h"
#include "core/profile.h"
#include "core/timer.h"

namespace moetrain {

MpiExchange::MpiExchange(const A2aRoute& route, const MpiExchangeOptions& opts)
    : route_(route), opts_(opts) {
  MOETRAIN_CHECK(route_.group != nullptr, "MpiExchange: the route has no EP group");
  MOETRAIN_CHECK(opts_.chunks >= 1, "all-to-all chunks = {}: must be at least 1", opts_.chunks);
  MOETRAIN_CHECK(opts_.wire == DType::F32 || opts_.wire == DType::BF16,
                 "all-to-all payloads in {}: allowed are f32 and bf16", dtype_name(opts_.wire));
  MOETRAIN_CHECK(opts_.ranks_per_node >= 0, "all-to-all ranks per node = {}: must be >= 0",
                 opts_.ranks_per_node);
  ranks_per_node_ = opts_.ranks_per_node;
  if (ranks_per_node_ == 0 && route_.two_d()) ranks_per_node_ = route_.intra->size();
  if (opts_.adaptive) {
    MOETRAIN_CHECK(route_.two_d(), "MpiExchange: the adaptive route needs a 2-D route");
    chooser_ = std::make_unique<RouteChooser>(*opts_.adaptive);
    const int nodes = route_.inter->size();
    relay_.assign(static_cast<std::size_t>(nodes) * nodes, chooser_->relayed() ? 1 : 0);
    route_.relay = &relay_;
  }
}

void MpiExchange::begin_step(int64_t step) {
  if (!chooser_) return;
  step_ = step;
  step_relayed_ = chooser_->relayed_at(step);
  std::fill(relay_.begin(), relay_.end(), step_relayed_ ? 1 : 0);
  route_s_ = 0;
  route_calls_ = 0;
}

std::optional<RouteFigures> MpiExchange::end_step() {
  if (!chooser_) return std::nullopt;
  // The least time any rank of the group spent in the step's exchanges (every rank ran the same
  // number): a rank's time also holds its wait for the last rank to arrive, and the last one's
  // is closest to what the path itself costs. Reduced exactly: the same on every rank.
  double sums[2] = {0, 0};
  auto reduce = [&] {
    sums[0] = -route_s_, sums[1] = static_cast<double>(route_calls_);
    route_.group->allreduce(sums, 2, {.op = ReduceOp::Max});
    sums[0] = -sums[0];
  };
  if (opts_.thread) {
    opts_.thread->wait(opts_.thread->post(reduce));
  } else {
    reduce();
  }
  RouteFigures f;
  f.relayed = step_relayed_ ? 1.0 : 0.0;
  f.probe = chooser_->probe(step_);
  if (sums[1] > 0) {
    f.measured_s = sums[0] / sums[1];
    const int64_t before = chooser_->switches();
    chooser_->observe(step_, f.measured_s);
    f.switched = chooser_->switches() != before;
  }
  f.direct_s = chooser_->estimate(false);
  f.relayed_s = chooser_->estimate(true);
  f.next_relayed = chooser_->relayed();
  return f;
}

ExpertOwnership MpiExchange::ownership() const {
  return {route_.group->size(), route_.group->rank()};
}

ExpertExchange::Ticket MpiExchange::post(std::function<void()> work) {
  auto timed = [this, work = std::move(work)] {
    ScopedTimer timer(times_.busy);
    work();
  };
  if (opts_.thread) return opts_.thread->post(std::move(timed));
  PhaseScope phase_scope(Phase::Exchange);  // the routing counts' exchange included
  ScopedTimer timer(times_.waited);
  timed();
  return 0;
}

void MpiExchange::wait(Ticket t) {
  if (!opts_.thread || t == 0) return;
  PhaseScope phase_scope(Phase::Exchange);
  ScopedTimer timer(times_.waited);
  opts_.thread->wait(t);
}

ExchangeTimes MpiExchange::take_times() {
  const ExchangeTimes t = times_;
  times_ = {};
  return t;
}

void MpiExchange::plan(ExchangeLayout& layout, const int64_t* counts, int64_t E, int64_t C) {
  a2a_plan(layout, route_, counts, E, C);
  // E/P counts to each other rank; a 2-D route also gathers every rank's P row totals.
  const int64_t P = layout.P, word = static_cast<int64_t>(sizeof(int64_t));
  times_.bytes += (P - 1) * (E / P) * word + (route_.two_d() ? (P - 1) * P * word : 0);
}

const float* MpiExchange::exchange(Move move, const float* in, const ExchangeLayout& layout,
                                   int64_t rows, FloatBuffer& out) {
  if (layout.P == 1) return in;
  float* to = out.ensure(rows * layout.C);
  if (chooser_) {
    const Timer timer;
    fault_route_exchange(step_relayed_, step_);
    move(to, in, layout, route_, scratch_, opts_.wire);
    route_s_ += timer.seconds();
    ++route_calls_;
  } else {
    move(to, in, layout, route_, scratch_, opts_.wire);
  }
  // A dispatch sends this process's routed rows out; a combine sends its experts' rows back.
  const std::vector<int64_t>& sent = move == &a2a_dispatch ? layout.send_rows : layout.recv_rows;
  const int64_t row_bytes = layout.C * static_cast<int64_t>(dtype_size(opts_.wire));
  // A 2-D route relays rows inside a node once more; those relays are not counted again.
  int64_t others = 0;
  for (int q = 0; q < layout.P; ++q) others += q != route_.group->rank() ? sent[q] : 0;
  times_.bytes += others * row_bytes;
  if (ranks_per_node_ > 0) {
    const int me = route_.group->rank() / ranks_per_node_;
    int64_t n = 0;
    for (int q = 0; q < layout.P; ++q) n += q / ranks_per_node_ != me ? sent[q] : 0;
    cross_node_bytes_ += n * layout.C * static_cast<int64_t>(dtype_size(opts_.wire));
  }
  return to;
}

const float* MpiExchange::dispatch(const float* send, const ExchangeLayout& layout,
                                   FloatBuffer& recv) {
  PhaseScope phase_scope(Phase::Exchange);
  return exchange(&a2a_dispatch, send, layout, layout.R_recv, recv);
}

const float* MpiExchange::combine(const float* rows, const ExchangeLayout& layout,
                                  FloatBuffer& back) {
  PhaseScope phase_scope(Phase::Exchange);
  return exchange(&a2a_combine, rows, layout, layout.R_send, back);
}

}  // namespace moetrain
