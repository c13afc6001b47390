#include "ps/job_plan.h"

#include <algorithm>

#include "core/check.h"

namespace moetrain::ps {

nlohmann::json setup_servers(const std::vector<ServerSlot>& slots,
                             const std::vector<KeyRange>& keys) {
  MOETRAIN_CHECK(slots.size() == keys.size(), "{} servers, {} key ranges", slots.size(),
                 keys.size());
  nlohmann::json js = nlohmann::json::array();
  for (std::size_t s = 0; s < slots.size(); ++s)
    js.push_back({{"index", static_cast<int64_t>(s)},
                  {"endpoint", slots[s].endpoint},
                  {"backup", slots[s].backup},
                  {"begin", keys[s].begin},
                  {"end", keys[s].end}});
  return js;
}

nlohmann::json setup_workers(const std::vector<int64_t>& indices,
                             const std::vector<int64_t>& rows) {
  MOETRAIN_CHECK(indices.size() <= rows.size(), "{} workers, rows for {}", indices.size(),
                 rows.size());
  nlohmann::json jw = nlohmann::json::array();
  int64_t row = 0;
  for (std::size_t w = 0; w < indices.size(); ++w) {
    jw.push_back({{"index", indices[w]}, {"row_begin", row}, {"rows", rows[w]}});
    row += rows[w];
  }
  return jw;
}

std::optional<std::vector<double>> capability_weights(const std::vector<double>& throughputs) {
  for (double t : throughputs)
    if (!(t > 0)) return std::nullopt;
  return throughputs;
}

int64_t newest_common_clock(const std::map<int64_t, std::vector<int64_t>>& lists) {
  int64_t clock = 0;
  if (lists.empty()) return clock;
  for (int64_t c : lists.begin()->second) {
    bool everywhere = true;
    for (const auto& [i, l] : lists) everywhere &= std::find(l.begin(), l.end(), c) != l.end();
    if (everywhere) clock = std::max(clock, c);
  }
  return clock;
}

}  // namespace moetrain::ps
