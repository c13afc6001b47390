#include "ps/election.h"

#include <algorithm>
#include <chrono>

#include "core/check.h"
#include "core/log.h"
#include "ps/scheduler_state.h"

namespace moetrain::ps {

nlohmann::json succession_order(Membership& m) {
  std::vector<Node*> servers = m.serving();
  std::stable_sort(servers.begin(), servers.end(), [](const Node* a, const Node* b) {
    return a->index != b->index ? a->index < b->index : a->primary && !b->primary;
  });
  nlohmann::json order = nlohmann::json::array();
  for (const Node* s : servers)
    if (!s->successor.empty())
      order.push_back(
          {{"node", s->id}, {"index", s->index}, {"primary", s->primary}, {"endpoint", s->successor}});
  return order;
}

std::vector<Successor> successors_from_json(const nlohmann::json& j) {
  MOETRAIN_CHECK(j.is_array(), "successors: expected a list, got {}", j.dump());
  std::vector<Successor> out;
  for (const auto& e : j) {
    Successor s;
    s.node = e.at("node").get<int32_t>();
    s.index = e.at("index").get<int64_t>();
    s.primary = e.at("primary").get<bool>();
    s.endpoint = e.at("endpoint").get<std::string>();
    MOETRAIN_CHECK(s.endpoint.starts_with("tcp://"), "successor endpoint '{}'", s.endpoint);
    out.push_back(std::move(s));
  }
  return out;
}

std::string successor_bind(const std::string& server_bind) {
  const auto colon = server_bind.rfind(':');
  MOETRAIN_CHECK(server_bind.starts_with("tcp://") && colon > 5,
                 "server bind '{}': expected tcp://HOST:PORT", server_bind);
  return server_bind.substr(0, colon) + ":*";
}

SchedulerSocket::SchedulerSocket(const std::string& bind)
    : router(ctx, zmq::socket_type::router), endpoint(bind_router(ctx, router, bind)) {}

Succession::Succession(const std::string& bind)
    : socket_(std::make_unique<SchedulerSocket>(bind)), endpoint_(socket_->endpoint) {}

Succession::~Succession() {
  if (thread_.joinable()) thread_.join();
  // The scheduler's last messages (the Shutdown of a complete job) leave before its socket closes.
  if (scheduler_) std::this_thread::sleep_for(std::chrono::milliseconds(200));
}

void Succession::take_over(const RunConfig& config, const PsOptions& options,
                           const nlohmann::json& why) {
  MOETRAIN_CHECK(socket_ && !scheduler_, "this server already took the scheduler's role");
  SchedulerArgs a;
  a.config = config;
  a.options = options;
  a.bind = endpoint_;
  a.standby = true;
  a.elected = why;
  scheduler_ = std::make_unique<Scheduler>(a, std::move(socket_));
  thread_ = std::thread([s = scheduler_.get()] {
    try {
      const int code = s->run();
      if (code != 0) log_error("ps scheduler: the elected scheduler stopped the job ({})", code);
    } catch (const std::exception& e) {
      log_error("ps scheduler: the elected scheduler failed: {}", e.what());
    }
  });
}

}  // namespace moetrain::ps
