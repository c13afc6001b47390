// The planner's communication model: every collective as phases of `messages × latency + bytes /
// (link bandwidth / ranks sharing the link)`. A collective's time is computed from its phases,
// so the phases the planner prints (`moetrain plan`, "communication, written out") are the
// model itself, not a description of it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "plan/cluster.h"

namespace moetrain::plan {

// One rank's part of a collective over one kind of link.
struct LinkPhase {
  std::string name;      // "within the node", "between nodes", "ring"
  double messages = 0;   // messages one rank sends, one latency each
  double latency = 0;    // seconds per message
  double bytes = 0;      // bytes one rank sends
  double bandwidth = 0;  // the link's bytes per second
  double sharing = 1;    // ranks sending over the link at once: each gets bandwidth / sharing
  double latency_s() const { return messages * latency; }
  double transfer_s() const { return bytes > 0 ? bytes / (bandwidth / sharing) : 0.0; }
};

// concurrent: the phases run at the same time (the flat all-to-all sends to the ranks of its node
// and of other nodes at once): a rank posts every message, so the latencies add, and the slower
// transfer sets the rest. Otherwise the phases run one after another.
struct Collective {
  std::string kind = "none";  // flat | hierarchical | ring | copy | none
  std::vector<LinkPhase> phases;
  bool concurrent = false;
  double seconds() const;
};

// One expert all-to-all in which each rank of an EP group of `ep` sends `bytes` to the others
// (its own share stays home). Ranks of a group are consecutive, devices_per_node of them per
// node. Every rank of a node exchanges at the same time, so the node's link is shared by its
// devices_per_node ranks.
//  flat: every rank sends to each of the ep − 1 others directly: the intra-node part over the
//        device's link, the inter-node part over its share of the node's link, at once.
//        On a rail-optimised network (cluster.spine_bandwidth) the inter-node part is two
//        links at once: the rows for the same-position ranks along the rails, the rest across
//        the spine.
//  hierarchical (2-D): first within the node (g − 1 messages, all rows regrouped by destination
//        node), then between nodes to the same-position rank (nn − 1 messages): fewer, larger
//        inter-node messages, the rows crossing the device link twice, none over the spine. An
//        EP group inside one node has no second phase: it runs flat.
Collective alltoall(const ClusterSpec& c, double bytes, int64_t ep, bool hierarchical);

// DeepEP's exchange: a token crosses to each other node holding one of its experts once (to the
// same-position rank there) and is fanned out over NVLink to the experts' ranks, the two at once
// (pipelined). `dedup`: the share of a token's remote rows that cross, distinct destination
// nodes / K (dedup_share). An EP group inside one node runs flat.
Collective alltoall_dedup(const ClusterSpec& c, double bytes, int64_t ep, double dedup);
// The share of a token's (token, expert) rows bound for other nodes that a per-node
// deduplicated exchange sends: E[distinct remote nodes] / E[remote rows], for K distinct experts
// chosen uniformly among E spread evenly over nn nodes, each token reaching at most `node_limit`
// nodes (node-limited routing; 0 = no limit). 1 when nothing is saved.
double dedup_share(int64_t E, int64_t K, int64_t nn, double node_limit);
// Ring all-reduce (or reduce-scatter + all-gather, the same traffic) of `bytes` over p ranks:
// 2(p − 1) steps, each sending bytes / p. A ring that leaves a node goes at the node link's speed
// (on a rail-optimised network the ring is rail-aligned, as NCCL builds it: no spine).
Collective ring_allreduce(const ClusterSpec& c, double bytes, int64_t p, bool crosses_nodes);
// Bytes each rank sends in a ring all-reduce of `bytes` over p ranks: 2 (p − 1) / p · bytes.
double ring_allreduce_bytes(double bytes, int64_t p);
// One pipeline send: every rank of a stage (stage_ranks consecutive ranks) hands `bytes` of
// activations (or their gradients) to its peer in the next stage at once. Stages wider than a
// node sit on nodes of their own, and a node's ranks share its link; narrower ones pass within
// the node.
Collective pipeline_send(const ClusterSpec& c, double bytes, int64_t stage_ranks);

// A run's communication per step, written out: what each collective's phases are and how many
// of them a step runs. The step's all-to-all and reduction times (StepParts) are these.
struct CommBreakdown {
  // The expert all-to-all at the mean MoE layer (the model is linear in the bytes, so the mean
  // layer's exchange times the count is the sum over layers). Bytes per rank and exchange.
  double a2a_exchanges = 0;  // a step's exchanges (4 per MoE layer and micro-batch, per stage)
  double a2a_send_bytes = 0;     // rows a rank sends elsewhere
  double a2a_hot_recv_bytes = 0; // rows the most loaded rank receives
  double a2a_charged_bytes = 0;  // what the link is charged (cluster.a2a_receiver_bound)
  double a2a_late_s = 0;         // a late peer's cost per exchange (this machine's calibration)
  Collective a2a_flat, a2a_hierarchical, a2a_deduplicated;
  std::string a2a_runs = "none";  // the form the run uses
  // Gradient reductions once a step, each named ("dense gradients", "expert gradients").
  std::vector<std::pair<std::string, Collective>> reductions;
  // Tensor parallelism's all-reduces of activations: `tp_count` a step of `tensor_parallel`.
  double tp_count = 0;
  Collective tensor_parallel;
  // Expert tensor parallelism: `etp_count` a step of `expert_tensor_parallel`, an all-gather of
  // the hot rank's expert rows with the reduce-scatter of their outputs (or of the gradients,
  // backward) at the mean MoE layer, of expert_tensor_parallel_bytes.
  double etp_count = 0;
  double expert_tensor_parallel_bytes = 0;
  Collective expert_tensor_parallel;
  // Pipeline parallelism: the schedule timed (its name), the activation sends between stages a
  // step (forward and backward, each micro-batch and chunk boundary) of `pipeline_send` each.
  std::string pipe_schedule;
  double pipe_sends = 0;
  Collective pipeline_send;
};

}  // namespace moetrain::plan
