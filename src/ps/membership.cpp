#include "ps/membership.h"

#include <algorithm>

namespace moetrain::ps {

namespace {

std::vector<Node*> alive(std::map<int32_t, Node>& nodes, const char* role) {
  std::vector<Node*> out;
  for (auto& [id, n] : nodes)
    if (n.alive && n.role == role) out.push_back(&n);
  std::sort(out.begin(), out.end(), [](Node* a, Node* b) { return a->index < b->index; });
  return out;
}

}  // namespace

Node* Membership::find(int32_t id) {
  auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : &it->second;
}

std::vector<Node*> Membership::alive_workers() {
  return alive(nodes_, "worker");
}

std::vector<Node*> Membership::alive_servers() {
  return alive(nodes_, "server");
}

std::vector<Node*> Membership::serving() {
  std::vector<Node*> out;
  for (Node* s : alive_servers())
    if (s->index >= 0) out.push_back(s);
  return out;
}

Node* Membership::primary_of(int64_t index) {
  for (auto& [id, n] : nodes_)
    if (n.alive && n.role == "server" && n.primary && n.index == index) return &n;
  return nullptr;
}

Node* Membership::backup_of(int64_t index) {
  for (auto& [id, n] : nodes_)
    if (n.alive && n.role == "server" && !n.primary && n.index == index) return &n;
  return nullptr;
}

int64_t Membership::free_worker_index(int64_t want) {
  std::vector<int64_t> used;
  for (Node* w : alive_workers()) used.push_back(w->index);
  if (want >= 0 && std::find(used.begin(), used.end(), want) == used.end()) return want;
  int64_t idx = 0;
  while (std::find(used.begin(), used.end(), idx) != used.end()) ++idx;
  return idx;
}

std::vector<double> throughputs(const std::vector<Node*>& workers) {
  std::vector<double> t;
  for (Node* w : workers) t.push_back(w->throughput);
  return t;
}

}  // namespace moetrain::ps
