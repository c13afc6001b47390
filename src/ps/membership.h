// Who belongs to a parameter-server job, as the scheduler sees it: every node that registered,
// whether it is alive, its role and index. Metadata only; the scheduler does the wire.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moetrain::ps {

struct Node {
  int32_t id = -1;
  std::string role;  // "server" | "worker"
  std::string identity;
  int64_t index = -1;  // server index or worker index (data rank, sum order); servers: −1 spare
  std::string endpoint;
  std::chrono::steady_clock::time_point last_seen;
  bool alive = true;
  bool done = false;
  double throughput = 0;  // worker rows/s, from heartbeats
  int64_t group_size = 1;  // workers: the size of its group (1: alone), from its registration
  int64_t pid = 0;
  bool primary = true;  // servers: primary or backup of its index
  // Servers: where this one runs the scheduler if the servers elect it (ps/election.h).
  std::string successor;
};

class Membership {
 public:
  std::map<int32_t, Node>& nodes() { return nodes_; }  // node id → node
  Node* find(int32_t id);

  // Alive nodes of a role, by index.
  std::vector<Node*> alive_workers();
  std::vector<Node*> alive_servers();
  // Servers that hold a key range (primaries and backups; not spares).
  std::vector<Node*> serving();
  Node* primary_of(int64_t index);
  Node* backup_of(int64_t index);

  // The index a registering worker gets: `want` when it asks for a free one (a launcher naming
  // its stragglers, a restarted worker taking its old place), else the lowest free index, so a
  // restarted worker takes the place (and sum position) of the one it replaces.
  int64_t free_worker_index(int64_t want);

 private:
  std::map<int32_t, Node> nodes_;
};

// Each worker's throughput, in the given order.
std::vector<double> throughputs(const std::vector<Node*>& workers);

}  // namespace moetrain::ps
