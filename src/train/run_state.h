// Run state shared by every collective trainer (the LM and the classifier): where a run starts
// (the checkpoint to resume from, or a fresh run directory), that every rank agrees on it, the
// metrics writer it appends to, and what each rank writes into and reads from a checkpoint.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "model/classifier.h"
#include "model/params.h"
#include "model/transformer.h"
#include "parallel/reducer.h"
#include "parallel/groups.h"
#include "optim/sharded_optimizer.h"

namespace moetrain {

// Collective over control. resume: the run directory's latest complete checkpoint (nullopt when
// it has none; an error when it has committed checkpoints and none of them loads, since a run from
// step 0 would prune them). Not resuming: nullopt.
// `load` reads a verified checkpoint into the trainer; one that fails to load (bad contents
// behind good checksums) is refused and the previous one tried.
std::optional<std::filesystem::path> checkpoint_to_resume(const std::filesystem::path& run_dir,
                                                          bool resume, Comm& control,
                                                          const CheckpointLoad& load);

// The settings every rank must share, flattened to "section.key" → value: the whole
// configuration (its hash leaves out what a resume may change, yet the ranks must still agree on
// it) but for what each process may set for itself, plus `extra` (e.g. the data's sizes).
nlohmann::json rank_settings(const nlohmann::json& config, const nlohmann::json& extra);

// Collective: the ranks run the same settings (rank_settings) and configuration (hash) from the
// same step, or all fail with a message naming the first key that differs and both values.
void check_ranks_agree(Comm& control, const nlohmann::json& settings, uint64_t config_hash,
                       int64_t step);

// The metrics writer of rank 0 (inactive elsewhere): a fresh file, or the lines up to `resumed`;
// with `tensorboard`, also a new event file in run_dir/tb.
MetricsWriter open_metrics(const std::filesystem::path& run_dir, int rank,
                           std::optional<int64_t> resumed, bool tensorboard);

// Parameters as named whole tensors over the flat buffer.
std::vector<NamedTensor> model_views(const ParamTable& layout, float* params);
// Router biases of the aux-loss-free router: state, not parameters.
std::vector<NamedTensor> bias_views(Transformer& model);
std::vector<NamedTensor> bias_views(Classifier& model);

// What this rank writes into a checkpoint (reading = false: each element by one rank, writers[i]
// for tensor i of the layout, optimizer state by the tensor's writer unless sharded (ZeRO-1:
// every rank its pieces), state by rank 0) or reads from one (reading = true: every value it
// holds), as views into its buffers. held: the experts this rank holds. params_sharded (ZeRO-3):
// a reading rank reads the parameters of its optimizer's pieces only (its shard).
CheckpointShare checkpoint_share(const ParamTable& layout, float* params,
                                 ShardedOptimizer& optimizer, const std::vector<int>& writers,
                                 const ExpertShard& held, int rank, bool sharded,
                                 const std::vector<NamedTensor>& state, bool reading,
                                 bool params_sharded = false);

// The state the gradient reducer carries between steps (GradReducer::carried, the error feedback
// of int8 or of grad.sparse_ratio) is per rank: row `rank` of a [world, n] tensor
// "grad_sync.residual" in the state files, each rank writing and reading its own row. It belongs
// to the process layout, so trainer_state.json records its shape ("grad_residual": [world, n],
// then the kind's name unless int8: [world, n, "sparse_ratio"]; absent when there is none).
nlohmann::json carried_state_record(GradReducer& reducer, int world);
// On resume: whether the checkpoint's record matches what this run carries (then its row is
// read). When the run carries state and the record does not match (another layout, or a run
// without the same kind of residual), logs that the residual starts from zero.
bool carried_state_matches(const nlohmann::json& trainer_state, GradReducer& reducer, int world);
void add_carried_state(CheckpointShare& share, GradReducer& reducer, int rank, int world);

// params = the checkpoint's parameters (sized to the model's layout), and the model's router
// biases; returns the step the checkpoint was written at.
int64_t read_weights(const std::filesystem::path& ckpt, Transformer& model,
                     std::vector<float>& params);
int64_t read_weights(const std::filesystem::path& ckpt, Classifier& model,
                     std::vector<float>& params);

// A checkpoint directory, or a run directory's latest complete checkpoint.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& dir);

// Fnv-1a of a JSON document's text, as 16 hex digits.
std::string json_hash(const nlohmann::json& j);

}  // namespace moetrain
