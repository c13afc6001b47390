// The adaptive route of the expert all-to-all: which path the cross-node rows of each step take,
// direct (as in the flat exchange: P − L messages per rank cross the network) or relayed through
// the 2-D route (within the node, then one message per node pair). The choice is one for every
// cross-node pair of a step; the exchange itself takes any per-pair matrix (A2aRoute::relay).
//
// Costs are measured, not modelled: each step's exchanges (dispatches and combines) are timed on
// every rank of the EP group, and the least of the ranks' times per exchange (the same figure on
// every rank; the others' times also hold their wait for the last rank to arrive) updates an
// exponential moving average of the path the step used. The unused path is re-measured by a probe: every probe_every-th step takes the other
// path. The route switches when the other path's average is below (1 − margin) × this path's
// (hysteresis: it does not flap on noise), so a link that slows down moves the traffic within
// probe_every steps at most, at once when the other path's last figure already says so.
//
// The chooser is deterministic given its inputs: fed the same figures, every rank chooses alike.
#pragma once
#include <cstdint>

namespace moetrain {

struct RouteChoiceOptions {
  int64_t probe_every = 10;  // every probe_every-th step (1-based) takes the other path; ≥ 2
  double margin = 0.1;       // switch when other < (1 − margin) × current
  double smoothing = 0.5;    // weight of the newest figure in the moving averages, in (0, 1]
  bool start_relayed = false;  // the path before anything is measured
};

class RouteChooser {
 public:
  explicit RouteChooser(const RouteChoiceOptions& opts);

  // Whether step `step` (1-based) relays its cross-node rows: the current choice, or the other
  // path on a probe step.
  bool relayed_at(int64_t step) const { return probe(step) ? !relayed_ : relayed_; }
  bool probe(int64_t step) const { return step > 0 && step % opts_.probe_every == 0; }
  // Step `step` moved its rows in `seconds` per exchange (the group's figure) over the path
  // relayed_at(step) gave; updates that path's average, then the choice.
  void observe(int64_t step, double seconds);

  bool relayed() const { return relayed_; }  // the current choice
  // The moving average of seconds per exchange of a path; < 0 until it was measured.
  double estimate(bool relayed) const { return estimate_[relayed ? 1 : 0]; }
  int64_t switches() const { return switches_; }

 private:
  RouteChoiceOptions opts_;
  bool relayed_;
  double estimate_[2] = {-1.0, -1.0};  // direct, relayed
  int64_t switches_ = 0;
};

}  // namespace moetrain
