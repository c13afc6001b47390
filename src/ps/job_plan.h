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

// The newest clock every server holds a checkpoint of (clock 0, the initialisation, always
// exists). lists: server index → its checkpointed clocks.
int64_t newest_common_clock(const std::map<int64_t, std::vector<int64_t>>& lists);

}  // namespace moetrain::ps
