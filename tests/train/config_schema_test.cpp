// The configuration schema as a user meets it through the loader: the nearest key suggested for
// a mistyped one, a help line and the allowed values for every key, the settings that differ from
// the defaults, and model.route_groups' range (with older checkpoints' records still read).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sstream>
#include <string>

#include "core/suggest.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"
#include "train/classifier_config.h"
#include "train/run_config.h"

using namespace moetrain;
using moetrain::testing::expect_error;

TEST(ConfigSuggest, EditDistanceCountsEditsAndTranspositions) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("n_expert", "n_experts"), 1u);
  EXPECT_EQ(edit_distance("n_exeprts", "n_experts"), 1u);  // a swap of neighbours
  EXPECT_EQ(nearest("model.n_expert", {"model.dim", "model.n_experts", "model.top_k"}),
            "model.n_experts");
  EXPECT_EQ(nearest("zzzz", {"model.dim", "train.steps"}), std::nullopt);
  EXPECT_EQ(nearest("--stepz", {"--steps", "--set"}), "--steps");
}

TEST(ConfigSuggest, AnUnknownKeyNamesTheNearestNotEveryKey) {
  for (const char* typo : {"model.n_expert", "model.n_exeprts", "model.nexperts"}) {
    try {
      load_run_config("", {std::string(typo) + "=4"});
      ADD_FAILURE() << typo << " accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(
          what.find(std::string("unknown key '") + typo + "'; did you mean 'model.n_experts'?"),
          std::string::npos)
          << what;
      EXPECT_EQ(what.find("model.rope_theta"), std::string::npos) << what;  // no list of keys
    }
  }
  // In a file, the same, after the file's name.
  moetrain::testing::TempDir tmp("config_suggest");
  const auto file = tmp.write("c.toml", "[optim]\nlr_min = 1e-4\n");
  expect_error([&] { load_run_config(file.string()); },
               {file.string(), "unknown key 'optim.lr_min'"});
  const auto near = tmp.write("d.toml", "[optim]\nwarmup_step = 10\n");
  expect_error([&] { load_run_config(near.string()); },
               {"unknown key 'optim.warmup_step'; did you mean 'optim.warmup_steps'?"});
  // Nothing near: the keys of the section, or the sections.
  expect_error([] { load_run_config("", {"optim.xyzzy_plugh=1"}); },
               {"the keys of [optim] are optim.name, optim.lr"});
  expect_error([] { load_run_config("", {"qqqqqq.xyzzy=1"}); },
               {"no section [qqqqqq]; sections are [model]"});
  // The classifier's loader shares the schema's lookup.
  expect_error([] { load_classifier_config("", {"model.input_dims=3"}); },
               {"did you mean 'model.input_dim'?"});
}

// `config list`: one help line per key and the allowed values of named ones, which are the
// values the key's own check names when it refuses one.
TEST(ConfigList, EveryKeyHasTypeDefaultAndHelp) {
  for (const bool classify : {false, true}) {
    const std::string all = classify ? classifier_config_help("") : run_config_help("");
    const std::vector<std::string> keys = classify ? classifier_config_keys() : run_config_keys();
    for (const auto& key : keys) {
      const std::size_t at = all.find("  " + key + " = ");
      ASSERT_NE(at, std::string::npos) << key;
      const std::size_t eol = all.find('\n', at);
      const std::size_t help_end = all.find('\n', eol + 1);
      const std::string help = all.substr(eol + 1, help_end - eol - 1);
      EXPECT_GT(help.find_first_not_of(' '), 0u) << key;
      EXPECT_GT(help.size(), 12u) << key << ": no help line";
    }
  }
  const std::string optim = run_config_help("optim");
  EXPECT_NE(optim.find("[optim]\n  optim.name = \"adamw\"  (string: adamw, sgd, adagrad, rmsprop)"),
            std::string::npos)
      << optim;
  EXPECT_NE(optim.find("optim.lr = 0.003  (number)"), std::string::npos) << optim;
  EXPECT_EQ(optim.find("[model]"), std::string::npos) << optim;
  EXPECT_NE(classifier_config_help("model").find("model.input_dim = 784"), std::string::npos);
  expect_error([] { run_config_help("optm"); }, {"no section [optm]; did you mean 'optim'?"});
}

