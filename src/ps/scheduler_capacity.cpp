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
  capacity_from_.emplace(n.id, clock);
  // A report of a clock already decided (sent again after a takeover) adds nothing.
  if (figures && clock == capacity_.clock()) capacity_.add(n.index, j.at("figures"));
  if (decide_capacity()) return;  // the new state went to every worker of the next clock
  const int64_t wants = figures ? clock + 1 : clock;
  if (wants == capacity_.clock())
    send_capacity(n, wants, capacity_.state());
  else if (wants == capacity_.clock() - 1)
    send_capacity(n, wants, capacity_.previous_state());
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
  line["generation"] = generation_;
  // Recorded before any worker hears of it: a successor rebuilds from the record what the
  // workers may have been told.
  events_.record(line);
  for (Node* w : members_.alive_workers())
    if (takes_part(w, capacity_.clock())) send_capacity(*w, capacity_.clock(), capacity_.state());
  return true;
}

void Scheduler::send_capacity(const Node& w, int64_t clock, const nlohmann::json& state) {
  send_to(router_, w.identity,
          json_frame(Kind::CapacityFactors, -1,
                     {{"clock", clock}, {"generation", generation_}, {"state", state}}));
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
    send_capacity(*w, clock, capacity_.state());
  }
  log_info("ps scheduler: capacity controllers at clock {} ({})", clock, why);
}

}  // namespace moetrain::ps
