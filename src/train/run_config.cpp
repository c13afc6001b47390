#include "train/run_config.h"

#include <fmt/format.h>

#include <charconv>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>
#include <variant>

#include "core/check.h"

namespace moetrain {

namespace {

using FieldPtr = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*>;

struct Field {
  std::string key;  // "section.name"
  FieldPtr ptr;
};

std::vector<Field> schema(RunConfig& c) {
  ModelConfig& m = c.model;
  TrainConfig& t = c.train;
  OptimSettings& o = c.optim;
  return {
      {"model.vocab_size", &m.vocab_size},
      {"model.dim", &m.dim},
      {"model.n_layers", &m.n_layers},
      {"model.n_heads", &m.n_heads},
      {"model.n_kv_heads", &m.n_kv_heads},
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
      {"model.dense_every", &m.dense_every},
      {"model.dense_hidden", &m.dense_hidden},
      {"model.max_seq_len", &m.max_seq_len},
      {"model.rope_theta", &m.rope_theta},
      {"model.norm_eps", &m.norm_eps},
      {"model.init_std", &m.init_std},
      {"data.dir", &c.data.dir},
      {"optim.name", &o.name},
      {"optim.lr", &o.lr},
      {"optim.min_lr", &o.min_lr},
      {"optim.warmup_steps", &o.warmup_steps},
      {"optim.schedule", &o.schedule},
      {"optim.beta1", &o.beta1},
      {"optim.beta2", &o.beta2},
      {"optim.eps", &o.eps},
      {"optim.weight_decay", &o.weight_decay},
      {"optim.momentum", &o.momentum},
      {"optim.grad_clip", &o.grad_clip},
      {"train.steps", &t.steps},
      {"train.batch_size", &t.batch_size},
      {"train.seq_len", &t.seq_len},
      {"train.grad_accum", &t.grad_accum},
      {"train.seed", &t.seed},
      {"train.eval_every", &t.eval_every},
      {"train.eval_batches", &t.eval_batches},
      {"train.checkpoint_every", &t.checkpoint_every},
      {"train.keep_checkpoints", &t.keep_checkpoints},
      {"train.threads", &t.threads},
      {"train.run_dir", &t.run_dir},
      {"train.progress", &t.progress},
      {"dist.ep", &c.dist.ep},
      {"dist.zero", &c.dist.zero},
      {"dist.bucket_first_mb", &c.dist.bucket_first_mb},
      {"dist.bucket_mb", &c.dist.bucket_mb},
      {"dist.hierarchical", &c.dist.hierarchical},
      {"dist.ranks_per_node", &c.dist.ranks_per_node},
      {"dist.a2a_chunks", &c.dist.a2a_chunks},
      {"dist.overlap", &c.dist.overlap},
  };
}

const char* type_name(const FieldPtr& p) {
  return std::visit(
      [](auto* v) -> const char* {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) return "an integer";
        if constexpr (std::is_same_v<T, double>) return "a number";
        if constexpr (std::is_same_v<T, bool>) return "true or false";
        return "a string";
      },
      p);
}

std::string known_keys(const std::vector<Field>& fields, const std::string& section) {
  std::string out;
  for (const auto& f : fields) {
    if (section.empty() || f.key.starts_with(section + ".")) out += (out.empty() ? "" : ", ") + f.key;
  }
  return out;
}

Field& find_field(std::vector<Field>& fields, const std::string& key, const std::string& where) {
  for (auto& f : fields)
    if (f.key == key) return f;
  std::string section = key.substr(0, key.find('.'));
  std::string known = known_keys(fields, section);
  MOETRAIN_FAIL("{}unknown key '{}'; known keys: {}", where, key, known.empty() ? known_keys(fields, "") : known);
}

void set_from_toml(Field& f, const toml::node& node, const std::string& where) {
  bool ok = std::visit(
      [&](auto* v) {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          if (auto x = node.value_exact<int64_t>()) return *v = *x, true;
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (auto x = node.value_exact<int64_t>(); x && *x >= 0) return *v = static_cast<uint64_t>(*x), true;
        } else if constexpr (std::is_same_v<T, double>) {
          if (auto x = node.value<double>()) return *v = *x, true;  // integers accepted as numbers
        } else if constexpr (std::is_same_v<T, bool>) {
          if (auto x = node.value_exact<bool>()) return *v = *x, true;
        } else {
          if (auto x = node.value_exact<std::string>()) return *v = *x, true;
        }
        return false;
      },
      f.ptr);
  MOETRAIN_CHECK(ok, "{}key '{}' must be {}{}", where, f.key, type_name(f.ptr),
                 std::holds_alternative<uint64_t*>(f.ptr) ? " ≥ 0" : "");
}

