#include "ps/options.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"
#include "model/params.h"
#include "train/config_schema.h"

namespace moetrain::ps {

Consistency parse_consistency(const std::string& name) {
  if (name == "sync") return Consistency::Sync;
  if (name == "quorum") return Consistency::Quorum;
  if (name == "async") return Consistency::Async;
  if (name == "ssp") return Consistency::Ssp;
  if (name == "half_sync") return Consistency::HalfSync;
  if (name == "average") return Consistency::Average;
  MOETRAIN_FAIL("--consistency '{}': allowed are sync, quorum, async, ssp, half_sync, average",
                name);
}

Assign parse_assign(const std::string& name) {
  if (name == "uniform") return Assign::Uniform;
  if (name == "capability") return Assign::Capability;
  MOETRAIN_FAIL("--assign '{}': allowed are uniform, capability", name);
}

void PsOptions::validate() const {
  MOETRAIN_CHECK(servers >= 1 && servers <= 64, "--servers {}: must be in 1..64", servers);
  MOETRAIN_CHECK(workers >= 1 && workers <= 256, "--workers {}: must be in 1..256", workers);
  const Consistency c = consistency_kind();
  if (c == Consistency::Quorum) {
    MOETRAIN_CHECK(quorum >= 1 && quorum <= workers,
                   "--quorum {}: with --consistency quorum it must be in 1..{} (the workers)",
                   quorum, workers);
  } else {
    MOETRAIN_CHECK(quorum == 0, "--quorum {} is only meaningful with --consistency quorum", quorum);
  }
  if (c == Consistency::Ssp || c == Consistency::HalfSync) {
    MOETRAIN_CHECK(staleness >= 0, "--staleness {}: must be ≥ 0", staleness);
  } else {
    MOETRAIN_CHECK(staleness == 0,
                   "--staleness {} is only meaningful with --consistency ssp or half_sync",
                   staleness);
  }
  if (c == Consistency::HalfSync) {
    MOETRAIN_CHECK(std::isfinite(half_sync_wait_ms) && half_sync_wait_ms > 0 &&
                       half_sync_wait_ms <= 60000,
                   "--half-sync-wait-ms {}: with --consistency half_sync it must be in (0, 60000] "
                   "milliseconds",
                   half_sync_wait_ms);
  } else {
    MOETRAIN_CHECK(half_sync_wait_ms == 0,
                   "--half-sync-wait-ms {} is only meaningful with --consistency half_sync",
                   half_sync_wait_ms);
  }
  if (c == Consistency::Average) {
    MOETRAIN_CHECK(local_steps >= 1 && local_steps <= 100000,
                   "--local-steps {}: with --consistency average it must be in 1..100000",
                   local_steps);
    // A push carries parameters: every element counts (no sparse ranges), and a rounded or
    // quantised parameter would be the servers' value from then on.
    MOETRAIN_CHECK(push_compression == "none",
                   "--push-compression {} with --consistency average: pushes carry parameters, "
                   "which the servers take as they come; use --push-compression none",
                   push_compression);
  } else {
    MOETRAIN_CHECK(local_steps == 0,
                   "--local-steps {} is only meaningful with --consistency average", local_steps);
  }
  (void)compression();
  (void)pull_encoding();
  (void)assign_kind();
  MOETRAIN_CHECK(std::isfinite(rebalance_every) && rebalance_every > 0,
                 "--rebalance-every {}: must be a positive number of seconds", rebalance_every);
  MOETRAIN_CHECK(std::isfinite(heartbeat_interval) && heartbeat_interval > 0,
                 "--heartbeat-interval {}: must be a positive number of seconds",
                 heartbeat_interval);
  MOETRAIN_CHECK(std::isfinite(heartbeat_timeout) && heartbeat_timeout >= 2 * heartbeat_interval,
                 "--heartbeat-timeout {}: must be at least twice --heartbeat-interval ({})",
                 heartbeat_timeout, heartbeat_interval);
  MOETRAIN_CHECK(server_replicas == 1 || server_replicas == 2,
                 "--server-replicas {}: must be 1 (checkpoints only) or 2 (a backup per server)",
                 server_replicas);
  MOETRAIN_CHECK(checkpoint_every >= 0, "--checkpoint-every {}: must be ≥ 0 clocks (0: none)",
                 checkpoint_every);
  MOETRAIN_CHECK(std::isfinite(server_wait) && server_wait > 0,
                 "--server-wait {}: must be a positive number of seconds", server_wait);
}

nlohmann::json PsOptions::to_json() const {
  return {{"servers", servers},
          {"workers", workers},
          {"consistency", consistency},
          {"quorum", quorum},
          {"staleness", staleness},
          {"half_sync_wait_ms", half_sync_wait_ms},
          {"local_steps", local_steps},
          {"push_compression", push_compression},
          {"pull_compression", pull_compression},
          {"sparse_push", sparse_push},
          {"assign", assign},
          {"rebalance_every", rebalance_every},
          {"heartbeat_interval", heartbeat_interval},
          {"heartbeat_timeout", heartbeat_timeout},
          {"server_replicas", server_replicas},
          {"checkpoint_every", checkpoint_every},
          {"server_wait", server_wait}};
}

PsOptions PsOptions::from_json(const nlohmann::json& j) {
  PsOptions o;
  try {
    o.servers = j.at("servers").get<int64_t>();
    o.workers = j.at("workers").get<int64_t>();
    o.consistency = j.at("consistency").get<std::string>();
    o.quorum = j.at("quorum").get<int64_t>();
    o.staleness = j.at("staleness").get<int64_t>();
    o.half_sync_wait_ms = j.at("half_sync_wait_ms").get<double>();
    o.local_steps = j.at("local_steps").get<int64_t>();
    o.push_compression = j.at("push_compression").get<std::string>();
    o.pull_compression = j.at("pull_compression").get<std::string>();
    o.sparse_push = j.at("sparse_push").get<bool>();
    o.assign = j.at("assign").get<std::string>();
    o.rebalance_every = j.value("rebalance_every", 2.0);  // jobs recorded before the option
    o.heartbeat_interval = j.at("heartbeat_interval").get<double>();
    o.heartbeat_timeout = j.at("heartbeat_timeout").get<double>();
    o.server_replicas = j.at("server_replicas").get<int64_t>();
    o.checkpoint_every = j.at("checkpoint_every").get<int64_t>();
    o.server_wait = j.at("server_wait").get<double>();
  } catch (const nlohmann::json::exception& e) {
    MOETRAIN_FAIL("parameter-server options in the setup message: {}", e.what());
  }
  o.validate();
  return o;
}

namespace {

// The [dist] keys whose values differ from their defaults, "dist.ep = 2" each.
std::vector<std::string> changed_dist_keys(const DistSettings& d) {
  DistSettings given = d, defaults;
  std::vector<Field> a, b;
  add_dist_fields(a, given);
  add_dist_fields(b, defaults);
  const nlohmann::json ja = ConfigSchema(a).to_json().at("dist"),
                       jb = ConfigSchema(b).to_json().at("dist");
  std::vector<std::string> out;
  for (const auto& [key, value] : ja.items())
    if (value != jb.at(key)) out.push_back(fmt::format("dist.{} = {}", key, value.dump()));
  return out;
}

}  // namespace

void check_ps_run_config(const RunConfig& cfg, const PsOptions& options) {
  cfg.validate();
  // A worker is one process holding a full replica, or a group of processes sharding the experts
  // (`ps worker --ep P`), whose layout the worker's flags say: nothing of [dist] applies, and a
  // setting that would be ignored is refused rather than recorded as if it ran.
  const std::vector<std::string> dist = changed_dist_keys(cfg.dist);
  MOETRAIN_CHECK(dist.empty(),
                 "{}: parameter-server mode runs one full model replica per worker process, or "
                 "the experts sharded over a worker group started with `mpirun -n P moetrain ps "
                 "worker --ep P`, and does not read the [dist] settings (data and expert "
                 "parallelism, ZeRO, the reduction and all-to-all settings, local SGD); remove {}",
                 fmt::join(dist, ", "), dist.size() == 1 ? "it" : "them");
  MOETRAIN_CHECK(cfg.train.device == "cpu",
                 "train.device = {}: parameter-server workers run on the CPU; set "
                 "train.device = cpu",
                 cfg.train.device);
  MOETRAIN_CHECK(cfg.train.precision == Precision::F32 || cfg.train.precision == Precision::BF16,
                 "train.precision = {}: parameter-server workers compute in f32 or bf16 (fp16's "
                 "loss scale would have to be agreed by every worker at each step); set "
                 "train.precision = f32 or bf16",
                 precision_name(cfg.train.precision));
  // Global-norm clipping: one server's range is the whole gradient; with several, a sync clock's
  // partial norms meet at the scheduler (ps/global_norm.h), and average clips on the workers,
  // whose local steps see their whole gradient.
  const Consistency mode = options.consistency_kind();
  MOETRAIN_CHECK(cfg.optim.grad_clip == 0 || options.servers == 1 || mode == Consistency::Sync ||
                     mode == Consistency::Average,
                 "optim.grad_clip = {} with --servers {} and --consistency {}: the global norm "
                 "spans every server's key range, and only sync gathers the servers' partial "
                 "norms of one update ({} applies {}, so an update on one server has no "
                 "counterpart to wait for on the others); use --consistency sync, --servers 1, or set --set "
                 "optim.grad_clip=0",
                 cfg.optim.grad_clip, options.servers, options.consistency,
                 options.consistency,
                 mode == Consistency::Quorum ? "the first q pushes of a clock, which may not be "
                                               "the same workers' on every server"
                                             : "each push on arrival, in an order of their own "
                                               "on each server");
  // sigmoid_bias: the loads of a clock are summed on a server and the rule applied once per clock.
  MOETRAIN_CHECK(cfg.model.router != RouterKind::SigmoidBias || mode == Consistency::Sync,
                 "model.router = sigmoid_bias with --consistency {}: its bias update needs every "
                 "worker's expert loads of a step, which only sync sums into one update per "
                 "clock; use --consistency sync",
                 options.consistency);
  MOETRAIN_CHECK(cfg.model.router != RouterKind::SigmoidBias ||
                     (options.compression() == Encoding::F32 &&
                      options.pull_encoding() == Encoding::F32),
                 "model.router = sigmoid_bias with --push-compression {} --pull-compression {}: "
                 "the expert loads and the router biases travel as exact f32 values (a rounded "
                 "bias moves the routing); use --push-compression none --pull-compression none",
                 options.push_compression, options.pull_compression);
  // The dynamic capacity controller runs at the scheduler on the summed figures of every worker
  // of a clock, whose factors they all wait for before the next (ps/capacity_rounds.h).
  MOETRAIN_CHECK(cfg.model.capacity == CapacityMode::Fixed || mode == Consistency::Sync,
                 "model.capacity = dynamic with --consistency {}: the controller sets a clock's "
                 "factors from the figures of every worker of the clock before, and {}; use "
                 "--consistency sync or model.capacity = fixed",
                 options.consistency,
                 mode == Consistency::Quorum
                     ? "quorum applies a clock without the pushes past its quorum, whose workers "
                       "go on without waiting for the others"
                 : mode == Consistency::Average
                     ? "average's local steps are optimizer steps of each worker alone, with no "
                       "clock-wide figures between them"
                     : "async, ssp and half_sync have no clock that every worker computes (each "
                       "push is an update of its own)");
  // Sparse expert gradients and utilisation reweighting: the workers push their per-micro-batch
  // expert token counts on keys of their own (expert_count_keys); sync sums a clock's into one
  // update, and the servers share them before the update's other global figures.
  const bool counts = expert_count_keys(cfg) > 0;
  const std::string counted =
      cfg.grad.sparse_experts ? "grad.sparse_experts = true"
                              : fmt::format("grad.expert_reweight = {}", cfg.grad.expert_reweight);
  MOETRAIN_CHECK(!counts || mode == Consistency::Sync,
                 "{} with --consistency {}: the mask (or the factors) needs every worker's "
                 "tokens per expert of a step, which only sync sums into one update per clock "
                 "({}); use --consistency sync",
                 counted, options.consistency,
                 mode == Consistency::Average ? "average's workers step on their own"
                 : mode == Consistency::Quorum
                     ? "quorum applies the first q pushes, a part of the step's tokens"
                     : "it applies each push on arrival");
  MOETRAIN_CHECK(!counts || options.compression() == Encoding::F32,
                 "{} with --push-compression {}: the workers' expert token counts travel with "
                 "their pushes and must arrive exact; use --push-compression none",
                 counted, options.push_compression);
  // A count of one expert in one micro-batch is at most the micro-batch's tokens over every
  // worker (top-k picks distinct experts), and f32 sums integers exactly up to 2^24.
  const int64_t micro_tokens = options.workers * cfg.train.batch_size * cfg.train.seq_len;
  MOETRAIN_CHECK(!counts || micro_tokens <= (int64_t{1} << 24),
                 "{} with --workers {}, train.batch_size = {}, train.seq_len = {}: a "
                 "micro-batch's {} tokens over every worker could make an expert's count "
                 "inexact in the f32 sums of the pushes (at most 2^24 = 16777216); use fewer "
                 "rows per worker",
                 counted, options.workers, cfg.train.batch_size, cfg.train.seq_len, micro_tokens);
  MOETRAIN_CHECK(cfg.grad.sparse_ratio == 0,
                 "grad.sparse_ratio = {}: parameter-server mode pushes whole key ranges and "
                 "has no sparse reduction; set grad.sparse_ratio = 0",
                 cfg.grad.sparse_ratio);
  // Expert reweighting: grad_norm's and importance's factors come from the reduced gradient
  // (importance's moving averages travel with server checkpoints, snapshots and replicated
  // updates), utilisation's from the count keys; with several servers a sync update's per-expert
  // figures meet at the scheduler (ps/global_norm.h).
  MOETRAIN_CHECK(cfg.grad.expert_reweight == "none" ||
                     (mode != Consistency::Average &&
                      (options.servers == 1 || mode == Consistency::Sync)),
                 "grad.expert_reweight = {} with --servers {} and --consistency {}: the factors "
                 "need each expert's whole summed gradient of one update, which {}; use "
                 "--consistency sync",
                 cfg.grad.expert_reweight, options.servers, options.consistency,
                 mode == Consistency::Average
                     ? "average's pushes of parameters do not carry"
                     : "only sync gathers from several servers");
}

void check_worker_group_size(int64_t ep, int64_t world) {
  MOETRAIN_CHECK(ep >= 1, "--ep {}: a worker group has at least one process", ep);
  MOETRAIN_CHECK(ep == world,
                 "--ep {} in an MPI world of {} process{}: a worker group is every process "
                 "mpirun started; start it with `mpirun -n {} moetrain ps worker --ep {} ...`",
                 ep, world, world == 1 ? "" : "es", ep, ep);
}

void check_worker_group(const RunConfig& cfg, const PsOptions& options, int64_t ep) {
  // Replicas live on the other ranks of an expert-parallel group: a worker alone has none.
  MOETRAIN_CHECK(ep > 1 || cfg.placement.spare_slots == 0,
                 "placement.spare_slots = {} on a worker without --ep: hot-expert replicas are "
                 "placed over a worker group's ranks; start the workers as groups (--ep P, or "
                 "`ps launch --group-size P`) or set placement.spare_slots = 0",
                 cfg.placement.spare_slots);
  if (ep == 1) return;
  MOETRAIN_CHECK(cfg.model.n_moe_layers() > 0,
                 "--ep {}: the model has no MoE layer whose experts the group could shard; "
                 "start the worker without --ep",
                 ep);
  MOETRAIN_CHECK(cfg.model.n_experts % ep == 0,
                 "--ep {}: model.n_experts = {} is not a multiple of it; every rank of a group "
                 "holds the same number of experts",
                 ep, cfg.model.n_experts);
  MOETRAIN_CHECK(cfg.placement.spare_slots <= cfg.model.n_experts / ep,
                 "placement.spare_slots = {} with --ep {}: at most the experts a rank holds ({} of "
                 "{})",
                 cfg.placement.spare_slots, ep, cfg.model.n_experts / ep, cfg.model.n_experts);
  // A group's ranks push disjoint parts of the keys, which every mode applies as one update: sync
  // and average sum every push of a clock, quorum counts whole groups, and async, ssp and
  // half_sync hold a group's parts of a clock until the last (ps/consistency.h). Average's local
  // steps run the group's exchange and dense reduction, but hot-expert replicas follow their
  // owners' weights only at a pull, while the local steps move the owners between pulls.
  const Consistency mode = options.consistency_kind();
  MOETRAIN_CHECK(mode != Consistency::Average || cfg.placement.spare_slots == 0,
                 "placement.spare_slots = {} with --ep {} and --consistency average: a replica "
                 "takes its owner's weights once a clock, after the pull, and the group's local "
                 "steps change the owners' weights {} times between pulls; set "
                 "placement.spare_slots = 0 or use another consistency mode",
                 cfg.placement.spare_slots, ep, options.local_steps);
  // The keys past the parameters (router biases, expert token counts) are dense keys of the
  // group (make_group_keys): each rank's loads and counts of its own tokens are summed over the
  // group by its reduce-scatter (integers, exact in f32) and pushed by one rank, and the biases
  // the server stepped come back to every rank with the dense values. Under model.capacity =
  // dynamic each rank is a worker of the scheduler's capacity round, which sums the ranks'
  // figures as `train` sums its processes'. --assign capability weighs a group as one (its
  // ranks answer a re-split together between two clocks: ps/worker_control.cpp).
}

int64_t router_bias_keys(const RunConfig& cfg) {
  return cfg.model.router == RouterKind::SigmoidBias
             ? cfg.model.n_moe_layers() * cfg.model.n_experts
             : 0;
}

int64_t expert_count_keys(const RunConfig& cfg) {
  return cfg.grad.sparse_experts || cfg.grad.expert_reweight == "utilisation"
             ? cfg.train.grad_accum * cfg.model.n_moe_layers() * cfg.model.n_experts
             : 0;
}

int64_t job_keys(const RunConfig& cfg) {
  return ParamLayout(cfg.model).size() + router_bias_keys(cfg) + expert_count_keys(cfg);
}

std::vector<KeyRange> split_keys(int64_t total, int64_t servers) {
  MOETRAIN_CHECK(servers >= 1 && total >= 0, "cannot split {} keys over {} servers", total,
                 servers);
  constexpr int64_t kAlign = 16;
  std::vector<KeyRange> out;
  int64_t at = 0;
  for (int64_t s = 0; s < servers; ++s) {
    int64_t end = s + 1 == servers ? total : (total * (s + 1) / servers) / kAlign * kAlign;
    end = std::clamp(end, at, total);
    out.push_back({at, end});
    at = end;
  }
  return out;
}

std::vector<int64_t> split_rows(int64_t rows, const std::vector<double>& weights) {
  const auto n = static_cast<int64_t>(weights.size());
  MOETRAIN_CHECK(n >= 1 && rows >= n, "a global batch of {} rows cannot feed {} workers", rows, n);
  double sum = 0;
  for (double w : weights) {
    MOETRAIN_CHECK(std::isfinite(w) && w > 0, "worker weight {} must be positive", w);
    sum += w;
  }
  // One row each first, then the rest in proportion.
  const int64_t spare = rows - n;
  std::vector<int64_t> out(weights.size(), 1);
  std::vector<std::pair<double, int64_t>> rem;
  int64_t given = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double share = static_cast<double>(spare) * weights[i] / sum;
    const auto whole = static_cast<int64_t>(std::floor(share));
    out[i] += whole;
    given += whole;
    rem.push_back({share - static_cast<double>(whole), i});
  }
  std::stable_sort(rem.begin(), rem.end(), [](auto a, auto b) { return a.first > b.first; });
  for (int64_t k = 0; given < spare; ++k, ++given) out[rem[k % n].second] += 1;
  return out;
}

}  // namespace moetrain::ps
