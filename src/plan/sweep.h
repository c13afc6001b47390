// `moetrain plan --sweep`: several layouts of one run predicted side by side — process counts,
// tensor and pipeline splits, EP sizes and the all-to-all's schedule crossed — with the ones that
// cannot run named and, for each process count, the one that fits with the most tokens a second.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "plan/cost_model.h"

namespace moetrain::plan {

// Each dimension given ("procs=16,32,64", "tp=1,2", "pp=1,4", "ep=1,2,4,8", "etp=1,2",
// "a2a=flat,hierarchical") takes its values, the others keep the command line's; crossed in that
// order, procs outermost, the all-to-all innermost.
struct Sweep {
  std::vector<int64_t> procs, tp, pp, ep, etp;
  std::vector<bool> hierarchical;
  bool procs_swept = false, tp_swept = false, pp_swept = false, etp_swept = false,
       a2a_swept = false;
};
// Throws naming the spec for an unknown dimension, a value that is not one, or a repeat.
Sweep parse_sweep(const std::vector<std::string>& specs, const Layout& layout, bool hierarchical);

struct SweepPoint {
  Layout layout;
  bool hierarchical = false;  // dist.hierarchical
};

struct SweepResult {
  std::vector<SweepPoint> points;       // the layouts that can run, in the sweep's order
  std::vector<Prediction> predictions;  // one per point
  std::vector<SweepPoint> skipped;      // the layouts that cannot
  std::vector<std::string> why;         // one per skipped layout (layout_problem)
  std::vector<size_t> best;             // per process count, the fitting point of most tokens/s
  std::string device;
};

// Predicts every layout of the sweep (vp, zero and recompute from the command line's layout). cluster_for gives the
// cluster at a process count (a cluster file's is fixed; this machine's splits its cores).
// Throws, listing each reason, when no layout can run.
SweepResult run_sweep(const RunConfig& cfg, const std::function<ClusterSpec(int64_t)>& cluster_for,
                      const Sweep& sweep, const Layout& base, const LoadModel& load);

// "procs=64 pp=4 ep=8 a2a=hierarchical", naming only the swept dimensions and ep.
std::string sweep_label(const Sweep& sweep, const SweepPoint& point);
// The table of every prediction, then the skipped layouts with their reasons, then the best
// layout per process count (or that none fits there).
std::string format_sweep(const Sweep& sweep, const SweepResult& r);
// {"layouts": [...], "best": [...], "skipped": [...], "best_ep" when procs is not swept}.
nlohmann::json sweep_json(const Sweep& sweep, const SweepResult& r);

}  // namespace moetrain::plan
