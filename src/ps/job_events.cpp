#include "ps/job_events.h"

#include <chrono>

namespace moetrain::ps {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

JobEvents::JobEvents(const std::filesystem::path& run_dir, bool fresh) {
  if (fresh)
    for (const char* role : {"worker_", "server_", "scheduler"})
      MetricsWriter::remove_roles(run_dir, role);
  file_ = MetricsWriter::role(run_dir, "scheduler",
                              fresh ? MetricsWriter::Open::Fresh : MetricsWriter::Open::Append);
}

void JobEvents::node(const char* event, const Node& n, const std::string& cause) {
  file_.write({{"event", event},
               {"time", unix_seconds()},
               {"role", n.role},
               {"index", n.index},
               {"node", n.id},
               {"pid", n.pid},
               {"cause", cause}});
}

void JobEvents::job(const char* event, const std::string& cause, const nlohmann::json& extra) {
  nlohmann::json line = {{"event", event}, {"time", unix_seconds()}};
  if (!cause.empty()) line["cause"] = cause;
  for (const auto& [k, v] : extra.items()) line[k] = v;
  file_.write(line);
}

void JobEvents::record(nlohmann::json line) {
  line["time"] = unix_seconds();
  file_.write(line);
}

}  // namespace moetrain::ps
