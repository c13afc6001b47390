// The scheduler's decisions that need no sockets: the job layout it sends in every setup
// message, the row weights of the capability assignment, the clock a roll-back goes to.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ps/options.h"

namespace moetrain::ps {

// One server index as the setup lists it.
struct ServerSlot {
  std::string endpoint;  // the primary's; empty while it is down or restoring (workers wait)
  std::string backup;    // empty: no replica
};

// The "servers" list of a setup message: index, endpoints and key range of each server.
nlohmann::json setup_servers(const std::vector<ServerSlot>& slots,
                             const std::vector<KeyRange>& keys);
// The "workers" list: each worker's rows of the global batch, contiguous in worker-index order.
// indices ascending; rows[i] for indices[i].
nlohmann::json setup_workers(const std::vector<int64_t>& indices, const std::vector<int64_t>& rows);

// Capability assignment: rows in proportion to each worker's measured throughput (rows/s), once
// every worker has reported one; nullopt until then.
std::optional<std::vector<double>> capability_weights(const std::vector<double>& throughputs);

// A live worker as the row split sees it: its index, the size of the group it belongs to (1: a
// worker alone; P: rank index % P of group index / P) and its measured throughput (rows/s).
struct WorkerRate {
  int64_t index = 0, group_size = 1;
  double throughput = 0;
};
// One group's share of a split (a worker alone is a group of one).
struct GroupShare {
  int64_t group = 0;             // index / group_size
  std::vector<int64_t> indices;  // its live workers, ascending
  double throughput = 0;         // the group's rows/s: live ranks × its slowest rank's rate
  int64_t rows = 0;
};
struct RowSplit {
  std::vector<int64_t> rows;  // per worker, in the order given
  std::vector<GroupShare> groups;
};
// The global batch over groups in proportion to their throughput (`capability`), or the same rows
// for every worker (`weighted` false), each group's rows then cut evenly over its ranks (the lower
// ranks take the remainder). A group's ranks meet in every all-to-all of a step, so the group runs
// at its slowest rank's pace: its throughput is that rank's rate times its live ranks, not the sum
// of its ranks' rates (which would give a group with one slow rank rows it cannot compute in
// time). workers: ascending by index; nullopt with `weighted` until every worker reported a rate.
std::optional<RowSplit> split_rows_by_group(int64_t global_rows,
                                            const std::vector<WorkerRate>& workers, bool weighted);
// The decision's line in metrics/scheduler.jsonl (no "event": `moetrain report` lists it under the
// scheduler's decisions): {"decision": "assign", "clock", "cause", "groups": [{group, workers,
// throughput, rows}]}. clock: the first clock the split applies to (−1: at once).
nlohmann::json assign_record(const RowSplit& split, int64_t clock, const std::string& cause);

// The newest clock every server holds a checkpoint of (clock 0, the initialisation, always
// exists). lists: server index → its checkpointed clocks.
int64_t newest_common_clock(const std::map<int64_t, std::vector<int64_t>>& lists);

}  // namespace moetrain::ps
