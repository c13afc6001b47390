// The update rule of one parameter server's key range: what a training step does to the
// parameters a server holds, given the gradient summed over the workers' pushes. Keys
// [begin, param_end) are parameters, stepped by the run's optimizer at the run's learning-rate
// schedule through the one update step (optim/update.h: the non-finite check, the expert
// reweighting, the clip); [param_end, bias_end) are router biases, stepped by the trainers' bias
// rule (moe/balance.h) with the clock's expert loads; the rest are expert token counts (only
// pushed; their values stay zero), from which grad.sparse_experts takes its mask and utilisation
// reweighting its loads. Where an update's figures span several servers' ranges (the global
// norm, the reweighting's sums, the token counts), the update agrees them with the other servers
// through the scheduler (ps/server_rounds.h).
//
// A primary's backup replays each update with the primary's reweighted and clipped sum and its
// side input (side_input: the sparse-expert mask, the importance averages after the update), so
// it applies neither again and ends on the primary's bits.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "optim/expert_reweight.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "optim/sparse_experts.h"
#include "ps/kv_server.h"
#include "ps/options.h"
#include "ps/server_rounds.h"
#include "train/run_config.h"

namespace moetrain::ps {

class ServerUpdate {
 public:
  // keys [begin, end) of the job's keys (job_keys); rounds: the server's link to the scheduler's
  // rounds of an update's figures. All outlive this object.
  ServerUpdate(const RunConfig& cfg, const PsOptions& opts, int64_t begin, int64_t end,
               ServerRounds& rounds);
  ~ServerUpdate();
  void set_name(std::string who) { who_ = std::move(who); }

  // The values of clock 0: the run's initialisation of the range (zeros past the parameters),
  // with a fresh optimizer, schedule and reweighting.
  std::vector<float> init_state();

  // One update (version ≥ 0, of `clock`, under the store's `generation`), or a primary's update
  // that a backup replays (version −1): the router biases, the expert token counts, the check,
  // the reweighting, the clip and the optimizer step of `values` with `sum` (which it changes).
  // Throws (ps/server_rounds.h UpdateAbandoned) when a roll-back abandons the update.
  void step(float* sum, double lr, float* values, const std::string& what, int64_t version,
            int64_t clock, uint32_t generation);
  double lr(int64_t schedule_step) const { return schedule_->lr(schedule_step); }

  // For a backup's replay of the next update: the primary's side input of it.
  void replayed_side(std::string_view side);
  // The side input of the update just applied (see above), for the backup.
  std::string side_input() const;

  // The optimizer's buffers padded to the key range, its step count and the rule's state, for a
  // snapshot to a backup; and back.
  RuleState save_state() const;
  void load_state(const RuleState& st);

  // grad.expert_reweight = importance: its moving averages and steps as JSON text (checkpoints,
  // snapshots, replicated updates); empty otherwise. `where` names the source in errors.
  std::string rule_state() const;
  void restore_rule_state(std::string_view text, const std::string& where);

  Optimizer& optimizer() { return *opt_; }
  const Optimizer& optimizer() const { return *opt_; }

  // Of the latest update: the gradient norm (this range's with one server, the global one with
  // several and a clip), the clip scale (1: none), how many (MoE layer, expert) pairs froze.
  double last_norm() const { return last_norm_; }
  double last_scale() const { return last_scale_; }
  int64_t frozen_experts() const { return frozen_experts_; }

 private:
  void step_router_biases(const float* sum, float* values);
  void take_expert_counts(float* sum, int64_t version, int64_t clock, uint32_t generation);
  bool global_rounds() const;

  const RunConfig& cfg_;
  const PsOptions& opts_;
  ServerRounds& rounds_;
  std::string who_ = "ps server";
  int64_t begin_ = 0, end_ = 0;
  // keys [begin_, param_end_) are parameters, [param_end_, bias_end_) router biases, the rest
  // expert token counts (job_keys)
  int64_t param_end_ = 0, bias_end_ = 0;
  std::unique_ptr<Comm> comm_;        // a key range is its own whole gradient
  std::vector<ExpertPiece> pieces_;   // grad.sparse_experts: the layout's expert tensors
  std::vector<FrozenRange> frozen_;   // the latest update's inactive experts
  std::vector<uint8_t> active_;       // its mask (MoE layers · E), which a backup replays with
  std::vector<FrozenRange> replay_frozen_;  // a backup: the replicated update's frozen ranges
  int64_t frozen_experts_ = 0;
  std::vector<ParamRange> groups_;
  std::unique_ptr<Optimizer> opt_;
  std::unique_ptr<ExpertReweighter> reweight_;  // grad.expert_reweight (grad_norm, utilisation)
  std::unique_ptr<LrSchedule> schedule_;
  double last_norm_ = 0, last_scale_ = 1;
};

}  // namespace moetrain::ps
