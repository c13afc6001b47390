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
      {"model.input_dim", &m.input_dim, "D: values per input image (28·28 pixels)"},
      {"model.n_classes", &m.n_classes, "Classes the head predicts"},
      {"model.dim", &m.dim, "C: the model width"},
      {"model.n_layers", &m.n_layers, "L: blocks in the model"},
      {"model.norm_eps", &m.norm_eps, "Epsilon of the RMS norms"},
      {"model.init_std", &m.init_std, "Standard deviation of the initial weights"},
      {"model.input_bias", &m.input_bias, "A bias on the input projection"},
  };
  add_moe_fields(fields, m);
  add_run_fields(fields, c.data.dir, c.optim, t, c.dist);
  add_grad_fields(fields, c.grad);
  add_balance_fields(fields, m);  // [balance], [gating]: the controllers, as in the LM's config
  const Field train[] = {
      {"train.epochs", &t.epochs,
       "Classifier: passes over the training set (> 0 sets the steps; then train.steps = 0)"},
      {"train.eval_batch_size", &t.eval_batch_size,
       "Classifier: test images per evaluation forward"},
  };
  fields.insert(fields.end(), std::begin(train), std::end(train));
  return ConfigSchema(std::move(fields));
}

}  // namespace

std::vector<std::string> classifier_config_keys() {
  ClassifierRunConfig c;
  return schema(c).keys();
}

std::string classifier_config_help(const std::string& section) {
  ClassifierRunConfig c;
  return schema(c).describe(section);
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
  nlohmann::json now = j;
  read_moe_keys_as_now(now);
  schema(c).apply_json(now, where);
  c.validate();
  return c;
}

void ClassifierRunConfig::validate() const {
  model.validate();
  MOETRAIN_CHECK(!data.dir.empty(), "data.dir must not be empty");
  const ClassifierTrainConfig& t = train;
  validate_loop(t);
  MOETRAIN_CHECK(t.epochs >= 0, "train.epochs = {}: must be ≥ 0", t.epochs);
  MOETRAIN_CHECK(t.steps == 0 || t.epochs == 0,
                 "train.epochs = {} and train.steps = {}: set only one of them (the other to 0)",
                 t.epochs, t.steps);
  MOETRAIN_CHECK(t.eval_batch_size > 0, "train.eval_batch_size = {}: must be positive",
                 t.eval_batch_size);
  optim.validate();
  dist.validate();
  MOETRAIN_CHECK(dist.tp == 1,
                 "dist.tp = {}: the classifier runs no tensor parallelism (the language model "
                 "does); set dist.tp = 1",
                 dist.tp);
  MOETRAIN_CHECK(dist.etp == 1,
                 "dist.etp = {}: the classifier runs no expert tensor parallelism (the language "
                 "model does); set dist.etp = 1",
                 dist.etp);
  MOETRAIN_CHECK(dist.pp == 1,
                 "dist.pp = {}: the classifier runs no pipeline stages (the language model "
                 "does); set dist.pp = 1",
                 dist.pp);
  dist.validate_offload(t.run_dir, "cpu");
  MOETRAIN_CHECK(!dist.local_steps(),
                 "dist.sync = params: the classifier trainer reduces gradients every step "
                 "(local SGD is for the language-model trainer)");
  MOETRAIN_CHECK(dist.zero <= 2,
                 "dist.zero = 3: the classifier's parameters are not split into gather units; "
                 "it shards up to dist.zero = 2 (the language model trains under 3)");
  grad.validate();
  grad.validate_reduction(dist, /*fp16=*/false);  // the classifier computes in f32
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
                        "threads", "run_dir", "progress", "tensorboard", "profile"})
    j["train"].erase(k);
  j.erase("data");
  j.erase("dist");
  // Fixed capacities and the sign rule hash as they did before the controllers reached the
  // classifier (their checkpoints still resume); the controllers' settings only matter with them.
  if (model.capacity == CapacityMode::Fixed) {
    j["model"].erase("capacity");
    j.erase("balance");
  }
  if (model.router_controller == RouterControllerKind::None) {
    j["model"].erase("router_controller");
    j.erase("gating");
  }
  if (model.router_skew == 0) j["model"].erase("router_skew");  // older checkpoints resume
  erase_inert_grad_keys(j, grad);
  hash_moe_keys_as_before(j);
  return json_hash(j);
}

nlohmann::json ClassifierRunConfig::to_json() const {
  ClassifierRunConfig copy = *this;
  return schema(copy).to_json();
}

}  // namespace moetrain
