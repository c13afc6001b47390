// What the planner knows of the machines a run would use: one device's speeds (a built-in model
// or a calibrated profile of this CPU) and how devices are wired (a cluster file). Loaded from
// TOML (toml++), validated once; a missing or non-positive key is an error naming it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "plan/calibrate_comm.h"
#include "plan/kernel_table.h"

namespace moetrain::plan {

// One device (a GPU, or one process's share of this CPU).
struct DeviceModel {
  std::string name = "cpu";
  double peak_flops_f32 = 0;       // FLOP/s (datasheet; a CPU profile: the measured GEMM asymptote)
  double peak_flops_bf16 = 0;      // FLOP/s; 0 = no native bf16 (bf16 runs at the f32 rate)
  double gemm_max_efficiency = 1;  // the best fraction of peak a large GEMM reaches
  double memory_bytes = 0;
  double memory_bandwidth = 0;  // bytes/s, what element-wise kernels stream at
  // RMSNorm forward + backward, bytes/s at the bytes the cost model counts (its backward sums
  // the weight gradient column by column, slower than a stream); 0 = memory_bandwidth.
  double norm_bandwidth = 0;
  // GEMM time = flops / P · (1 + gemm_small_dim / d) + gemm_call_s, P = peak · max efficiency,
  // d = min(M, N, K):
  // the efficiency d / (d + gemm_small_dim) of a GEMM whose smallest side is d (docs/plan.md), plus
  // a fixed cost per call (kernel launch, primitive dispatch).
  double gemm_small_dim = 0;
  double gemm_call_s = 0;
  // The share of the device's compute an exchange or reduction takes while it runs hidden behind
  // compute (a GPU's collectives run on its streaming multiprocessors): the compute beside it
  // runs at 1 − this. 0: none (a CPU's communication thread: ClusterSpec::comm_shares_cores).
  double comm_compute_share = 0;
  // Measured GEMM rates (CPU profiles): FLOP/s by the smallest side d of the shape, d ascending.
  // When present they replace the curve: a shape's rate is interpolated in log d (clamped at
  // the ends), call costs included.
  std::vector<double> gemm_f32_dims, gemm_f32_flops, gemm_bf16_dims, gemm_bf16_flops;
  // Attention (scores, softmax, values; forward and backward) in FLOP/s at the counted FLOPs;
  // 0 = the GEMM curve at the (T, T, HS) shape.
  double attention_flops = 0;
  // Cores behind the calibrated figures (CPU profiles): a process with fewer threads gets that
  // share. 0 for accelerators.
  int64_t threads = 0;
  // Kernels timed at one config's shapes (CPU profiles calibrated with -c CONFIG).
  KernelTable kernels;
};

struct ClusterSpec {
  DeviceModel device;
  int64_t devices_per_node = 1;
  int64_t nodes = 1;
  double intra_node_bandwidth = 0;  // bytes/s per device (NVLink, shared memory)
  double inter_node_bandwidth = 0;  // bytes/s per node (its NICs), shared by its devices
  double intra_node_latency = 0;    // seconds per message
  double inter_node_latency = 0;
  // A rail-optimised network: traffic between devices of different positions on different
  // nodes crosses the spine, at this many bytes/s per node (shared by its devices), while traffic
  // between devices of the same position stays on their rail (inter_node_bandwidth). 0: one
  // network, every inter-node byte at inter_node_bandwidth.
  double spine_bandwidth = 0;
  // All-reduce's own rate inside a node where it was measured (this machine's collectives: the
  // reduction's arithmetic and the transport's protocol, not just the copy); 0 = the link's.
  double intra_node_allreduce_bandwidth = 0;
  // Bytes/s per node of the local disk an offloaded optimizer state lives on (dist.offload =
  // host_file), reads and writes together, shared by the node's processes; 0: offload's disk
  // time is not costed.
  double disk_bandwidth = 0;
  // The processes share the cores that compute (a calibrated CPU whose processes fill its
  // cores): a communication thread takes a core from compute, so nothing overlaps.
  bool comm_shares_cores = false;
  // The cores the processes share on a calibrated CPU (local_cluster); 0: a device per process.
  int64_t shared_cores = 0;
  // Seconds each expert exchange costs beyond its on-time figure when the ranks arrive unevenly
  // (measured on this machine: a waiting rank polls with sleeps); 0 elsewhere.
  double late_penalty = 0;
  // How far an all-to-all waits for its most loaded rank's bytes (1: per-device links, as
  // NVLink and NICs) rather than for all ranks' bytes over one shared link (0); measured on this
  // machine (plan/calibrate_comm.h), 1 elsewhere.
  double a2a_receiver_bound = 1;
  // Gradient bytes per second the reduction moves over a group of one process (packing and the
  // collectives' copies; measured here, plan/calibrate_comm.h): what the expert gradients cost
  // under EP without DP. 0: not measured, taken as free.
  double self_reduce_bandwidth = 0;
  // Processes that outnumber this machine's cores (one thread each): the device above is one
  // process computing alone, and its compute gets `compute_share` of that speed at the ratio
  // of its compute (alone) to its communication, interpolated in log ratio between the
  // calibrated `compute_share_ratio` points (ascending; clamped at the ends); measured with the
  // run's process count (plan/calibrate_comm.h). Empty: not modelled (the device's rates are
  // already the process's).
  std::vector<double> compute_share_ratio, compute_share;

  int64_t devices() const { return devices_per_node * nodes; }
};

// Built-in devices: "a100", "h100" (datasheet peaks); "cpu" needs a profile (calibrate).
DeviceModel builtin_device(const std::string& name);
// A device from a profile written by `moetrain plan --calibrate` (the [device] table).
DeviceModel load_profile(const std::string& path);
// comm: the collectives measured with that many processes (plan/calibrate_comm.h); may be empty.
void save_profile(const DeviceModel& d, const DeviceModel& single, double intra_bandwidth,
                  double intra_latency, const std::vector<CommFigures>& comm,
                  const std::string& path);
// A cluster file: [cluster] devices_per_node, nodes, intra/inter_node_bandwidth and _latency,
// and device = "a100" | "h100" | "cpu", or a [device] table with every DeviceModel key.
// `profile` (may be empty) is the device when the file names "cpu" or has none.
ClusterSpec load_cluster(const std::string& path, const std::string& profile);
// This machine as a one-node cluster of `procs` processes sharing its cores, from a profile, each
// process running `threads` OpenMP threads (0: the trainer's default, cores / procs).
ClusterSpec local_cluster(const std::string& profile, int64_t procs, int64_t threads = 0);
// Throws naming the first missing or non-positive key.
void validate(const ClusterSpec& c, const std::string& where);
// The calibrated compute share of oversubscribed processes (ClusterSpec::compute_share) at a
// ratio of compute (alone) to communication: interpolated in log ratio, clamped at the measured
// ends; 1 where the cluster has none.
double compute_share(const ClusterSpec& c, double ratio);

}  // namespace moetrain::plan
