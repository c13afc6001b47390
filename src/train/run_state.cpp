#include "train/run_state.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/log.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

std::string router_bias_name(int64_t layer) {
  return fmt::format("model.layers.{}.block_sparse_moe.router_bias", layer);
}

}  // namespace

std::optional<fs::path> checkpoint_to_resume(const fs::path& run_dir, bool resume, Comm& control,
                                             const CheckpointLoad& load) {
  std::vector<std::string> refusals;
  std::optional<fs::path> ckpt =
      resume ? find_latest_checkpoint(run_dir, &control, load, &refusals) : std::nullopt;
  if (ckpt || !resume) return ckpt;
  // Committed checkpoints that all fail verification are not silently replaced: a run from
  // step 0 would prune them. (An uncommitted .tmp_ directory is no checkpoint.)
  int64_t refused = 0;
  const fs::path cdir = run_dir / "checkpoints";
  if (fs::is_directory(cdir))
    for (const auto& entry : fs::directory_iterator(cdir))
      if (entry.is_directory() && entry.path().filename().string().rfind("step_", 0) == 0)
        ++refused;
  MOETRAIN_CHECK(refused == 0,
                 "{} holds {} checkpoint(s) and none can be loaded (the newest: {}; the others "
                 "are logged above): move them away to start this run from step 0, or point "
                 "train.run_dir elsewhere",
                 cdir.string(), refused, refusals.empty() ? "not committed" : refusals.front());
  log_info("no checkpoint in {}: starting from step 0", run_dir.string());
  return ckpt;
}

nlohmann::json rank_settings(const nlohmann::json& config, const nlohmann::json& extra) {
  // Per-process: threads follow each machine's cores; progress and event files are rank 0's.
  static const char* const kLocal[] = {"train.threads", "train.progress", "train.tensorboard"};
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [section, keys] : config.items()) {
    if (!keys.is_object()) {
      out[section] = keys;
      continue;
    }
    for (const auto& [key, value] : keys.items()) {
      const std::string name = section + "." + key;
      if (std::find_if(std::begin(kLocal), std::end(kLocal),
                       [&](const char* l) { return name == l; }) == std::end(kLocal))
        out[name] = value;
    }
  }
  for (const auto& [key, value] : extra.items()) out[key] = value;
  return out;
}

void check_ranks_agree(Comm& comm, const nlohmann::json& settings, uint64_t hash, int64_t step) {
  if (comm.size() == 1) return;
  // Every rank gathers every rank's settings, so all of them reach the same verdict and fail
  // together (one rank failing alone would leave the others waiting in a collective).
  const std::string mine = settings.dump();
  std::vector<int64_t> lengths = comm.allgather_one(static_cast<int64_t>(mine.size()));
  int64_t total = 0;
  for (int64_t n : lengths) total += n;
  std::string all(static_cast<std::size_t>(total), '\0');
  comm.allgather(all.data(), mine.data(), lengths);
  std::vector<nlohmann::json> ranks;
  for (int64_t q = 0, at = 0; q < comm.size(); at += lengths[q++])
    ranks.push_back(nlohmann::json::parse(all.substr(at, lengths[q])));
  for (int q = 1; q < comm.size(); ++q) {
    for (const auto& [key, value] : ranks[0].items()) {
      const std::string theirs = ranks[q].contains(key) ? ranks[q][key].dump() : "(unset)";
      MOETRAIN_CHECK(theirs == value.dump(),
                     "rank {} has {} = {}, rank 0 has {} = {}: every process must run the same "
                     "settings",
                     q, key, theirs, key, value.dump());
    }
    for (const auto& [key, value] : ranks[q].items())
      MOETRAIN_CHECK(ranks[0].contains(key),
                     "rank {} has {} = {}, rank 0 has {} unset: every process must run the same "
                     "settings",
                     q, key, value.dump(), key);
  }
  std::vector<int64_t> hashes = comm.allgather_one(static_cast<int64_t>(hash));
  std::vector<int64_t> steps = comm.allgather_one(step);
  for (int q = 1; q < comm.size(); ++q) {
    MOETRAIN_CHECK(hashes[q] == hashes[0],
                   "rank {} has configuration hash {:016x}, rank 0 has {:016x}: every process "
                   "must run the same model, optimizer and batch settings",
                   q, static_cast<uint64_t>(hashes[q]), static_cast<uint64_t>(hashes[0]));
    MOETRAIN_CHECK(steps[q] == steps[0],
                   "rank {} starts at step {}, rank 0 at step {}: the processes resumed from "
                   "different checkpoints",
                   q, steps[q], steps[0]);
  }
}

