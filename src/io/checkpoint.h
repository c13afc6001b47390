// Checkpoint directories. A checkpoint is RUN_DIR/checkpoints/step_NNNNNNNN/ holding
//   model.safetensors      parameters under their Hugging Face names
//   config.json            the model in MixtralConfig form (plus moetrain's own run config)
//   optimizer.safetensors  optimizer moments, by "<state>.<parameter name>"
//   state.safetensors      training state that is not a parameter (router biases, ...)
//   trainer_state.json     step, seeds, config hash, optimizer step count
//   manifest.json          every file above with its size and CRC-32, written last
// The directory is built under a temporary name, fsynced, and renamed into place; the file
// RUN_DIR/checkpoints/latest is updated after that. A checkpoint without a valid manifest, or
// whose files do not match it, is refused and the previous complete one is used.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace moetrain {

// A named float tensor in the caller's memory: written from, or read into.
struct NamedTensor {
  std::string name;
  Shape shape;
  float* data;
};

struct CheckpointContents {
  std::vector<NamedTensor> model;
  std::vector<NamedTensor> optimizer;
  std::vector<NamedTensor> state;
  nlohmann::json config;   // config.json
  nlohmann::json trainer;  // trainer_state.json
};

std::filesystem::path checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);

// Writes the checkpoint for `step` atomically, points `latest` at it, and removes all but the
// newest `keep` complete checkpoints. Returns its directory.
std::filesystem::path write_checkpoint(const std::filesystem::path& run_dir, int64_t step,
                                       const CheckpointContents& contents, int64_t keep);

// Verifies a checkpoint directory against its manifest (sizes and CRC-32s); throws naming the
// file and what is wrong.
void verify_checkpoint(const std::filesystem::path& dir);

// The newest complete checkpoint of a run: `latest` if it verifies, else the newest older one
// that does (each refusal is logged with its reason). nullopt if there is none.
std::optional<std::filesystem::path> find_latest_checkpoint(const std::filesystem::path& run_dir);

// Reads config.json and trainer_state.json only (to rebuild a model before loading tensors).
nlohmann::json read_checkpoint_json(const std::filesystem::path& dir, const std::string& file);

// Fills every tensor listed in `into` from the checkpoint (names and shapes must match exactly;
// an empty group is not read). Also fills into.config / into.trainer. Verifies first.
void read_checkpoint(const std::filesystem::path& dir, CheckpointContents& into);

}  // namespace moetrain