TEST(ConfigList, AllowedValuesAreTheOnesTheCheckNames) {
  RunConfig c;
  const std::string all = run_config_help("");
  int named = 0;
  for (const auto& key : run_config_keys()) {
    const std::size_t at = all.find("  " + key + " = ");
    const std::string line = all.substr(at, all.find('\n', at) - at);
    const std::size_t colon = line.find("(string: ");
    if (colon == std::string::npos) continue;
    ++named;
    const std::string allowed = line.substr(colon + 9, line.size() - colon - 10);
    try {
      load_run_config("", {key + "=no_such_value"});
      ADD_FAILURE() << key << " took no_such_value";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(allowed), std::string::npos)
          << key << ": the check names other values than '" << allowed << "': " << e.what();
    }
  }
  EXPECT_GE(named, 12);
}

TEST(ConfigDiff, ChangedFromTheDefaultsOnly) {
  const RunConfig c = load_run_config("", {"model.dim=64", "optim.lr=0.01"});
  const nlohmann::json d = changed_from(c.to_json(), RunConfig().to_json());
  EXPECT_EQ(d, nlohmann::json::parse(R"({"model": {"dim": 64}, "optim": {"lr": 0.01}})")) << d;
  EXPECT_TRUE(changed_from(RunConfig().to_json(), RunConfig().to_json()).empty());
}

TEST(AdaptiveRoute, NeedsExpertParallelismAndAProbeInterval) {
  expect_error([] { load_run_config("", {"dist.adaptive_route=true"}); },
               {"dist.adaptive_route = true", "dist.ep = 1", "dist.ep ≥ 2"});
  expect_error([] { load_run_config("", {"dist.ep=2", "dist.route_probe_every=1"}); },
               {"dist.route_probe_every = 1: must be ≥ 2"});
  const RunConfig c = load_run_config("", {"dist.ep=2", "dist.adaptive_route=true"});
  EXPECT_TRUE(c.dist.adaptive_route);
  EXPECT_EQ(c.dist.route_probe_every, 10);
}

TEST(RouteGroups, ZeroIsRefusedNamingTheKeyAndOneIsOff) {
  expect_error([] { load_run_config("", {"model.route_groups=0"}); },
               {"model.route_groups = 0: must be ≥ 1", "1 = off"});
  expect_error([] { load_classifier_config("", {"model.route_groups=0"}); },
               {"model.route_groups = 0: must be ≥ 1"});
  const RunConfig off = load_run_config("", {"model.route_groups=1"});
  EXPECT_FALSE(off.model.moe().group_limited());
  EXPECT_EQ(RunConfig().model.route_groups, 1);
  // A config.json written when 0 meant off still loads, and hashes as it did then (the resume
  // check compares that hash with the one the checkpoint recorded).
  nlohmann::json old = RunConfig().to_json();
  EXPECT_EQ(old["model"]["route_groups"], 1);
  old["model"]["route_groups"] = 0;
  const RunConfig loaded = run_config_from_json(old, "config.json");
  EXPECT_EQ(loaded.model.route_groups, 1);
  EXPECT_EQ(loaded.config_hash(), RunConfig().config_hash());
  nlohmann::json hashed = RunConfig().to_json();
  hash_moe_keys_as_before(hashed);
  EXPECT_EQ(hashed["model"]["route_groups"], 0);
  const ClassifierRunConfig cl = classifier_config_from_json(
      [] {
        nlohmann::json j = ClassifierRunConfig().to_json();
        j["model"]["route_groups"] = 0;
        return j;
      }(),
      "config.json");
  EXPECT_EQ(cl.config_hash(), ClassifierRunConfig().config_hash());
}

