// Global-norm clipping when the gradient's key ranges live on several servers (sync mode): each
// primary, once it has summed a clock's pushes for its range, reports the range's sum of squares
// to the scheduler; the scheduler adds the S partials in server-index order, takes the square
// root and the clip scale with the single-process trainer's formula (clip_coefficient in
// optim/clip.h), and returns both to every server, which scales its summed gradient by it before
// its optimizer steps. The rounds as a pure state machine (no sockets), kept by the scheduler.
//
// A round is named by the roll-back generation and the update's version, so a roll-back's
// replayed clocks never meet the rounds of the clocks it undid. A decided round is kept for a
// while: a promoted backup (or a server that sent its report again after a scheduler took over)
// asks again and is given the same decision.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moetrain::ps {

struct ClipDecision {
  double sum_squares = 0;  // Σ over the servers' ranges, added in server-index order
  double norm = 0;         // √sum_squares: the global gradient norm
  double scale = 1;        // clip_coefficient(norm, optim.grad_clip)
};

// The scale the collective trainer would apply for these partials (one per server, in server
// order): the same sum order on every call, the same formula as check_and_clip's.
ClipDecision decide_clip(const std::vector<double>& partial_sum_squares, double grad_clip);

class NormRounds {
 public:
  using Clock = std::chrono::steady_clock;

  NormRounds() = default;
  NormRounds(int64_t servers, double grad_clip) : servers_(servers), grad_clip_(grad_clip) {}

  // Server `server`'s partial for update `version` of `generation`. Returns the decision once
  // every server has reported (or at once, for a round decided earlier). A later report of the
  // same server replaces its earlier one while the round is open.
  std::optional<ClipDecision> report(uint32_t generation, int64_t version, int64_t server,
                                     double sum_squares, Clock::time_point now = Clock::now());

  // The open round that has waited longest for its missing servers, when it has waited more
  // than limit_s seconds since its first report: its version and the servers that did not report.
  std::optional<std::pair<int64_t, std::vector<int64_t>>> overdue(
      double limit_s, Clock::time_point now = Clock::now()) const;

  // A roll-back to `generation`: the rounds of earlier generations are of undone clocks.
  void drop_before(uint32_t generation);

 private:
  struct Round {
    std::vector<std::optional<double>> partials;  // per server index
    Clock::time_point first;
    std::optional<ClipDecision> decision;
  };
  int64_t servers_ = 1;
  double grad_clip_ = 0;
  std::map<std::pair<uint32_t, int64_t>, Round> rounds_;  // (generation, version) → round
};

}  // namespace moetrain::ps
