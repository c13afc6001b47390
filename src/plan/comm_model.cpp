#include "plan/comm_model.h"

#include <algorithm>

namespace moetrain::plan {

double Collective::seconds() const {
  if (!concurrent) {
    double t = 0;
    for (const LinkPhase& p : phases) t += p.latency_s() + p.transfer_s();
    return t;
  }
  double latency = 0, transfer = 0;
  for (const LinkPhase& p : phases) latency += p.latency_s();
  for (const LinkPhase& p : phases) transfer = std::max(transfer, p.transfer_s());
  return latency + transfer;
}

Collective alltoall(const ClusterSpec& c, double bytes, int64_t ep, bool hierarchical) {
  Collective r;
  if (ep <= 1) return r;
  const int64_t g = std::min(ep, c.devices_per_node);
  const int64_t nn = (ep + g - 1) / g;
  const double dpn = static_cast<double>(c.devices_per_node);
  if (!hierarchical || nn == 1) {
    // Of the bytes a rank sends, the share bound for the g − 1 others of its node stays inside.
    const double intra = bytes * static_cast<double>(g - 1) / static_cast<double>(ep - 1);
    r.kind = "flat";
    r.concurrent = true;
    r.phases.push_back({"within the node", static_cast<double>(g - 1), c.intra_node_latency, intra,
                        c.intra_node_bandwidth, 1});
    if (ep > g && c.spine_bandwidth > 0 && g > 1) {
      // On rails: of the ep − g ranks of other nodes, nn − 1 hold the rank's position (its rail);
      // the rows for the others cross the spine. Both links carry their share at once.
      const double remote = bytes - intra;
      const double rail = remote * static_cast<double>(nn - 1) / static_cast<double>(ep - g);
      r.phases.push_back({"along the rails", static_cast<double>(nn - 1), c.inter_node_latency,
                          rail, c.inter_node_bandwidth, dpn});
      r.phases.push_back({"across the spine", static_cast<double>(ep - g - (nn - 1)),
                          c.inter_node_latency, remote - rail, c.spine_bandwidth, dpn});
    } else if (ep > g) {
      r.phases.push_back({"between nodes", static_cast<double>(ep - g), c.inter_node_latency,
                          bytes - intra, c.inter_node_bandwidth, dpn});
    }
    return r;
  }
  // Every row but the rank's own share moves in phase 1 (regrouped by destination node), and
  // those bound for other nodes again in phase 2.
  const double all = bytes * static_cast<double>(ep) / static_cast<double>(ep - 1);
  r.kind = "hierarchical";
  r.phases.push_back({"within the node", static_cast<double>(g - 1), c.intra_node_latency,
                      all * static_cast<double>(g - 1) / static_cast<double>(g),
                      c.intra_node_bandwidth, 1});
  r.phases.push_back({"between nodes", static_cast<double>(nn - 1), c.inter_node_latency,
                      all * static_cast<double>(nn - 1) / static_cast<double>(nn),
                      c.inter_node_bandwidth, dpn});
  return r;
}

Collective alltoall_dedup(const ClusterSpec& c, double bytes, int64_t ep, double dedup) {
  const int64_t g = std::min(ep, c.devices_per_node);
  if (ep <= 1 || ep <= g) return alltoall(c, bytes, ep, false);
  // Of a rank's rows, (g − 1)/(ep − 1) go to its own node's ranks directly; the rest cross to
  // other nodes, deduplicated, and the same amount arrives, of which the rank forwards all but
  // its own share over NVLink.
  const double intra = bytes * static_cast<double>(g - 1) / static_cast<double>(ep - 1);
  const double remote = bytes - intra;
  const int64_t nn = (ep + g - 1) / g;
  Collective r;
  r.kind = "deduplicated";
  r.concurrent = true;
  r.phases.push_back({"within the node, direct and fanned out", static_cast<double>(g - 1),
                      c.intra_node_latency,
                      intra + remote * static_cast<double>(g - 1) / static_cast<double>(g),
                      c.intra_node_bandwidth, 1});
  r.phases.push_back({"between nodes, once per node", static_cast<double>(nn - 1),
                      c.inter_node_latency, remote * dedup, c.inter_node_bandwidth,
                      static_cast<double>(c.devices_per_node)});
  return r;
}

double dedup_share(int64_t E, int64_t K, int64_t nn, double node_limit) {
  if (nn <= 1 || K <= 1) return 1;
  // P(a given other node holds none of the token's experts): choosing K of E without
  // replacement, none among its E / nn.
  const double per_node = static_cast<double>(E) / static_cast<double>(nn);
  double miss = 1;
  for (int64_t i = 0; i < K; ++i)
    miss *= std::max(0.0, (static_cast<double>(E) - per_node - static_cast<double>(i)) /
                              (static_cast<double>(E) - static_cast<double>(i)));
  const double others = static_cast<double>(nn - 1);
  double nodes = others * (1 - miss);  // distinct remote nodes
  // Node-limited routing: at most node_limit nodes in all, its own among them as often as the
  // expected share of its rows.
  if (node_limit > 0) nodes = std::min(nodes, node_limit * others / static_cast<double>(nn));
  const double rows = static_cast<double>(K) * others / static_cast<double>(nn);
  return std::min(1.0, nodes / rows);
}

Collective ring_allreduce(const ClusterSpec& c, double bytes, int64_t p, bool crosses_nodes) {
  Collective r;
  if (p <= 1 || bytes <= 0) return r;
  const double intra = c.intra_node_allreduce_bandwidth > 0 ? c.intra_node_allreduce_bandwidth
                                                            : c.intra_node_bandwidth;
  r.kind = "ring";
  r.phases.push_back({crosses_nodes ? "ring across nodes" : "ring within the node",
                      2.0 * static_cast<double>(p - 1),
                      crosses_nodes ? c.inter_node_latency : c.intra_node_latency,
                      ring_allreduce_bytes(bytes, p),
                      crosses_nodes ? std::min(intra, c.inter_node_bandwidth) : intra, 1});
  return r;
}

Collective pipeline_send(const ClusterSpec& c, double bytes, int64_t stage_ranks) {
  Collective r;
  if (bytes <= 0) return r;
  r.kind = "copy";
  if (stage_ranks >= c.devices_per_node)
    r.phases.push_back({"to the next stage's node", 1, c.inter_node_latency, bytes,
                        c.inter_node_bandwidth, static_cast<double>(c.devices_per_node)});
  else
    r.phases.push_back({"to the next stage, within the node", 1, c.intra_node_latency, bytes,
                        c.intra_node_bandwidth, 1});
  return r;
}

double ring_allreduce_bytes(double bytes, int64_t p) {
  return p <= 1 ? 0.0 : 2.0 * static_cast<double>(p - 1) / static_cast<double>(p) * bytes;
}

}  // namespace moetrain::plan