// model.overflow and model.balance_loss: typed when read, refused naming the key where unknown or
// meaningless, in both configs; their defaults hash as configs did before the keys existed.
TEST(MoeOptions, ParsedRefusedAndHashedAsBefore) {
  const RunConfig set = load_run_config(
      "", {"model.capacity_factor=1.25", "model.overflow=reroute", "model.balance_loss=variance"});
  EXPECT_EQ(set.model.moe_config(8).overflow, Overflow::Reroute);
  EXPECT_EQ(set.model.moe_config(8).balance_loss, BalanceLoss::Variance);
  EXPECT_EQ(set.to_json()["model"]["overflow"], "reroute");
  EXPECT_EQ(run_config_from_json(set.to_json(), "config.json").config_hash(), set.config_hash());
  for (auto load :
       {+[](const std::vector<std::string>& s) { (void)load_run_config("", s); },
        +[](const std::vector<std::string>& s) { (void)load_classifier_config("", s); }}) {
    expect_error([&] { load({"model.overflow=spill"}); },
                 {"model.overflow = 'spill'", "drop, reroute"});
    expect_error([&] { load({"model.balance_loss=l2"}); },
                 {"model.balance_loss = 'l2'", "switch, variance"});
    expect_error([&] { load({"model.overflow=reroute"}); },
                 {"model.overflow = reroute needs a capacity"});
    expect_error(
        [&] {
          load({{"model.router=sigmoid_bias"}, "model.balance_loss=variance"});
        },
        {"model.balance_loss = variance", "sigmoid_bias"});
  }
  // A config.json without the keys loads with the defaults and keeps its hash.
  nlohmann::json old = RunConfig().to_json();
  old["model"].erase("overflow");
  old["model"].erase("balance_loss");
  const RunConfig loaded = run_config_from_json(old, "config.json");
  EXPECT_EQ(loaded.model.overflow, Overflow::Drop);
  EXPECT_EQ(loaded.model.balance_loss, BalanceLoss::Switch);
  EXPECT_EQ(loaded.config_hash(), RunConfig().config_hash());
  nlohmann::json hashed = RunConfig().to_json();
  hash_moe_keys_as_before(hashed);
  EXPECT_FALSE(hashed["model"].contains("overflow"));
  EXPECT_FALSE(hashed["model"].contains("balance_loss"));
  EXPECT_NE(load_run_config("", {"model.balance_loss=variance"}).config_hash(),
            RunConfig().config_hash());
}

TEST(ConfigRecompute, DefaultNoneChoicesParsedRefusedOnCudaAndInTheClassifier) {
  EXPECT_EQ(load_run_config("", {}).train.recompute, Recompute::None);
  EXPECT_EQ(load_run_config("", {"train.recompute=moe"}).train.recompute, Recompute::Moe);
  const RunConfig full = load_run_config("", {"train.recompute=full"});
  EXPECT_EQ(full.train.recompute, Recompute::Full);
  // The same bits in every mode: a run resumes under another one.
  EXPECT_EQ(full.config_hash(), load_run_config("", {}).config_hash());
  expect_error([] { load_run_config("", {"train.recompute=all"}); },
               {"train.recompute = 'all'", "none, moe, full"});
  expect_error([] { load_run_config("", {"train.device=cuda", "train.recompute=full"}); },
               {"train.recompute = full", "train.device = cuda", "none"});
  // The classifier keeps every activation: the key is not one of its settings.
  expect_error([] { load_classifier_config("", {"train.recompute=full"}); },
               {"train.recompute"});
}

