// Figures of one sync update that span several servers' key ranges, gathered by the scheduler:
// each primary, once it has summed a clock's pushes for its range, reports its range's part; the
// scheduler adds the S parts elementwise in server-index order and returns the sum to every
// server before any applies the update. Three rounds use it, in this order:
//   experts   grad.sparse_experts, grad.expert_reweight = utilisation: the clock's expert token
//             counts (A, MoE layers, E) from the server holding the count keys (expert_count_keys
//             in ps/options.h), zeros from the others; every server takes the sparse-expert mask
//             (active_experts, optim/sparse_experts.h) and the loads from the sum
//   reweight  grad.expert_reweight: each expert's Σ|g| and Σg² over the range
//             (ExpertReweighter::partial_sums); every server takes the factors from the sums
//             with the trainers' code (ExpertReweighter::apply_sums)
//   clip      optim.grad_clip: the range's Σg² after reweighting; the scheduler takes the norm
//             and the clip scale with the trainers' formula (clip_coefficient in optim/clip.h)
// The rounds as a pure state machine (no sockets), kept by the scheduler.
//
// A round is named by the roll-back generation, the update's version and its kind, so a
// roll-back's replayed clocks never meet the rounds of the clocks it undid. A decided round is
// kept for a while: a promoted backup (or a server that sent its report again after a scheduler
// took over) asks again and is given the same sums.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace moetrain::ps {

enum class RoundKind : int { Reweight = 0, Clip = 1, Experts = 2 };
const char* round_kind_name(RoundKind k);  // "reweight" | "clip" | "experts"
RoundKind parse_round_kind(const std::string& s);

struct ClipDecision {
  double sum_squares = 0;  // Σ over the servers' ranges, added in server-index order
  double norm = 0;         // √sum_squares: the global gradient norm
  double scale = 1;        // clip_coefficient(norm, optim.grad_clip)
};

// The scale the collective trainer applies for this global sum of squares (check_and_clip's
// formula); 1 when grad_clip ≤ 0.
ClipDecision decide_clip(double sum_squares, double grad_clip);

class NormRounds {
 public:
  using Clock = std::chrono::steady_clock;

  NormRounds() = default;
  explicit NormRounds(int64_t servers) : servers_(servers) {}

  // Server `server`'s part (the same length from every server) of round `kind` of update
  // `version` of `generation`. Returns the elementwise sum in server order once every server has
  // reported (or at once, for a round decided earlier). A later report of the same server
  // replaces its earlier one while the round is open.
  std::optional<std::vector<double>> report(uint32_t generation, int64_t version, RoundKind kind,
                                            int64_t server, std::vector<double> part,
                                            Clock::time_point now = Clock::now());

  // The open round that has waited longest for its missing servers, when it has waited more
  // than limit_s seconds since its first report: its version and the servers that did not report.
  std::optional<std::pair<int64_t, std::vector<int64_t>>> overdue(
      double limit_s, Clock::time_point now = Clock::now()) const;

  // A roll-back to `generation`: the rounds of earlier generations are of undone clocks.
  void drop_before(uint32_t generation);

 private:
  struct Round {
    std::vector<std::optional<std::vector<double>>> parts;  // per server index
    Clock::time_point first;
    std::optional<std::vector<double>> sum;
  };
  int64_t servers_ = 1;
  std::map<std::tuple<uint32_t, int64_t, int>, Round> rounds_;  // (generation, version, kind)
};

}  // namespace moetrain::ps