void set_from_string(Field& f, const std::string& value) {
  auto fail = [&]() { MOETRAIN_FAIL("--set {}={}: the value must be {}", f.key, value, type_name(f.ptr)); };
  std::visit(
      [&](auto* v) {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          T x{};
          auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
          if (ec != std::errc() || end != value.data() + value.size()) fail();
          *v = x;
        } else if constexpr (std::is_same_v<T, double>) {
          try {
            std::size_t used = 0;
            double x = std::stod(value, &used);
            if (used != value.size()) fail();
            *v = x;
          } catch (const std::logic_error&) {
            fail();
          }
        } else if constexpr (std::is_same_v<T, bool>) {
          if (value == "true") *v = true;
          else if (value == "false") *v = false;
          else fail();
        } else {
          *v = value;
        }
      },
      f.ptr);
}

void walk(const toml::table& table, const std::string& prefix, std::vector<Field>& fields, const std::string& where) {
  for (const auto& [k, node] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = node.as_table()) {
      MOETRAIN_CHECK(prefix.empty(), "{}unknown table [{}]; sections are [model], [data], [optim], [train], [dist]", where, key);
      bool known_section = !known_keys(fields, key).empty();
      MOETRAIN_CHECK(known_section, "{}unknown section [{}]; sections are [model], [data], [optim], [train], [dist]", where,
                     key);
      walk(*sub, key, fields, where);
    } else {
      MOETRAIN_CHECK(!prefix.empty(), "{}key '{}' must be inside a section ([model], [data], [optim], [train], [dist])",
                     where, key);
      Field& f = find_field(fields, key, where);
      set_from_toml(f, node, where);
    }
  }
}

}  // namespace

std::vector<std::string> run_config_keys() {
  RunConfig c;
  std::vector<std::string> keys;
  for (auto& f : schema(c)) keys.push_back(f.key);
  return keys;
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  RunConfig c;
  std::vector<Field> fields = schema(c);
  if (!path.empty()) {
    MOETRAIN_CHECK(std::filesystem::is_regular_file(path), "config file '{}' does not exist", path);
    toml::table table;
    try {
      table = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      MOETRAIN_FAIL("{}:{}:{}: TOML syntax error: {}", path, e.source().begin.line, e.source().begin.column,
                    e.description());
    }
    walk(table, "", fields, path + ": ");
  }
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    MOETRAIN_CHECK(eq != std::string::npos && eq > 0, "--set '{}': expected key=value, e.g. model.dim=256", o);
    Field& f = find_field(fields, o.substr(0, eq), "--set: ");
    set_from_string(f, o.substr(eq + 1));
  }
  c.validate();
  return c;
}

