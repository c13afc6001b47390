// The step engine's checkpoints and saved state: what each rank writes and reads, the engine's
// part of trainer_state.json and its restore, and the weights of another run (--init-from).
#include <cstring>

#include "core/check.h"
#include "parallel/grad_sync.h"
#include "train/run_state.h"
#include "train/step_engine.h"

namespace moetrain {

namespace {

// The per-MoE-layer controllers' states (capacity, gating) as one JSON array, and back.
template <class Controllers>
nlohmann::json states_json(const Controllers& controllers) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& c : controllers) a.push_back(c.to_json());
  return a;
}

template <class Controllers>
void restore_states(Controllers& controllers, const nlohmann::json& t, const char* key,
                    const std::string& where) {
  MOETRAIN_CHECK(t.contains(key), "{}: no '{}'", where, key);
  const nlohmann::json& a = t.at(key);
  MOETRAIN_CHECK(a.is_array() && a.size() == controllers.size(),
                 "{}: '{}' must hold one state per MoE layer ({})", where, key,
                 controllers.size());
  for (std::size_t m = 0; m < controllers.size(); ++m) controllers[m].restore(a[m], where);
}

}  // namespace

CheckpointShare StepEngine::checkpoint_share(const std::vector<NamedTensor>& state, bool reading,
                                             float* params) {
  const int rank = pg_->control->rank();
  const bool sharded = world_ > 1 && cfg_.dist.zero >= 1;
  CheckpointShare share = moetrain::checkpoint_share(
      model_.param_table(), params ? params : params_.data(), *optimizer_, writers_, expert_shard_,
      rank, sharded, state, reading, zero3_ != nullptr);
  if (!reading || read_carried_) add_carried_state(share, *reducer_, rank, world_);
  return share;
}

std::filesystem::path StepEngine::save_checkpoint(const std::vector<NamedTensor>& state,
                                                  const CheckpointDocs& docs, int64_t keep) {
  // Local steps: a checkpoint holds one model (train.checkpoint_every is a multiple of
  // dist.sync_every, so only a stop between averagings averages early).
  average_replicas();
  // A resident device holds the current parameters and moments: the host copies catch up.
  if (device_ && device_current_) device_state_to_host(*device_, *optimizer_, params_.data());
  // Every rank writes its own pieces; the checkpoint is complete when any rank returns.
  if (!zero3_)
    return write_checkpoint(*pg_->control, cfg_.run_dir, step_, checkpoint_share(state, false),
                            docs, keep);
  // ZeRO-3: the files hold whole tensors (transformers reads them). Each unit is gathered in
  // turn and the tensors this rank writes copied out of it, at their offsets in a buffer of
  // which only those pages become resident.
  PageBuffer staged(params_.size());
  const std::vector<ParamInfo>& infos = model_.param_table().params();
  const int me = pg_->control->rank();
  const int64_t n = zero3_->units();
  for (int64_t u = 0; u < n; ++u) {
    const FlatRange r = zero3_->range(u);
    zero3_->acquire(u, u + 1 < n ? u + 1 : -1);
    for (std::size_t i = 0; i < infos.size(); ++i)
      if (writers_[i] == me && infos[i].offset >= r.offset && infos[i].offset < r.offset + r.size)
        std::memcpy(staged.data() + infos[i].offset, params_.data() + infos[i].offset,
                    static_cast<std::size_t>(infos[i].numel) * sizeof(float));
    zero3_->release(u);
  }
  return write_checkpoint(*pg_->control, cfg_.run_dir, step_,
                          checkpoint_share(state, false, staged.data()), docs, keep);
}

nlohmann::json StepEngine::state_json() const {
  nlohmann::json t = {
      {"step", step_},
      {"seed", cfg_.seed},
      {"optimizer", {{"name", cfg_.optim.name}, {"step_count", optimizer_->step_count()}}}};
  if (nlohmann::json r = carried_state_record(*reducer_, world_); !r.is_null())
    t["grad_residual"] = r;
  if (scaler_) {
    t["loss_scale"] = {{"scale", scaler_->raw_scale()},
                       {"good_steps", scaler_->good_steps()},
                       {"skipped_steps", scaler_->skipped_steps()}};
  }
  if (!capacity_.empty()) t["capacity_controller"] = states_json(capacity_);
  if (!gating_.empty()) t["gating_controller"] = states_json(gating_);
  if (reweight_) t["expert_reweight"] = reweight_->to_json();
  return t;
}

void StepEngine::restore_state(const nlohmann::json& t, const std::string& where) {
  auto need = [&](const nlohmann::json& j, const char* key) -> const nlohmann::json& {
    MOETRAIN_CHECK(j.is_object() && j.contains(key), "{}: no '{}'", where, key);
    return j.at(key);
  };
  step_ = need(t, "step").get<int64_t>();
  read_carried_ = carried_state_matches(t, *reducer_, world_);
  optimizer_->set_step_count(need(need(t, "optimizer"), "step_count").get<int64_t>());
  if (scaler_ && t.contains("loss_scale")) {
    const nlohmann::json& ls = t["loss_scale"];
    scaler_->restore(ls.value("scale", 1.0), ls.value("good_steps", int64_t{0}),
                     ls.value("skipped_steps", int64_t{0}));
  }
  if (!capacity_.empty()) {
    restore_states(capacity_, t, "capacity_controller", where);
    apply_capacity_factors(capacity_, model_.moe_layers());
  }
  if (!gating_.empty()) restore_states(gating_, t, "gating_controller", where);
  if (reweight_) reweight_->restore(need(t, "expert_reweight"), where);
}

void StepEngine::load_checkpoint(
    const std::filesystem::path& dir, const std::vector<NamedTensor>& state,
    const std::function<void(const nlohmann::json&, const std::string&)>& restore) {
  device_current_ = false;
  const std::filesystem::path file = dir / "trainer_state.json";
  reading_json(file, [&] { restore(read_checkpoint_json(dir, "trainer_state.json"), file.string()); });
  // Each rank reads the ranges it holds, from whichever files hold them.
  // ZeRO-3: each rank reads its shard of the parameters only.
  read_checkpoint_pieces(dir, checkpoint_share(state, true));
  model_.weights_changed();  // the low-precision weight copies follow the loaded weights
  averaged_at_ = step_;      // a checkpoint holds averaged parameters
}

void StepEngine::load_weights(const std::filesystem::path& dir,
                              const std::vector<NamedTensor>& state) {
  verify_checkpoint(dir, &*pg_->control);
  CheckpointShare share = checkpoint_share(state, true);
  share.optimizer.clear();  // the optimizer starts afresh
  read_checkpoint_pieces(dir, share);
  host_params_changed();
}

}  // namespace moetrain