TEST(PipelineKeys, BadStagesAndWhatThePipelineDoesNotRunAreRefusedByName) {
  // model.n_layers defaults to more than 2 stages' worth; each line names the key it refuses.
  const std::vector<std::string> four = {"model.n_layers=4"};
  auto with = [&](std::vector<std::string> keys) {
    keys.insert(keys.begin(), four.begin(), four.end());
    return [keys] { load_run_config("", keys); };
  };
  expect_error(with({"dist.pp=0"}), {"dist.pp = 0", "≥ 1"});
  expect_error(with({"dist.pp=5"}), {"dist.pp = 5", "model.n_layers = 4"});
  expect_error(with({"dist.pp=2", "dist.pp_schedule=2f2b"}),
               {"dist.pp_schedule", "2f2b", "1f1b"});
  // zero_bubble trains; it needs a micro-batch a stage, and with chunks a stage (on the
  // interleaved order) a multiple of the stages.
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "dist.pp_schedule=zero_bubble"});
  expect_error(with({"dist.pp=2", "dist.pp_schedule=zero_bubble"}),
               {"dist.pp_schedule = zero_bubble", "train.grad_accum = 1"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "dist.vp=2", "train.grad_accum=4",
                       "dist.pp_schedule=zero_bubble"});
  expect_error(with({"dist.pp=2", "dist.vp=2", "train.grad_accum=3",
                     "dist.pp_schedule=zero_bubble"}),
               {"dist.vp = 2", "train.grad_accum = 3", "multiple"});
  // Interleaving: chunks a stage under its own schedule only, every chunk a block at least, the
  // micro-batches a multiple of the stages.
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "dist.vp=2", "train.grad_accum=4",
                       "dist.pp_schedule=interleaved"});
  expect_error(with({"dist.pp=2", "dist.vp=0", "dist.pp_schedule=interleaved"}),
               {"dist.vp = 0", "≥ 1"});
  expect_error(with({"dist.pp=2", "dist.vp=2", "dist.pp_schedule=1f1b"}),
               {"dist.vp = 2", "dist.pp_schedule = 1f1b", "interleaved"});
  expect_error(with({"dist.pp=2", "dist.vp=2", "dist.pp_schedule=gpipe"}),
               {"dist.vp = 2", "dist.pp_schedule = gpipe"});
  expect_error(with({"dist.vp=2", "dist.pp_schedule=interleaved"}),
               {"dist.vp = 2", "dist.pp = 1"});
  expect_error(with({"dist.pp=2", "dist.vp=3", "dist.pp_schedule=interleaved",
                     "train.grad_accum=4"}),
               {"dist.vp = 3", "model.n_layers = 4"});
  expect_error(with({"dist.pp=2", "dist.vp=2", "dist.pp_schedule=interleaved",
                     "train.grad_accum=3"}),
               {"train.grad_accum = 3", "multiple of the stages"});
  expect_error(with({"dist.pp=4", "train.grad_accum=2"}), {"train.grad_accum = 2", "1f1b"});
  load_run_config("", {"model.n_layers=4", "dist.pp=4", "train.grad_accum=2",
                       "dist.pp_schedule=gpipe"});  // gpipe runs any number of micro-batches
  // Expert parallelism runs inside the stages (whether dist.ep fits a stage's processes is known
  // once the processes are: tests/parallel/pipeline_test.cpp), chunked or not, and ZeRO-1 and 2;
  // the expert exchange's adaptive route and ZeRO-3 do not.
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.ep=2"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.zero=1"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.zero=2"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.ep=2",
                       "dist.a2a_chunks=2"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.ep=2",
                       "dist.hierarchical=true", "dist.ranks_per_node=4"});
  // A node holds whole pipelines or whole parts of one.
  expect_error(with({"dist.pp=2", "train.grad_accum=2", "dist.ep=2", "dist.hierarchical=true",
                     "dist.ranks_per_node=3"}),
               {"dist.ranks_per_node = 3", "dist.pp = 2"});
  // Router-bias balancing (the sign rule and the rl controller), the dynamic capacity controller
  // and expert reweighting run (pipeline_test.cpp, pipeline_settings_test.cpp).
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "model.router=sigmoid_bias"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "model.capacity=dynamic", "model.capacity_factor=1.25"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "grad.expert_reweight=importance"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "model.router=sigmoid_bias", "model.router_controller=rl"});
  // Recomputation runs in every activation slot, full but under zero_bubble; fp16 with its loss
  // scaler (pipeline_settings_test.cpp).
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "train.recompute=full"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "dist.pp_schedule=zero_bubble", "train.recompute=moe"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "train.precision=fp16"});
  // Sparse expert gradients: each stage masks its own layers (pipeline_sparse_test.cpp).
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2",
                       "grad.sparse_experts=true", "grad.min_accum_fraction=1"});
  // ZeRO-3: each stage's parameters sharded over its copies (pipeline_zero3_test.cpp).
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.zero=3"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=4", "dist.zero=3",
                       "dist.pp_schedule=interleaved", "dist.vp=2"});
  load_run_config("", {"model.n_layers=4", "dist.pp=2", "train.grad_accum=2", "dist.zero=3",
                       "dist.pp_schedule=zero_bubble"});
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"dist.ep=2", "dist.adaptive_route=true"}, "dist.adaptive_route = true"},
      {{"dist.sync=params"}, "dist.sync = params"},
      {{"dist.pp_schedule=zero_bubble", "train.recompute=full"}, "train.recompute = full"},
      {{"grad.sparse_ratio=0.5"}, "grad.sparse_ratio = 0.5"},
  };
  for (const auto& [keys, named] : refused) {
    std::vector<std::string> all = {"dist.pp=2", "train.grad_accum=2"};
    all.insert(all.end(), keys.begin(), keys.end());
    expect_error(with(all), {"dist.pp = 2", named});
  }
  expect_error([] { load_classifier_config("", {"dist.pp=2"}); }, {"dist.pp = 2", "classifier"});
}

