// A new scheduler from the surviving servers, when the scheduler dies and no standby was given.
// Every server binds, at its start, the address at which it would run the scheduler and
// registers it ("successor"). The job's scheduler sends every node, with each heartbeat
// acknowledgement, the succession order: the live servers that hold a key range, by server
// index, the primary before its backup. A node that finds the scheduler silent registers again,
// as it would with a standby, with the first server of that order that answers within twice the
// heartbeat timeout; a server that comes to its own entry is the first live one and takes the
// scheduler's role in its own process (a thread running the takeover of
// ps/scheduler_takeover.cpp on the address it bound), and every node ends up registered there.
// Every server holds what that scheduler needs: the config and the job options of the setup,
// and the nodes tell it the rest as they tell a standby. A standby, when given, takes precedence.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ps/membership.h"
#include "ps/options.h"
#include "train/run_config.h"

namespace moetrain::ps {

struct Successor {
  int32_t node = -1;
  int64_t index = -1;
  bool primary = true;
  std::string endpoint;
};

// The scheduler's side: the succession order of `m`'s live servers (servers that registered no
// address are left out), as JSON for the heartbeat acknowledgements.
nlohmann::json succession_order(Membership& m);
// The nodes' side: that list read back; throws naming what is malformed.
std::vector<Successor> successors_from_json(const nlohmann::json& j);

// "tcp://HOST:*" for a server bound at "tcp://HOST:PORT".
std::string successor_bind(const std::string& server_bind);

class Scheduler;
struct SchedulerSocket;

// A server's readiness to be elected: the bound address, and once elected the scheduler thread.
class Succession {
 public:
  explicit Succession(const std::string& bind);
  ~Succession();  // waits for the scheduler thread, if one runs
  Succession(const Succession&) = delete;
  Succession& operator=(const Succession&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  // Runs the job's scheduler in a thread of this process, with the config and job options of the
  // setup this server holds; `why` (cause, server, node, passed_over) is its first event.
  void take_over(const RunConfig& config, const PsOptions& options, const nlohmann::json& why);

 private:
  std::unique_ptr<SchedulerSocket> socket_;
  std::string endpoint_;
  std::unique_ptr<Scheduler> scheduler_;
  std::thread thread_;
};

}  // namespace moetrain::ps
