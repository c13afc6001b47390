// The optimisation ablation table (scripts/ablation.sh, docs/ablation.md): the runs of each row
// read back from their metrics.jsonl, reduced to four numbers per run, the median over a row's
// runs, and each median relative to the baseline row's. `moetrain report --ablation DIR` writes
// it as markdown, JSON and an SVG chart.
//
// Layout of DIR: runs/ROW/RUN/{metrics.jsonl, config.json}, rows in the lexical order of their
// folder names (the script names them 1_baseline, 2_balancing, ...: the first row is the
// baseline), and optionally setup.txt, a line or two on how the runs were made, quoted in the
// table's header.
//
// Per run, over the timed steps (the lines with a step_time_s and step > warmup), the design's
// definitions first and then ours:
//   utilisation         activated experts / all experts: per step and MoE layer, the experts that
//                       computed at least one token (tokens_per_expert > 0, after dropping) over
//                       E, averaged over the layers and the timed steps (the design's)
//   load_balance        mean / max of the tokens each expert received, summed over the timed
//                       steps, per MoE layer, averaged over the layers (1 = every expert equally
//                       loaded)
//   comm_efficiency     compute / (compute + all communication): per step compute_s /
//                       (compute_s + comm_total_s), averaged (the design's: hidden communication
//                       counts too)
//   comm_efficiency_exposed  the mean of the per-step comm_efficiency field (compute / (compute
//                       + the communication the compute thread waited for))
//   samples_per_s       sequences over the timed steps / their summed step_time_s (a step's
//                       sequences are its tokens_per_s · step_time_s / train.seq_len)
//   kept_samples_per_s  samples_per_s counting each step's sequences × the share of its
//                       routed assignments the experts computed (1 − the step's dropped_fraction,
//                       averaged over the MoE layers): throughput at the work actually done, so
//                       a row that drops tokens is not faster for it
//   val_loss            the last val_loss line (the evaluation after the final step)
//   training_efficiency samples_per_s × utilisation / processes: the design's overall training
//                       efficiency (throughput × utilisation / resources), processes = the length
//                       of the steps' rank_step_time_s (1 without it: a one-process run)
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moetrain {

struct AblationFigures {
  double utilisation = 0, load_balance = 0, comm_efficiency = 0, comm_efficiency_exposed = 0,
         samples_per_s = 0, kept_samples_per_s = 0, val_loss = 0, training_efficiency = 0;
};

struct AblationRow {
  std::string name;
  std::vector<AblationFigures> runs;
  AblationFigures median;    // per figure, over the runs
  AblationFigures relative;  // median / the baseline row's median
};

struct AblationTable {
  std::string setup;  // setup.txt, trimmed
  int64_t warmup = 0;
  std::vector<AblationRow> rows;
};

// The figures of one run directory; throws naming the file when it has no timed step, no
// tokens_per_expert, no compute_s / comm_total_s or no val_loss.
AblationFigures ablation_run_figures(const std::filesystem::path& run_dir, int64_t warmup);
// Medians and ratios of rows whose runs are filled in (the first row is the baseline).
void finish_ablation_rows(std::vector<AblationRow>& rows);
// Every row of DIR (layout above); throws when DIR has no runs/ folder or a row has no run.
AblationTable read_ablation(const std::filesystem::path& dir, int64_t warmup);

std::string ablation_markdown(const AblationTable& t);
nlohmann::json ablation_json(const AblationTable& t);
// A standalone SVG: each figure's relative value per row (1 = the baseline).
std::string ablation_svg(const AblationTable& t);

// Writes DIR/table.md, DIR/table.json and DIR/ablation.svg; returns the markdown's path.
std::filesystem::path write_ablation(const std::filesystem::path& dir, int64_t warmup);

}  // namespace moetrain