TEST(TensorParallelKeys, ShapesItCannotSplitAndWhatItDoesNotRunAreRefusedByName) {
  // The defaults (4 heads, 2 key-value heads, a vocabulary of 256) split over 2.
  load_run_config("", {"dist.tp=2"});
  load_run_config("", {"dist.tp=2", "dist.ep=2", "dist.zero=1", "train.recompute=full"});
  // ZeRO-2 and 3 and fp16 (tests/parallel/tensor_parallel_settings_test.cpp).
  load_run_config("", {"dist.tp=2", "dist.zero=2"});
  load_run_config("", {"dist.tp=2", "dist.zero=3"});
  load_run_config("", {"dist.tp=2", "train.precision=fp16"});
  // Pipeline stages of tensor-parallel groups (dist.pp × dist.tp processes a pipeline).
  load_run_config("", {"model.n_layers=4", "train.grad_accum=2", "dist.tp=2", "dist.pp=2"});
  // Sequence parallelism and expert parallelism inside them (a boundary carries each rank's
  // rows; the stage's ranks form its expert groups).
  load_run_config("", {"model.n_layers=4", "train.grad_accum=2", "dist.tp=2", "dist.pp=2",
                       "dist.sequence_parallel=true"});
  load_run_config("", {"model.n_layers=4", "train.grad_accum=2", "dist.tp=2", "dist.pp=2",
                       "dist.ep=2", "dist.sequence_parallel=true"});
  // ZeRO-2 and 3, host-file offload and fp16 inside its stages (tests/parallel/pipeline_tp_test.cpp,
  // pipeline_zero3_test.cpp).
  // (Offload checks that it can write its directory: the run's, here a temporary one.)
  moetrain::testing::TempDir run_dir("tp_stages_keys");
  for (const std::string key :
       {"dist.zero=2", "dist.zero=3", "dist.offload=host_file", "train.precision=fp16"})
    load_run_config("", {"model.n_layers=4", "train.grad_accum=2", "dist.tp=2", "dist.pp=2", key,
                         "train.run_dir=" + run_dir.path().string()});
  expect_error([] { load_run_config("", {"dist.tp=0"}); }, {"dist.tp = 0", "≥ 1"});
  expect_error([] { load_run_config("", {"dist.tp=4"}); },
               {"dist.tp = 4", "model.n_kv_heads = 2"});
  expect_error([] { load_run_config("", {"dist.tp=2", "model.n_heads=6", "model.dim=48",
                                         "model.n_kv_heads=3"}); },
               {"dist.tp = 2", "model.n_kv_heads = 3"});
  expect_error([] { load_run_config("", {"dist.tp=2", "model.vocab_size=255"}); },
               {"dist.tp = 2", "model.vocab_size = 255"});
  // The gradient settings that run with it (tests/parallel/tensor_parallel_grads_test.cpp).
  load_run_config("", {"dist.tp=2", "dist.grad_reduce_dtype=int8"});
  load_run_config("", {"dist.tp=2", "grad.sparse_ratio=0.5", "grad.sparse_experts=true"});
  load_run_config("", {"dist.tp=2", "dist.sync=params"});
  load_run_config("", {"dist.tp=2", "model.router=sigmoid_bias", "model.router_controller=rl"});
  // Local steps' copies are tensor-parallel groups: experts sharded over several are refused.
  expect_error([] { load_run_config("", {"dist.tp=2", "dist.sync=params", "dist.ep=2"}); },
               {"dist.tp = 2", "dist.sync = params and dist.ep = 2", "does not run it yet"});
  // The expert all-to-all's routes (with the experts sharded, which they need).
  for (const std::string key : {"dist.hierarchical=true", "dist.adaptive_route=true"}) {
    SCOPED_TRACE(key);
    expect_error([&] { load_run_config("", {"dist.tp=2", "dist.ep=2", key}); },
                 {"dist.tp = 2", key.substr(0, key.find('=')), "does not run it yet"});
  }
  load_run_config("", {"dist.tp=2", "dist.sequence_parallel=true"});
  expect_error([] { load_run_config("", {"dist.sequence_parallel=true"}); },
               {"dist.sequence_parallel = true", "dist.tp = 1"});
  // The classifier has no heads to split.
  expect_error([] { load_classifier_config("", {"dist.tp=2"}); }, {"dist.tp = 2", "classifier"});
}

