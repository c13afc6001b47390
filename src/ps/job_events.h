// The scheduler's membership events in RUN_DIR/metrics/scheduler.jsonl (io/metrics.h), one line
// each: {"event", "time" (Unix seconds), "cause", and for a node "role", "index", "node", "pid"}.
// `moetrain report` lists them as the job's restarts and failures with their causes.
#pragma once
#include <filesystem>
#include <string>

#include "io/metrics.h"
#include "ps/membership.h"

namespace moetrain::ps {

class JobEvents {
 public:
  JobEvents() = default;
  // A new job in run_dir: removes the worker, server and scheduler files an earlier job left.
  // `fresh`: a new job, whose scheduler clears the role files of an earlier one; a standby
  // scheduler appends to the running job's.
  explicit JobEvents(const std::filesystem::path& run_dir, bool fresh = true);

  // e.g. worker_lost, worker_joined, server_lost, backup_lost, failover.
  void node(const char* event, const Node& n, const std::string& cause);
  // e.g. job_start, rollback, job_complete, job_stopped; `extra` fields are added to the line.
  void job(const char* event, const std::string& cause = {},
           const nlohmann::json& extra = nlohmann::json::object());
  // A line that is not an event (no "event" key, so `moetrain report` does not list it): the
  // dynamic capacity controller's record of a clock (ps/capacity_rounds.h), "time" added.
  void record(nlohmann::json line);

 private:
  MetricsWriter file_;
};

// Seconds since the epoch (the "time" of every line of the per-process files).
double unix_seconds();

}  // namespace moetrain::ps