MetricsWriter open_metrics(const fs::path& run_dir, int rank, std::optional<int64_t> resumed,
                           bool tensorboard) {
  if (rank != 0) return {};
  // Metrics past the checkpoint belong to a run that is being replaced.
  if (resumed) return MetricsWriter::resume(run_dir, *resumed, tensorboard);
  return MetricsWriter(run_dir, MetricsWriter::Open::Fresh, tensorboard);
}

std::vector<NamedTensor> model_views(const ParamTable& layout, float* params) {
  std::vector<NamedTensor> out;
  for (const auto& p : layout.params()) out.push_back({p.name, p.shape, params + p.offset});
  return out;
}

std::vector<NamedTensor> bias_views(Transformer& model) {
  std::vector<NamedTensor> out;
  const ModelConfig& cfg = model.config();
  if (cfg.moe().router != RouterKind::SigmoidBias) return out;
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    int64_t m = model.moe_index(l);
    if (m >= 0)
      out.push_back({router_bias_name(l), {cfg.n_experts}, model.moe_layers()[m]->router_bias()});
  }
  return out;
}

std::vector<NamedTensor> bias_views(Classifier& model) {
  std::vector<NamedTensor> out;
  const ClassifierConfig& cfg = model.config();
  if (cfg.moe().router != RouterKind::SigmoidBias) return out;
  auto moe = model.moe_layers();
  for (int64_t l = 0; l < cfg.n_layers; ++l)
    out.push_back({router_bias_name(l), {cfg.n_experts}, moe[l]->router_bias()});
  return out;
}

CheckpointShare checkpoint_share(const ParamTable& layout, float* params,
                                 ShardedOptimizer& optimizer, const std::vector<int>& writers,
                                 const ExpertShard& held, int me, bool sharded,
                                 const std::vector<NamedTensor>& state, bool reading,
                                 bool params_sharded) {
  CheckpointShare share;
  const std::vector<ParamInfo>& infos = layout.params();
  auto holds = [&](const ParamInfo& p) {
    return p.expert < 0 || (p.expert >= held.first && p.expert < held.first + held.count);
  };
  const bool read_shard = reading && params_sharded;
  for (std::size_t i = 0; i < infos.size() && !read_shard; ++i) {
    const ParamInfo& p = infos[i];
    if (reading ? holds(p) : writers[i] == me)
      share.model.push_back(whole_tensor(p.name, p.shape, params + p.offset));
  }
  // Optimizer state by parameter name and element range: this rank's pieces cut at tensor
  // boundaries (the alignment gaps between tensors hold no state worth keeping: always zero).
  // Under ZeRO-1 the pieces of all ranks tile the buffer; otherwise state is replicated like the
  // parameters and each tensor's writer saves it.
  const std::vector<std::string>& names = optimizer.state_names();
  const std::vector<OptimPiece>& pieces = optimizer.pieces();
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const int64_t from = pieces[k].offset, to = from + pieces[k].size;
    for (std::size_t i = 0; i < infos.size(); ++i) {
      const ParamInfo& p = infos[i];
      const int64_t lo = std::max(from, p.offset), hi = std::min(to, p.offset + p.numel);
      if (lo >= hi) continue;
      if (read_shard) share.model.push_back({p.name, p.shape, lo - p.offset, hi - p.offset, params + lo});
      if (!reading && !sharded && writers[i] != me) continue;
      for (std::size_t s = 0; s < names.size(); ++s) {
        const int si = static_cast<int>(s);
        TensorPiece t{names[s] + "." + p.name, p.shape, lo - p.offset, hi - p.offset};
        if (!optimizer.offload_store()) {
          t.data = optimizer.piece_state(k, si).data() + (lo - from);
        } else {
          // State in a file moves a window at a time (pread / pwrite), never mapped whole.
          ShardedOptimizer* o = &optimizer;
          const int64_t at0 = lo - from;
          t.get = [o, k, si, at0](int64_t at, int64_t n, float* buf) {
            o->read_state(k, si, at0 + at, n, buf);
          };
          t.put = [o, k, si, at0](int64_t at, int64_t n, const float* buf) {
            o->write_state(k, si, at0 + at, n, buf);
          };
        }
        share.optimizer.push_back(std::move(t));
      }
    }
  }
  if (reading || me == 0)
    for (const NamedTensor& t : state) share.state.push_back(whole_tensor(t.name, t.shape, t.data));
  return share;
}

