// The expert exchange over an MPI expert-parallel group (moe/exchange.h): plan, dispatch and
// combine are the all-to-alls of parallel/alltoall.h over a flat or 2-D route, optionally with
// bf16 rows on the wire, run on a communication thread when there is one (overlap) or inline.
// A group of one process moves no rows (nothing is rounded to the wire type either).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/dtype.h"
#include "moe/exchange.h"
#include "parallel/adaptive_route.h"
#include "parallel/alltoall.h"
#include "parallel/comm_thread.h"

namespace moetrain {

struct MpiExchangeOptions {
  int chunks = 1;                // token chunks per exchange (≥ 1)
  CommThread* thread = nullptr;  // runs the exchanges when set (must outlive the exchange)
  // Element type of the token rows and their gradients on the wire (F32 or BF16, half the
  // bytes). In bf16 the rows arrive rounded; the experts and the combine still compute in f32
  // (or in the model's precision).
  DType wire = DType::F32;
  // Node size for counting the bytes that cross nodes (node = EP rank div this); 0 takes it from
  // a 2-D route, and with a flat route counts nothing.
  int ranks_per_node = 0;
  // The adaptive route (parallel/adaptive_route.h; needs a 2-D route): each step's cross-node
  // rows go direct or through the 2-D stages, as the measured costs say.
  std::optional<RouteChoiceOptions> adaptive;
};

// What the adaptive route did in a step, and what it knows.
struct RouteFigures {
  double relayed = 0;      // fraction of the cross-node pairs the step relayed (0 or 1)
  bool probe = false;      // the step took the other path to measure it
  double direct_s = -1;    // moving averages of seconds per exchange (< 0: not measured yet)
  double relayed_s = -1;
  double measured_s = -1;  // this step's figure, least over the group (< 0: no exchange ran)
  bool next_relayed = false;  // the choice for the steps that follow
  bool switched = false;      // the step's figure changed the choice
};

class MpiExchange final : public ExpertExchange {
 public:
  // route: the EP group (its size must divide the experts of every layer), flat or 2-D; its
  // communicators must outlive the exchange.
  explicit MpiExchange(const A2aRoute& route, const MpiExchangeOptions& opts = {});

  ExpertOwnership ownership() const override;
  int chunks() const override { return opts_.chunks; }
  Ticket post(std::function<void()> work) override;
  void wait(Ticket t) override;
  ExchangeTimes take_times() override;
  // Payload bytes this process sent to processes on another node (dispatch rows out, combine rows
  // back) since the last call; 0 when the node size is unknown.
  int64_t take_cross_node_bytes() { return cross_node_bytes_.exchange(0); }
  // Adaptive route only (no-ops otherwise). begin_step sets the path of step `step` (1-based) for
  // the exchanges until the next call; end_step, collective over the EP group with no exchange
  // in flight, feeds the step's exchange times to the chooser and says what it did.
  bool adaptive() const { return chooser_ != nullptr; }
  void begin_step(int64_t step);
  std::optional<RouteFigures> end_step();
  void plan(ExchangeLayout& layout, const int64_t* counts, int64_t E, int64_t C) override;
  const float* dispatch(const float* send, const ExchangeLayout& layout,
                        FloatBuffer& recv) override;
  const float* combine(const float* rows, const ExchangeLayout& layout,
                       FloatBuffer& back) override;

 private:
  // The rows of `in` moved by `move` (a2a_dispatch or a2a_combine) into `out`, which holds
  // `rows` rows afterwards; an EP group of one moves nothing and hands `in` back.
  using Move = void (*)(float*, const float*, const A2aLayout&, const A2aRoute&, A2aScratch&,
                        DType);
  const float* exchange(Move move, const float* in, const ExchangeLayout& layout, int64_t rows,
                        FloatBuffer& out);

  A2aRoute route_;
  MpiExchangeOptions opts_;
  A2aScratch scratch_;  // one task runs at a time, so one scratch serves every layer and chunk
  ExchangeTimes times_;  // busy: written by the work, on the comm thread when there is one
  int ranks_per_node_ = 0;
  std::atomic<int64_t> cross_node_bytes_{0};  // written on the comm thread when there is one
  // Adaptive route: the chooser, the relay matrix route_.relay points at, the step, and the
  // step's exchange seconds and count (written by the work).
  std::unique_ptr<RouteChooser> chooser_;
  std::vector<uint8_t> relay_;
  int64_t step_ = 0;
  bool step_relayed_ = false;
  double route_s_ = 0;
  int64_t route_calls_ = 0;
};

}  // namespace moetrain
