#include "train/classifier_config.h"

#include <iterator>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "train/config_schema.h"
#include "train/run_state.h"

namespace moetrain {

namespace {

ConfigSchema schema(ClassifierRunConfig& c) {
  ClassifierConfig& m = c.model;
  ClassifierTrainConfig& t = c.train;
  std::vector<Field> fields = {
      {"model.input_dim", &m.input_dim},
      {"model.n_classes", &m.n_classes},
      {"model.dim", &m.dim},
      {"model.n_layers", &m.n_layers},
      {"model.expert_hidden", &m.expert_hidden},
      {"model.n_experts", &m.n_experts},
      {"model.top_k", &m.top_k},
      {"model.router", &m.router},
      {"model.renormalize", &m.renormalize},
      {"model.capacity_factor", &m.capacity_factor},
      {"model.aux_loss_coef", &m.aux_loss_coef},
      {"model.z_loss_coef", &m.z_loss_coef},
      {"model.bias_update_rate", &m.bias_update_rate},
      {"model.shared_expert_hidden", &m.shared_expert_hidden},
      {"model.input_bias", &m.input_bias},
      {"model.norm_eps", &m.norm_eps},
      {"model.init_std", &m.init_std},
      {"data.dir", &c.data.dir},
  };
  add_optim_fields(fields, c.optim);
  const Field train[] = {
      {"train.steps", &t.steps},           {"train.epochs", &t.epochs},
      {"train.batch_size", &t.batch_size}, {"train.seed", &t.seed},
      {"train.eval_every", &t.eval_every}, {"train.eval_batch_size", &t.eval_batch_size},
      {"train.threads", &t.threads},       {"train.run_dir", &t.run_dir},
      {"train.progress", &t.progress},     {"train.checkpoint_every", &t.checkpoint_every},
      {"train.tensorboard", &t.tensorboard},
  };
  fields.insert(fields.end(), std::begin(train), std::end(train));
  return ConfigSchema(std::move(fields));
}

}  // namespace

std::vector<std::string> classifier_config_keys() {
  ClassifierRunConfig c;
  return schema(c).keys();
}

ClassifierRunConfig load_classifier_config(const std::string& path,
                                           const std::vector<std::string>& overrides) {
  ClassifierRunConfig c;
  ConfigSchema s = schema(c);
  if (!path.empty()) s.apply_toml_file(path);
  s.apply_overrides(overrides);
  c.validate();
  return c;
}

ClassifierRunConfig classifier_config_from_json(const nlohmann::json& j, const std::string& where) {
  ClassifierRunConfig c;
  schema(c).apply_json(j, where);
  c.validate();
  return c;
}

void ClassifierRunConfig::validate() const {
  model.validate();
  MOETRAIN_CHECK(!data.dir.empty(), "data.dir must not be empty");
  const ClassifierTrainConfig& t = train;
  MOETRAIN_CHECK(t.steps >= 0, "train.steps = {}: must be ≥ 0", t.steps);
  MOETRAIN_CHECK(t.epochs >= 0, "train.epochs = {}: must be ≥ 0", t.epochs);
  MOETRAIN_CHECK(t.steps == 0 || t.epochs == 0,
                 "train.epochs = {} and train.steps = {}: set only one of them (the other to 0)",
                 t.epochs, t.steps);
  MOETRAIN_CHECK(t.batch_size > 0, "train.batch_size = {}: must be positive", t.batch_size);
  MOETRAIN_CHECK(t.eval_every >= 0, "train.eval_every = {}: must be ≥ 0 (0 = only at the end)",
                 t.eval_every);
  MOETRAIN_CHECK(t.eval_batch_size > 0, "train.eval_batch_size = {}: must be positive",
                 t.eval_batch_size);
  MOETRAIN_CHECK(t.checkpoint_every >= 0,
                 "train.checkpoint_every = {}: must be ≥ 0 (0 = only at the end)",
                 t.checkpoint_every);
  MOETRAIN_CHECK(t.threads >= 0, "train.threads = {}: must be ≥ 0 (0 = all cores)", t.threads);
  MOETRAIN_CHECK(!t.run_dir.empty(), "train.run_dir must not be empty");
  MOETRAIN_CHECK(
      t.progress == "auto" || t.progress == "bar" || t.progress == "lines" || t.progress == "off",
      "train.progress = '{}': allowed are auto, bar, lines, off", t.progress);
  optim.validate();
}

int64_t ClassifierRunConfig::total_steps(int64_t n_train) const {
  if (train.epochs == 0) return train.steps;
  MOETRAIN_CHECK(n_train > 0, "train.epochs = {}: the training set is empty", train.epochs);
  return (train.epochs * n_train + train.batch_size - 1) / train.batch_size;
}

std::string ClassifierRunConfig::config_hash() const {
  nlohmann::json j = to_json();
  // What may change between a run and its resumption without changing what is computed.
  for (const char* k : {"steps", "epochs", "eval_every", "eval_batch_size", "checkpoint_every",
                        "threads", "run_dir", "progress", "tensorboard"})
    j["train"].erase(k);
  j.erase("data");
  return json_hash(j);
}

nlohmann::json ClassifierRunConfig::to_json() const {
  ClassifierRunConfig copy = *this;
  return schema(copy).to_json();
}

}  // namespace moetrain