namespace {

template <class Model>
int64_t read_weights_of(const fs::path& ckpt, Model& model, std::vector<float>& params) {
  params.assign(static_cast<std::size_t>(model.layout().size()), 0.0f);
  CheckpointContents c;
  c.model = model_views(model.layout(), params.data());
  c.state = bias_views(model);
  read_checkpoint(ckpt, c);
  return reading_json(ckpt / "trainer_state.json",
                      [&] { return c.trainer.value("step", int64_t{0}); });
}

}  // namespace

int64_t read_weights(const fs::path& ckpt, Transformer& model, std::vector<float>& params) {
  return read_weights_of(ckpt, model, params);
}

int64_t read_weights(const fs::path& ckpt, Classifier& model, std::vector<float>& params) {
  return read_weights_of(ckpt, model, params);
}

fs::path resolve_checkpoint(const fs::path& given) {
  // checkpoints/latest is a link: the checkpoint is named by its own directory.
  const fs::path dir = fs::is_symlink(given) ? fs::canonical(given) : given;
  if (fs::is_regular_file(dir / "manifest.json")) return dir;
  auto latest = find_latest_checkpoint(
      dir, nullptr, [](const fs::path& c) { read_checkpoint_json(c, "config.json"); });
  MOETRAIN_CHECK(latest.has_value(),
                 "{}: neither a checkpoint directory, a run directory with a complete "
                 "checkpoint, nor a Hugging Face model directory (config.json with "
                 "model.safetensors or model.safetensors.index.json)",
                 dir.string());
  return *latest;
}

std::string json_hash(const nlohmann::json& j) {
  const std::string s = j.dump();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

nlohmann::json carried_state_record(GradReducer& reducer, int world) {
  const std::vector<float>* c = reducer.carried();
  if (!c) return nullptr;
  nlohmann::json r = nlohmann::json::array({world, static_cast<int64_t>(c->size())});
  // int8's record is the shape alone (as checkpoints have always held it); another kind of
  // residual adds its name, so that one is never read as the other.
  if (const char* kind = reducer.carried_kind(); kind[0] != '\0') r.push_back(kind);
  return r;
}

bool carried_state_matches(const nlohmann::json& trainer_state, GradReducer& reducer, int world) {
  const nlohmann::json mine = carried_state_record(reducer, world);
  if (mine.is_null()) return false;
  const nlohmann::json saved = trainer_state.value("grad_residual", nlohmann::json());
  if (saved == mine) return true;
  log_warn("the checkpoint holds no gradient residual for {} processes of {} values (it has {}): "
           "the error feedback starts from zero, so the run is not bit-exact with an "
           "uninterrupted one",
           world, mine[1].get<int64_t>(), saved.is_null() ? "none" : saved.dump());
  return false;
}

void add_carried_state(CheckpointShare& share, GradReducer& reducer, int rank, int world) {
  std::vector<float>* c = reducer.carried();
  if (!c) return;
  const int64_t n = static_cast<int64_t>(c->size());
  share.state.push_back(
      {"grad_sync.residual", {world, n}, rank * n, (rank + 1) * n, c->data()});
}

}  // namespace moetrain
