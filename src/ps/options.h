// Options of a parameter-server job. The scheduler holds them and hands them to every node in
// its setup message, so servers and workers need only the scheduler's address.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ps/codec.h"
#include "train/run_config.h"

namespace moetrain::ps {

enum class Consistency { Sync, Quorum, Async, Ssp, HalfSync, Average };
enum class Assign { Uniform, Capability };

// sync | quorum | async | ssp | half_sync | average
Consistency parse_consistency(const std::string& name);
// Whether each push applies alone, on arrival (async, ssp, half_sync), rather than summed per
// clock (sync, quorum).
inline bool applies_per_push(Consistency c) {
  return c == Consistency::Async || c == Consistency::Ssp || c == Consistency::HalfSync;
}
Assign parse_assign(const std::string& name);            // uniform | capability

struct PsOptions {
  int64_t servers = 1;
  int64_t workers = 1;                    // workers to wait for before the first clock
  std::string consistency = "sync";  // sync | quorum | async | ssp | half_sync | average
  int64_t quorum = 0;                     // quorum: pushes that apply a clock (1..workers)
  int64_t staleness = 0;  // ssp, half_sync: how many clocks the fastest may lead the slowest
  double half_sync_wait_ms = 0;  // half_sync: each worker's wait per clock is uniform in [0, this)
  int64_t local_steps = 0;       // average: optimizer steps a worker takes per clock (H ≥ 1)
  std::string push_compression = "none";  // none | bf16 | int8
  std::string pull_compression = "none";  // none | bf16 | int8: parameters on the wire to workers
  bool sparse_push = true;                // experts without tokens are left out of pushes
  std::string assign = "uniform";         // uniform | capability
  double rebalance_every = 2.0;           // capability: seconds between two re-splits at most
  double heartbeat_interval = 0.5;        // seconds between heartbeats
  double heartbeat_timeout = 5.0;         // silence after which a node is declared dead
  int64_t server_replicas = 1;            // 2: every server streams its updates to a backup
  int64_t checkpoint_every = 20;          // clocks between server checkpoints (0: none)
  double server_wait = 60;                // seconds to wait for a dead server's replacement

  // Throws naming the option and what is allowed (e.g. "--quorum 5: must be in 1..4").
  void validate() const;
  Consistency consistency_kind() const { return parse_consistency(consistency); }
  Assign assign_kind() const { return parse_assign(assign); }
  Encoding compression() const { return parse_compression(push_compression, "--push-compression"); }
  Encoding pull_encoding() const { return parse_compression(pull_compression, "--pull-compression"); }
  nlohmann::json to_json() const;
  static PsOptions from_json(const nlohmann::json& j);  // validated
};

// The training settings that parameter-server mode cannot honour with these job options, refused
// with the reason: global-norm clipping over more than one server (the norm spans every server's
// range), the sigmoid_bias router (its bias update needs every worker's expert loads at each
// step), and the others check_ps_run_config's body names.
void check_ps_run_config(const RunConfig& cfg, const PsOptions& options);

// A worker group (`moetrain ps worker --ep P` under `mpirun -n P`) before it registers: P ≥ 1
// and the MPI world (`world` processes) is the group. Throws naming --ep and the world size.
void check_worker_group_size(int64_t ep, int64_t world);
// The settings a worker group of P > 1 processes cannot run with, refused with the reason:
// model.n_experts not a multiple of P, no MoE layer to shard, and hot-expert replicas under
// average (its local steps move the owners between the pulls that refresh the replicas).
void check_worker_group(const RunConfig& cfg, const PsOptions& options, int64_t ep);

struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// The job's keys: the flat parameter vector (model/params.h), then, with model.router =
// sigmoid_bias, one key per MoE layer and expert: a layer's router biases (E) in MoE-layer order.
// Workers push their expert loads (token counts) there and pull the biases with the parameters;
// the server holding them sums the loads of a clock and applies the trainers' bias rule.
int64_t router_bias_keys(const RunConfig& cfg);  // 0 without sigmoid_bias
// With grad.sparse_experts or grad.expert_reweight = utilisation, after the router bias keys:
// (A, MoE layers, E) expert token count keys (A = train.grad_accum). A worker pushes there the
// tokens each expert received in each of its micro-batches (after capacity dropping, what the
// trainers record for the sparse-expert mask); the server holding them has a clock's counts over
// every worker, which the servers share before an update's other global figures
// (ps/global_norm.h). Counts are exact in f32 while the global batch of a micro-batch has at most
// 2^24 tokens (check_ps_run_config). 0 without either setting.
int64_t expert_count_keys(const RunConfig& cfg);
int64_t job_keys(const RunConfig& cfg);  // parameters + router bias keys + expert count keys

// [0, total) cut into `servers` contiguous ranges of nearly equal size, each boundary on a
// 16-float (64-byte) multiple, so every range starts cache-line aligned.
std::vector<KeyRange> split_keys(int64_t total, int64_t servers);

// `rows` rows of the global batch spread over workers in proportion to `weights` (all equal:
// uniform), largest remainder first, every worker getting at least one. Requires rows ≥ count.
std::vector<int64_t> split_rows(int64_t rows, const std::vector<double>& weights);

}  // namespace moetrain::ps
