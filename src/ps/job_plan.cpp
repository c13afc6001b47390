#include "ps/job_plan.h"

#include <algorithm>
#include <utility>

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

std::optional<RowSplit> split_rows_by_group(int64_t global_rows,
                                            const std::vector<WorkerRate>& workers,
                                            bool weighted) {
  RowSplit out;
  std::map<std::pair<int64_t, int64_t>, std::size_t> group_of;  // (size, group) → share
  std::vector<std::size_t> share_of(workers.size());
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const WorkerRate& r = workers[w];
    MOETRAIN_CHECK(r.group_size >= 1, "worker {}: group size {}", r.index, r.group_size);
    if (weighted && !(r.throughput > 0)) return std::nullopt;
    const std::pair<int64_t, int64_t> key{r.group_size, r.index / r.group_size};
    auto [it, added] = group_of.emplace(key, out.groups.size());
    if (added) out.groups.push_back({key.second, {}, r.throughput, 0});
    GroupShare& g = out.groups[it->second];
    g.indices.push_back(r.index);
    g.throughput = std::min(g.throughput, r.throughput);
    share_of[w] = it->second;
  }
  // Per worker its group's slowest rate, so a group weighs live ranks × that rate.
  std::vector<double> weights(workers.size(), 1.0);
  if (weighted)
    for (std::size_t w = 0; w < workers.size(); ++w)
      weights[w] = out.groups[share_of[w]].throughput;
  const std::vector<int64_t> first = split_rows(global_rows, weights);
  for (std::size_t w = 0; w < workers.size(); ++w) out.groups[share_of[w]].rows += first[w];
  out.rows.assign(workers.size(), 0);
  std::map<std::size_t, int64_t> placed;  // share → ranks given rows so far
  for (std::size_t w = 0; w < workers.size(); ++w) {
    GroupShare& g = out.groups[share_of[w]];
    const auto n = static_cast<int64_t>(g.indices.size());
    const int64_t k = placed[share_of[w]]++;
    out.rows[w] = g.rows / n + (k < g.rows % n ? 1 : 0);
  }
  for (GroupShare& g : out.groups) g.throughput *= static_cast<double>(g.indices.size());
  return out;
}

nlohmann::json assign_record(const RowSplit& split, int64_t clock, const std::string& cause) {
  nlohmann::json groups = nlohmann::json::array();
  for (const GroupShare& g : split.groups)
    groups.push_back({{"group", g.group},
                      {"workers", g.indices},
                      {"throughput", g.throughput},
                      {"rows", g.rows}});
  return {{"decision", "assign"}, {"clock", clock}, {"cause", cause}, {"groups", groups}};
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