TEST(ExpertTensorParallelKeys, ShapesItCannotSplitAndWhatItDoesNotRunAreRefusedByName) {
  const std::vector<std::string> base = {"train.precision=f32", "model.expert_hidden=24"};
  auto with = [&](std::vector<std::string> keys) {
    keys.insert(keys.begin(), base.begin(), base.end());
    return keys;
  };
  // What runs (tests/parallel/expert_tensor_parallel_test.cpp).
  load_run_config("", with({"dist.etp=2"}));
  load_run_config("", with({"dist.etp=2", "dist.ep=2"}));
  load_run_config("", with({"dist.etp=2", "dist.tp=2"}));
  expect_error([] { load_run_config("", {"dist.etp=0"}); }, {"dist.etp = 0", "≥ 1"});
  expect_error([&] { load_run_config("", with({"dist.etp=5"})); },
               {"dist.etp = 5", "model.expert_hidden = 24"});
  expect_error([&] { load_run_config("", with({"dist.etp=2", "train.precision=bf16"})); },
               {"dist.etp = 2", "train.precision = bf16", "does not run it yet"});
  for (const std::string key :
       {"dist.hierarchical=true", "dist.adaptive_route=true", "dist.a2a_chunks=2",
        "placement.spare_slots=1", "dist.zero=1", "dist.sync=params",
        "dist.grad_reduce_dtype=int8", "grad.sparse_ratio=0.5", "grad.sparse_experts=true",
        "train.recompute=moe"}) {
    SCOPED_TRACE(key);
    expect_error([&] { load_run_config("", with({"dist.etp=2", "dist.ep=2", key})); },
                 {"dist.etp = 2", key.substr(0, key.find('=')), "does not run it yet"});
  }
  expect_error(
      [&] {
        load_run_config("", with({"model.n_layers=4", "train.grad_accum=2", "dist.etp=2",
                                  "dist.pp=2"}));
      },
      {"dist.etp = 2", "dist.pp = 2", "does not run it yet"});
  expect_error([] { load_classifier_config("", {"dist.etp=2"}); },
               {"dist.etp = 2", "classifier"});
}
