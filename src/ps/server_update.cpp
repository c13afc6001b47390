#include "ps/server_update.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/comm.h"
#include "model/params.h"
#include "moe/balance.h"
#include "optim/param_groups.h"
#include "optim/update.h"

namespace moetrain::ps {

ServerUpdate::ServerUpdate(const RunConfig& cfg, const PsOptions& opts, int64_t begin, int64_t end,
                           ServerRounds& rounds)
    : cfg_(cfg), opts_(opts), rounds_(rounds), begin_(begin), end_(end),
      comm_(make_local_comm()) {}

ServerUpdate::~ServerUpdate() = default;

std::vector<float> ServerUpdate::init_state() {
  ParamLayout layout(cfg_.model);
  std::vector<float> full(static_cast<std::size_t>(layout.size()));
  init_params(full.data(), layout, cfg_.model, cfg_.train.seed);
  groups_ = param_groups(layout);
  // Keys past the parameters are router biases (job_keys): zero at the start, as a model's, and
  // stepped by the bias rule, not the optimizer; then the expert token counts, which only carry
  // the workers' pushes (their values stay zero).
  param_end_ = std::clamp(layout.size(), begin_, end_);
  bias_end_ = std::clamp(layout.size() + router_bias_keys(cfg_), begin_, end_);
  if (cfg_.grad.sparse_experts) pieces_ = expert_pieces(layout);
  opt_ = make_optimizer(cfg_.optim.optimizer_config(), groups_, begin_, param_end_);
  if (cfg_.grad.expert_reweight != "none")
    reweight_ = std::make_unique<ExpertReweighter>(cfg_.grad.expert_reweight_config(), layout);
  schedule_ = std::make_unique<LrSchedule>(cfg_.optim.schedule_config(cfg_.train.steps));
  std::vector<float> values(full.begin() + begin_, full.begin() + param_end_);
  values.resize(static_cast<std::size_t>(end_ - begin_), 0.0f);
  return values;
}

// The router-bias keys of this range (past param_end_): the summed pushes there are the clock's
// expert loads over every worker (token counts, exact in f32), and each MoE layer's biases take
// the trainers' rule (bias_update, moe/balance.h) with them, as update_router_biases does after a
// collective step. The range holds whole layers: the bias keys follow the parameters, and
// split_keys cuts on multiples of 16 only where the range is larger than they are.
void ServerUpdate::step_router_biases(const float* sum, float* values) {
  const int64_t E = cfg_.model.n_experts, biases = bias_end_ - param_end_;
  if (biases == 0) return;
  const int64_t at = param_end_ - begin_;
  std::vector<int64_t> load(static_cast<std::size_t>(E));
  for (int64_t l = 0; l < biases; l += E) {
    for (int64_t e = 0; e < E; ++e)
      load[static_cast<std::size_t>(e)] = std::llround(sum[at + l + e]);
    bias_update(values + at + l, load.data(), E, cfg_.model.bias_update_rate);
  }
}

// grad.sparse_experts, utilisation reweighting: the clock's expert token counts over every
// worker, (A, MoE layers, E), from the count keys of the range that holds them, shared through
// the scheduler when there are several servers (the others send zeros, so the sum is those
// counts). Then, as the trainers' step: the mask (active_experts with grad.min_accum_fraction) and
// its frozen ranges, whose rows of the summed gradient are zeroed (the norm and the reweighting
// see only active experts), and the loads the utilisation factors read. A count that a worker
// lost mid-clock rescaled stays ≥ 1 where it was ≥ 1 (the scale is above 1).
void ServerUpdate::take_expert_counts(float* sum, int64_t version, int64_t clock,
                                      uint32_t generation) {
  const int64_t n = expert_count_keys(cfg_);
  std::vector<double> part(static_cast<std::size_t>(n), 0.0);
  if (end_ - bias_end_ == n)
    for (int64_t i = 0; i < n; ++i) part[static_cast<std::size_t>(i)] = sum[bias_end_ - begin_ + i];
  if (opts_.servers > 1) part = rounds_.sums(version, clock, generation, RoundKind::Experts, part);
  std::vector<int64_t> counts(part.size());
  for (std::size_t i = 0; i < part.size(); ++i) counts[i] = std::llround(part[i]);
  const int64_t A = cfg_.train.grad_accum, E = cfg_.model.n_experts,
                L = cfg_.model.n_moe_layers();
  if (cfg_.grad.sparse_experts) {
    active_ = active_experts(counts, A, L * E, cfg_.grad.min_accum_fraction);
    frozen_ = frozen_ranges(pieces_, active_);
    frozen_experts_ = std::count(active_.begin(), active_.end(), uint8_t{0});
    for (const FrozenRange& r : frozen_) {
      const int64_t lo = std::max(r.offset, begin_), hi = std::min(r.offset + r.size, param_end_);
      if (lo < hi) std::fill(sum + (lo - begin_), sum + (hi - begin_), 0.0f);
    }
  }
  if (cfg_.grad.expert_reweight == "utilisation") {
    std::vector<std::vector<int64_t>> loads(static_cast<std::size_t>(L),
                                            std::vector<int64_t>(static_cast<std::size_t>(E), 0));
    for (int64_t a = 0; a < A; ++a)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t e = 0; e < E; ++e)
          loads[static_cast<std::size_t>(l)][static_cast<std::size_t>(e)] +=
              counts[static_cast<std::size_t>((a * L + l) * E + e)];
    reweight_->set_loads(std::move(loads));
  }
}

