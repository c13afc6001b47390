// The dynamic capacity controller (`model.capacity = dynamic`) in a sync parameter-server job,
// run by the scheduler. Each worker reports, per clock, each MoE layer's assignments computed,
// capacity slots and tokens per expert (the integers train/accumulate.h sums over the clock's
// micro-batches); once every worker of the clock reported, the scheduler sums them in
// worker-index order (exact: integers), gives each layer's CapacityController
// (moe/capacity_controller.h, the trainers' class) the utilisation and imbalance the trainers take
// from the same sums (train/step_metrics.h), and sends the controllers' new state to the workers,
// which apply it (apply_capacity_factors) before they compute the next clock. So the factors of
// clock c are those `train` sets for step c over the same micro-batches.
//
// The record: each decided clock's utilisation and imbalance per layer, one line each in
// RUN_DIR/metrics/scheduler.jsonl. update() is pure and JSON writes doubles so that they read
// back bitwise, so the state at any clock C is the replay of clocks 0..C−1 from the initial
// controllers: a roll-back to a server checkpoint, a resumed job and a successor scheduler rebuild
// it from the record.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe/capacity_controller.h"
#include "train/accumulate.h"

namespace moetrain::ps {

// A worker's figures of one clock as its CapacityReport carries them: {computed, slots (MoE
// layers), tokens_per_expert (MoE layers, E)}.
nlohmann::json capacity_figures(const Accumulated& acc);

// The same round hands each clock the previous clock's loads summed over every worker (MoE
// layers, E), which worker groups place their hot-expert replicas from (placement.spare_slots in
// a sync job): every group plans from the job's global loads, as every EP group of `train` does.
class CapacityRounds {
 public:
  CapacityRounds() = default;  // inactive: a fixed capacity and no placement
  // `layers` MoE layers of `experts` experts; each controller starts at |cf0|, as the trainers'
  // do, and the factors the layers run with keep cf0's sign (its capacity mode).
  CapacityRounds(const CapacityControlConfig& cfg, double cf0, int64_t layers, int64_t experts);
  // A round without controllers (a fixed capacity): the summed loads only.
  static CapacityRounds loads_only(int64_t layers, int64_t experts);

  bool active() const { return layers_ > 0; }
  // The clock the current state is for: every clock before it is decided.
  int64_t clock() const { return clock_; }
  // The controllers' states (one per MoE layer) to compute clock() with, and clock() − 1's.
  const nlohmann::json& state() const { return state_; }
  const nlohmann::json& previous_state() const { return previous_; }
  bool controlled() const { return controlled_; }
  // The loads of clock() − 1 summed over its workers (MoE layers, E), and of clock() − 2; empty
  // where that clock was not decided here (the first, and after a rewind: placements are not
  // checkpointed, as in `train`).
  const nlohmann::json& loads() const { return loads_; }
  const nlohmann::json& previous_loads() const { return previous_loads_; }

  // Worker `index`'s figures of clock(); throws naming what is malformed.
  void add(int64_t index, const nlohmann::json& figures);
  bool reported(int64_t index) const { return reports_.count(index) > 0; }
  // Sums clock()'s reports in worker-index order, updates every layer's controller and moves on
  // to the next clock. Returns the decided clock's record: {clock, capacity_utilisation,
  // capacity_imbalance, capacity_rule, capacity_factor (the factor the clock ran with, as the
  // layers hold it, which `train` records as capacity_factor)} per layer; null without
  // controllers.
  nlohmann::json decide();

  // The state of `clock` replayed from the record; false (nothing changed) when the record lacks
  // one of the clocks before it.
  bool rewind(int64_t clock);
  // Reads the record lines of `file` (metrics/scheduler.jsonl; none when it does not exist), a
  // later line of a clock replacing an earlier one (a roll-back replays clocks). Returns the
  // clock after the file's last record line (0 without one): the clock the last decision was for.
  int64_t load_record(const std::filesystem::path& file);

 private:
  nlohmann::json states() const;

  CapacityControlConfig cfg_;
  bool controlled_ = true;
  nlohmann::json loads_ = nlohmann::json::array(), previous_loads_ = nlohmann::json::array();
  double cf0_ = 0;
  int64_t layers_ = 0, experts_ = 0, clock_ = 0;
  std::vector<CapacityController> controllers_;
  nlohmann::json state_, previous_;
  std::map<int64_t, nlohmann::json> reports_;  // worker index → figures of clock_
  // clock → (utilisation, imbalance) per layer
  std::map<int64_t, std::pair<std::vector<double>, std::vector<double>>> record_;
};

}  // namespace moetrain::ps