void RunConfig::validate() const {
  model.validate();
  const TrainConfig& t = train;
  MOETRAIN_CHECK(t.steps >= 0, "train.steps = {}: must be ≥ 0", t.steps);
  MOETRAIN_CHECK(t.batch_size > 0, "train.batch_size = {}: must be positive", t.batch_size);
  MOETRAIN_CHECK(t.seq_len > 0 && t.seq_len <= model.max_seq_len,
                 "train.seq_len = {}: must be in [1, model.max_seq_len = {}]", t.seq_len, model.max_seq_len);
  MOETRAIN_CHECK(t.grad_accum > 0, "train.grad_accum = {}: must be positive", t.grad_accum);
  MOETRAIN_CHECK(t.eval_every >= 0, "train.eval_every = {}: must be ≥ 0", t.eval_every);
  MOETRAIN_CHECK(t.eval_batches > 0, "train.eval_batches = {}: must be positive", t.eval_batches);
  MOETRAIN_CHECK(t.checkpoint_every >= 0, "train.checkpoint_every = {}: must be ≥ 0", t.checkpoint_every);
  MOETRAIN_CHECK(t.keep_checkpoints >= 1, "train.keep_checkpoints = {}: must be ≥ 1", t.keep_checkpoints);
  MOETRAIN_CHECK(t.threads >= 0, "train.threads = {}: must be ≥ 0 (0 = all cores)", t.threads);
  MOETRAIN_CHECK(!t.run_dir.empty(), "train.run_dir must not be empty");
  MOETRAIN_CHECK(t.progress == "auto" || t.progress == "bar" || t.progress == "lines" || t.progress == "off",
                 "train.progress = '{}': allowed are auto, bar, lines, off", t.progress);
  const OptimSettings& o = optim;
  MOETRAIN_CHECK(o.name == "adamw" || o.name == "sgd" || o.name == "adagrad" || o.name == "rmsprop",
                 "optim.name = '{}': allowed are adamw, sgd, adagrad, rmsprop", o.name);
  MOETRAIN_CHECK(o.schedule == "cosine" || o.schedule == "linear" || o.schedule == "constant",
                 "optim.schedule = '{}': allowed are cosine, linear, constant", o.schedule);
  MOETRAIN_CHECK(o.lr > 0, "optim.lr = {}: must be positive", o.lr);
  MOETRAIN_CHECK(o.min_lr >= 0 && o.min_lr <= o.lr, "optim.min_lr = {}: must be in [0, optim.lr = {}]", o.min_lr,
                 o.lr);
  MOETRAIN_CHECK(o.warmup_steps >= 0, "optim.warmup_steps = {}: must be ≥ 0", o.warmup_steps);
  MOETRAIN_CHECK(o.beta1 >= 0 && o.beta1 < 1, "optim.beta1 = {}: must be in [0, 1)", o.beta1);
  MOETRAIN_CHECK(o.beta2 >= 0 && o.beta2 < 1, "optim.beta2 = {}: must be in [0, 1)", o.beta2);
  MOETRAIN_CHECK(o.eps > 0, "optim.eps = {}: must be positive", o.eps);
  MOETRAIN_CHECK(o.weight_decay >= 0, "optim.weight_decay = {}: must be ≥ 0", o.weight_decay);
  MOETRAIN_CHECK(o.momentum >= 0 && o.momentum < 1, "optim.momentum = {}: must be in [0, 1)", o.momentum);
  MOETRAIN_CHECK(o.grad_clip >= 0, "optim.grad_clip = {}: must be ≥ 0 (0 = off)", o.grad_clip);
  MOETRAIN_CHECK(dist.ep >= 1, "dist.ep = {}: must be ≥ 1", dist.ep);
  MOETRAIN_CHECK(dist.zero == 0 || dist.zero == 1, "dist.zero = {}: allowed are 0 (off) and 1 (ZeRO-1)",
                 dist.zero);
  MOETRAIN_CHECK(dist.bucket_first_mb > 0 && dist.bucket_mb > 0 && dist.bucket_mb <= 1024,
                 "dist.bucket_first_mb = {}, dist.bucket_mb = {}: must be positive MiB (at most 1024)",
                 dist.bucket_first_mb, dist.bucket_mb);
  MOETRAIN_CHECK(dist.ranks_per_node >= 0, "dist.ranks_per_node = {}: must be ≥ 0 (0 = detect)", dist.ranks_per_node);
  MOETRAIN_CHECK(dist.a2a_chunks >= 1 && dist.a2a_chunks <= 64, "dist.a2a_chunks = {}: must be in [1, 64]",
                 dist.a2a_chunks);
}

RunConfig run_config_from_json(const nlohmann::json& j, const std::string& where) {
  RunConfig c;
  std::vector<Field> fields = schema(c);
  MOETRAIN_CHECK(j.is_object(), "{}: the run configuration is not a JSON object", where);
  for (const auto& [section, table] : j.items()) {
    MOETRAIN_CHECK(table.is_object(), "{}: section '{}' is not an object", where, section);
    for (const auto& [name, value] : table.items()) {
      Field& f = find_field(fields, section + "." + name, where + ": ");
      bool ok = std::visit(
          [&](auto* v) {
            using T = std::remove_pointer_t<decltype(v)>;
            if constexpr (std::is_same_v<T, double>) {
              if (!value.is_number()) return false;
            } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
              if (!value.is_number_integer()) return false;
            } else if constexpr (std::is_same_v<T, bool>) {
              if (!value.is_boolean()) return false;
            } else {
              if (!value.is_string()) return false;
            }
            *v = value.get<T>();
            return true;
          },
          f.ptr);
      MOETRAIN_CHECK(ok, "{}: key '{}' must be {}", where, f.key, type_name(f.ptr));
    }
  }
  c.validate();
  return c;
}

nlohmann::json RunConfig::to_json() const {
  RunConfig copy = *this;
  nlohmann::json j = nlohmann::json::object();
  for (auto& f : schema(copy)) {
    std::string section = f.key.substr(0, f.key.find('.'));
    std::string name = f.key.substr(f.key.find('.') + 1);
    std::visit([&](auto* v) { j[section][name] = *v; }, f.ptr);
  }
  return j;
}

std::string RunConfig::config_hash() const {
  nlohmann::json j = to_json();
  // What may change between a run and its resumption without changing what is computed.
  for (const char* k : {"steps", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints", "threads",
                        "run_dir", "progress"})
    j["train"].erase(k);
  j.erase("data");
  j.erase("dist");
  std::string s = j.dump();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

}  // namespace moetrain
