// The run report's facts about a run (io/report.h): what kind of run a directory holds, its
// settings, the process layout and its times, and the two sections built from them: the header
// at the top of the report and the config table, where the values that differ from the defaults
// of the one config schema (SettingDefaults) are highlighted.
//
// The settings are RUN_DIR/config.json where the run wrote one (`train`), else the "moetrain"
// section of the newest checkpoint's config.json (a parameter-server job and the classifier
// write none in RUN_DIR); a note says which, or what is missing.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetrain {

enum class RunKind { LanguageModel, Classifier };

// The default settings of each kind of run ({section: {key: value}}), from the one config schema
// (a default RunConfig and ClassifierRunConfig); the caller gives them, as io/ sits below train/.
struct SettingDefaults {
  nlohmann::json language_model;
  nlohmann::json classifier;
};

struct RunFacts {
  RunKind kind = RunKind::LanguageModel;
  bool parameter_server = false;     // RUN_DIR/ps or the per-process worker files exist
  nlohmann::json config;             // {section: {key: value}}; null when none was found
  std::string config_source;         // the file it came from
  nlohmann::json defaults;           // the default settings of `kind`, from the schema
  std::filesystem::path checkpoint;  // the newest checkpoint directory; empty when none
  nlohmann::json trainer_state;      // its trainer_state.json; null when absent
  std::vector<std::string> notes;    // what is missing or was read from elsewhere
};

RunFacts read_run_facts(const std::filesystem::path& run_dir, const SettingDefaults& defaults);

// The unit of the loss curves: "nats/byte" for the byte-level LM (as `train` prints it), "nats"
// (per example) for the classifier.
std::string loss_unit(const RunFacts& facts);

// <table id="run-header">: the moetrain that wrote the report, the kind of run, the process
// layout, the device and CPU, when it started and its wall time (from config.json's or the
// metrics' times to the last metrics line), and the time spent in steps.
std::string run_header(const std::filesystem::path& run_dir, const RunFacts& facts,
                       const std::vector<nlohmann::json>& lines);

// <section id="config">: every setting with its default; rows that differ have class "changed".
std::string config_section(const RunFacts& facts);

}  // namespace moetrain
