// The scheduler's side of the dynamic capacity controller (ps/capacity_rounds.h): every worker
// of a clock reports its figures, the scheduler decides the clock once all of them did, records
// it in metrics/scheduler.jsonl and sends the next clock's state to the workers, which wait for
// it before they compute. A worker that waits sends its report (or request) again every heartbeat
// timeout, so a scheduler that took over, or one that was restoring, answers it.
// Who takes part in a clock's round: the workers of the job's start, and a worker that joins
// later from the clock it first asks the factors for; a worker that dies leaves the round to
// the others (its figures count if they came, as its push does if the servers applied it).
#include "core/check.h"
#include "core/log.h"
#include "ps/scheduler_state.h"

namespace moetrain::ps {

std::filesystem::path Scheduler::capacity_record() const {
  return std::filesystem::path(args_.config.train.run_dir) / "metrics" / "scheduler.jsonl";
}

// j: {clock, generation, figures}: the worker's figures of `clock`, which also asks for the
// factors of clock + 1; without figures, a request for the factors of `clock` (a worker that
// starts, joins, or goes on after a roll-back).
void Scheduler::on_capacity_report(const Node& n, const nlohmann::json& j) {
  if (!capacity_.active() || !started_ || taking_over_ || restoring_) return;
  if (j.at("generation").get<uint32_t>() != generation_) return;  // a clock a roll-back undid
  const int64_t clock = j.at("clock").get<int64_t>();
  const bool figures = j.contains("figures");
  // Without controllers nothing is replayed: the round follows the workers' clock (after a
  // takeover or a resume), its first clock with no loads.
  if (!capacity_.controlled() && clock > capacity_.clock()) capacity_.rewind(clock);
  capacity_from_.emplace(n.id, clock);
  // A report of a clock already decided (sent again after a takeover) adds nothing.
  if (figures && clock == capacity_.clock()) capacity_.add(n.index, j.at("figures"));
  if (decide_capacity()) return;  // the new state went to every worker of the next clock
  const int64_t wants = figures ? clock + 1 : clock;
  if (wants == capacity_.clock())
    send_capacity(n, wants, capacity_.state(), capacity_.loads());
  else if (wants == capacity_.clock() - 1)
    send_capacity(n, wants, capacity_.previous_state(), capacity_.previous_loads());
}

// Decides the current clock once every live worker that computes it reported; returns whether it
// did.
bool Scheduler::decide_capacity() {
  if (!capacity_.active() || !started_ || taking_over_ || restoring_) return false;
  const int64_t c = capacity_.clock();
  auto takes_part = [&](const Node* w, int64_t clock) {
    auto it = capacity_from_.find(w->id);
    return !w->done && it != capacity_from_.end() && it->second <= clock;
  };
  bool any = false;
  for (Node* w : members_.alive_workers()) {
    if (!takes_part(w, c)) continue;
    if (!capacity_.reported(w->index)) return false;
    any = true;
  }
  if (!any) return false;
  nlohmann::json line = capacity_.decide();
  if (!line.is_null()) {
    line["generation"] = generation_;
    // Recorded before any worker hears of it: a successor rebuilds from the record what the
    // workers may have been told.
    events_.record(line);
  }
  if (args_.config.placement.enabled()) record_placement(c);
  for (Node* w : members_.alive_workers())
    if (takes_part(w, capacity_.clock()))
      send_capacity(*w, capacity_.clock(), capacity_.state(), capacity_.loads());
  return true;
}

// The placement every group makes from the loads just decided (ExpertPlacement::after_step with
// them after clock `c`), planned here too so that the record says which experts are hot and
// why: a decision line for each MoE layer whose replicas move. The planner's moving averages
// start with the first clock this scheduler decided.
void Scheduler::record_placement(int64_t c) {
  const auto& m = args_.config.model;
  const nlohmann::json& loads = capacity_.loads();
  if (!placement_mirror_) {
    int64_t P = 0;
    for (Node* w : members_.alive_workers()) P = std::max<int64_t>(P, w->group_size);
    if (P <= 1) return;  // groups only: a worker alone is refused replicas
    placement_mirror_ = PlacementPlanner(args_.config.placement, m.n_moe_layers(), m.n_experts,
                                         P, args_.config.dist.ranks_per_node);
  }
  const int64_t steps = c + 1;  // clocks done when the groups apply it
  for (int64_t l = 0; l < m.n_moe_layers(); ++l) {
    const std::vector<int64_t> load = loads[static_cast<std::size_t>(l)].get<std::vector<int64_t>>();
    placement_mirror_->observe(l, load.data());
    if (!placement_mirror_->due(steps)) continue;
    const std::vector<ExpertMove> moves = placement_mirror_->replan(l);
    if (moves.empty()) continue;
    const std::vector<int64_t> replicas = placement_mirror_->placement(l).replicas();
    std::vector<int64_t> hot;
    for (std::size_t e = 0; e < replicas.size(); ++e)
      if (replicas[e] > 1) hot.push_back(static_cast<int64_t>(e));
    events_.record({{"decision", "placement"},
                    {"clock", steps},
                    {"layer", l},
                    {"hot_experts", hot},
                    {"replicas", replicas},
                    {"loads", placement_mirror_->average(l)},
                    {"moves", describe_moves(l, moves)},
                    {"cause", fmt::format("the experts' loads summed over the groups, averaged "
                                          "(decay {})",
                                          args_.config.placement.decay)}});
  }
}

void Scheduler::send_capacity(const Node& w, int64_t clock, const nlohmann::json& state,
                              const nlohmann::json& loads) {
  send_to(router_, w.identity,
          json_frame(Kind::CapacityFactors, -1,
                     {{"clock", clock},
                      {"generation", generation_},
                      {"state", state},
                      // Only groups placing replicas read them.
                      {"loads", args_.config.placement.enabled() ? loads
                                                                 : nlohmann::json::array()}}));
}

// The servers rolled back (or a resumed job restored) to `clock`, or a successor took over at
// it: the controllers go back to their state of that clock, replayed from the record, and every
// live worker gets it (each waits for it before it computes the clock).
void Scheduler::capacity_rewound(int64_t clock, const char* why) {
  if (!capacity_.active()) return;
  if (!capacity_.rewind(clock)) {
    capacity_error_ = fmt::format(
        "{} at clock {}, but the capacity controller's record ({}) lacks a clock before it: the "
        "controllers' state cannot be rebuilt (the scheduler reads the record in RUN_DIR, which a "
        "successor on another machine needs on a shared file system)",
        why, clock, capacity_record().string());
    return;
  }
  capacity_from_.clear();
  for (Node* w : members_.alive_workers()) {
    if (w->done) continue;
    capacity_from_[w->id] = clock;
    send_capacity(*w, clock, capacity_.state(), capacity_.loads());
  }
  log_info("ps scheduler: capacity controllers at clock {} ({})", clock, why);
}

}  // namespace moetrain::ps
