// A language model's checkpoint: the config.json it writes, and the trained model read back for
// evaluation, sampling and the forward dump (from a checkpoint directory, a run directory or a
// Hugging Face Mixtral directory).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "train/run_config.h"

namespace moetrain {

// config.json of a checkpoint of a run of cfg: MixtralConfig's keys (or our own architecture's
// name where transformers' Mixtral would compute something else) and the run's configuration.
nlohmann::json lm_checkpoint_config(const RunConfig& cfg);

// A model with its parameters, for evaluation, sampling and the forward dump.
struct LoadedModel {
  RunConfig config;
  std::unique_ptr<Transformer> model;
  std::vector<float> params;  // the router biases of a sigmoid_bias run are in the model's layers
  int64_t step = 0;
  // Sequence length the model was trained on (train.seq_len of the checkpoint's run config); a
  // checkpoint that does not record it gives model.max_seq_len.
  int64_t trained_context = 0;
  // The checkpoint's tokenizer (its tokenizer.model), or bytes where it has none.
  Tokenizer tokenizer;
};

// Loads a checkpoint directory, a run directory (its latest complete checkpoint), or a plain
// Hugging Face Mixtral directory (io/hf_checkpoint.h: step 0, the default run settings).
LoadedModel load_model(const std::filesystem::path& dir);

// The model configuration of any directory load_model takes.
ModelConfig model_config_of(const std::filesystem::path& dir);

// The parameters of a Hugging Face directory into `params` (sized to the model's layout).
void read_hf_weights(const std::filesystem::path& dir, Transformer& model,
                     std::vector<float>& params);

// `train --init-from DIR`: `model` takes DIR's architecture (every key that changes the tensors or
// what they compute; each one that differs is logged), keeping the run's training coefficients
// (aux_loss_coef, z_loss_coef, bias_update_rate, init_std).
void adopt_architecture(ModelConfig& model, const ModelConfig& from, const std::string& where);

}  // namespace moetrain
