// Test support: the planner's cluster of H100 nodes (8 devices a node, NVLink 450 GB/s,
// InfiniBand 400 GB/s) that the unit tests plan on.
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

}  // namespace moetrain::testing