// A backup's replay: the primary's mask of the update (one byte per MoE layer and expert), then
// its importance averages after the update.
void ServerUpdate::replayed_side(std::string_view side) {
  replay_frozen_.clear();
  if (cfg_.grad.sparse_experts) {
    const int64_t keys = cfg_.model.n_moe_layers() * cfg_.model.n_experts;
    MOETRAIN_CHECK(static_cast<int64_t>(side.size()) >= keys,
                   "{}: a replicated update with {} bytes of mask for {} experts", who_,
                   side.size(), keys);
    active_.assign(side.begin(), side.begin() + keys);
    replay_frozen_ = frozen_ranges(pieces_, active_);
    frozen_experts_ = std::count(active_.begin(), active_.end(), uint8_t{0});
    side.remove_prefix(static_cast<std::size_t>(keys));
  }
  restore_rule_state(side, "a replicated update");
}

// The mask the update just applied went around: the backup's replay steps around it too (its
// range's sum came zeroed there, but a zero gradient still moves AdamW's state). Then the
// importance reweighting's averages after it, which the backup's replay (of the reweighted sum)
// does not compute.
std::string ServerUpdate::side_input() const {
  std::string side;
  if (cfg_.grad.sparse_experts) side.assign(active_.begin(), active_.end());
  return side + rule_state();
}

RuleState ServerUpdate::save_state() const {
  RuleState st;
  // Padded to the key range (a snapshot's buffers are as long as its values): the router bias
  // keys have no optimizer state.
  for (const StateBuffer& b : opt_->state()) {
    st.buffers.emplace_back(b.values.begin(), b.values.end());
    st.buffers.back().resize(static_cast<std::size_t>(end_ - begin_), 0.0f);
  }
  st.steps = opt_->step_count();
  st.extra = rule_state();
  return st;
}

void ServerUpdate::load_state(const RuleState& st) {
  std::vector<StateBuffer> state = opt_->state();
  MOETRAIN_CHECK(state.size() == st.buffers.size(),
                 "the primary's snapshot holds {} optimizer buffers, this optimizer has {}",
                 st.buffers.size(), state.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    MOETRAIN_CHECK(st.buffers[i].size() == static_cast<std::size_t>(end_ - begin_),
                   "optimizer buffer '{}': {} values in the snapshot, {} keys here", state[i].name,
                   st.buffers[i].size(), end_ - begin_);
    std::copy_n(st.buffers[i].begin(), state[i].values.size(), state[i].values.begin());
  }
  opt_->set_step_count(st.steps);
  restore_rule_state(st.extra, "the primary's snapshot");
}

// JSON numbers give doubles back exactly.
std::string ServerUpdate::rule_state() const {
  return cfg_.grad.expert_reweight == "importance" ? reweight_->to_json().dump() : std::string();
}

void ServerUpdate::restore_rule_state(std::string_view text, const std::string& where) {
  if (cfg_.grad.expert_reweight != "importance") return;
  MOETRAIN_CHECK(!text.empty(), "{}: {} has no importance reweighting state", who_, where);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOETRAIN_FAIL("{}: {}'s importance reweighting state is not JSON: {}", who_, where, e.what());
  }
  reweight_->restore(j, fmt::format("{} ({})", where, who_));
}

// Whether an update's global figures span several servers' ranges (sync mode;
// check_ps_run_config refuses the other modes): the scheduler adds the servers' parts
// (ps/global_norm.h).
bool ServerUpdate::global_rounds() const {
  return opts_.servers > 1 && (cfg_.optim.grad_clip > 0 || reweight_ != nullptr);
}

// With one server the range is the whole gradient, and check_and_clip reweights and clips it as
// the single-process step does. With several, each expert's figures and then the squared norm go
// to the scheduler, and the update waits for their sums over every range. The primary replicates
// the reweighted and clipped sum, so a backup's replay applies neither again. Before all of them,
// the expert token counts (take_expert_counts): the sparse-expert mask, whose frozen experts the
// optimizer leaves as they are, and the utilisation loads.
void ServerUpdate::step(float* sum, double lr, float* values, const std::string& what,
                        int64_t version, int64_t clock, uint32_t generation) {
  step_router_biases(sum, values);
  FlatGradient grads(sum, param_end_ - begin_, begin_);
  const bool replay = version < 0, rounds = global_rounds();
  frozen_.clear();
  if (replay) frozen_ = replay_frozen_;
  if (!replay && expert_count_keys(cfg_) > 0) take_expert_counts(sum, version, clock, generation);
  UpdateOptions o;
  o.grad_clip = rounds || replay ? 0.0 : cfg_.optim.grad_clip;
  o.reweight = rounds || replay ? nullptr : reweight_.get();
  o.where = fmt::format("{}, keys [{}, {})", what, begin_, end_);
  o.advice = "Lower optim.lr or raise optim.warmup_steps";
  const UpdateOutcome out = check_and_clip(grads, *comm_, o);
  if (out.skipped) return;
  last_norm_ = out.grad_norm;
  last_scale_ = out.clip_coef;
  if (rounds && !replay) {
    // utilisation's factors come from the loads alone: its sums are zeros, no round needed.
    if (reweight_ && cfg_.grad.expert_reweight == "utilisation")
      reweight_->apply_sums(grads, reweight_->partial_sums(grads));
    else if (reweight_)
      reweight_->apply_sums(grads, rounds_.sums(version, clock, generation, RoundKind::Reweight,
                                                reweight_->partial_sums(grads)));
    if (cfg_.optim.grad_clip > 0) {
      const nlohmann::json j =
          rounds_.agree(version, clock, generation, RoundKind::Clip, {grads.sum_squares()});
      const double scale = j.at("scale").get<double>();
      if (scale != 1.0) grads.scale(static_cast<float>(scale));
      last_norm_ = j.at("norm").get<double>();
      last_scale_ = scale;
    }
  }
  opt_->step(values, sum, static_cast<float>(lr), frozen_);
}

}  // namespace moetrain::ps
