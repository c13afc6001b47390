// Test support: the planner's clusters the unit tests plan on: H100 nodes (8 devices a node,
// NVLink 450 GB/s, InfiniBand 400 GB/s) and A100 nodes (NVLink 300 GB/s, 200 GB/s a node).
#pragma once
#include <cstdint>

#include "plan/cluster.h"

namespace moetrain::testing {

inline plan::ClusterSpec h100_nodes(int64_t nodes) {
  plan::ClusterSpec c;
  c.device = plan::builtin_device("h100");
  c.devices_per_node = 8;
  c.nodes = nodes;
  c.intra_node_bandwidth = 450e9;
  c.inter_node_bandwidth = 400e9;
  c.intra_node_latency = 3e-6;
  c.inter_node_latency = 10e-6;
  return c;
}

inline plan::ClusterSpec a100_nodes(int64_t nodes) {
  plan::ClusterSpec c = h100_nodes(nodes);
  c.device = plan::builtin_device("a100");
  c.intra_node_bandwidth = 300e9;
  c.inter_node_bandwidth = 200e9;
  return c;
}

}  // namespace moetrain::testing
