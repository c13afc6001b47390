#include "train/run_loop.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/fault.h"
#include "core/log.h"
#include "core/profile.h"
#include "core/resident.h"
#include "core/timer.h"
#include "train/progress.h"
#include "train/rank_timing.h"
#include "train/run_state.h"
#include "train/stop_signal.h"

namespace moetrain {

std::optional<std::filesystem::path> open_run(StepEngine& engine, const std::string& run_dir,
                                              bool resume, EarlierRun earlier, bool tensorboard,
                                              const CheckpointLoad& load,
                                              const RunIdentity& identity, RunLock& lock,
                                              MetricsWriter& metrics) {
  namespace fs = std::filesystem;
  Comm& control = engine.control();
  // Ranks started with different settings stop before anything is created (every rank then
  // starts at the engine's step; a resume below reads one checkpoint for all of them).
  check_ranks_agree(control, identity.settings, identity.config_hash, engine.step_count());
  // Before anything in the run directory is read or written: a second run on it stops here.
  lock = lock_run_dir(run_dir, control);
  const bool has_earlier = !resume && fs::exists(fs::path(run_dir) / "checkpoints");
  if (has_earlier && earlier == EarlierRun::Refuse) refuse_earlier_run(run_dir);
  if (has_earlier && control.rank() == 0) {
    // Checkpoints are kept by step number: a longer earlier run's would outrank this one's.
    log_info("{}: removing the checkpoints of an earlier run", run_dir);
    fs::remove_all(fs::path(run_dir) / "checkpoints");
  }
  control.barrier();
  // Every rank gets the same checkpoint (or none).
  const std::optional<fs::path> ckpt = checkpoint_to_resume(run_dir, resume, control, load);
  const int64_t step = engine.step_count();
  metrics = open_metrics(run_dir, control.rank(), ckpt ? std::optional<int64_t>(step) : std::nullopt,
                         tensorboard);
  engine.set_metrics(&metrics);
  if (ckpt) log_info("resumed from {} at step {}", ckpt->string(), step);
  return ckpt;
}

LoopResult run_loop(StepEngine& engine, RunTask& task, const LoopSettings& s,
                    MetricsWriter& metrics) {
  Comm& control = engine.control();
  LoopResult result;
  result.first_step = engine.step_count();
  const int64_t total = s.stop_at >= 0 ? std::min(s.stop_at, s.total_steps) : s.total_steps;
  Progress progress(parse_progress_mode(control.rank() == 0 ? s.progress : "off"),
                    engine.step_count(), s.total_steps);
  const Timer run_timer;
  const StopSignals signals;
  auto evaluate = [&] {
    Evaluation ev = task.evaluate();
    nlohmann::json line = ev.metrics;
    line["step"] = engine.step_count();
    metrics.write(line);
    result.last_eval = ev.metrics;
    return ev;
  };
  auto finish = [&] {
    // Collective: the evaluations and checkpoints after the last metrics line count too.
    const double peak[1] = {resident_memory().peak};
    const std::vector<double> peaks = control.allgather_same(peak);
    result.peak_rss = *std::max_element(peaks.begin(), peaks.end());
    result.steps_done = engine.step_count() - result.first_step;
    result.seconds = run_timer.seconds();
    result.rate = result.train_seconds > 0 ? s.units_per_step *
                                                 static_cast<double>(result.steps_done) /
                                                 result.train_seconds
                                           : 0.0;
  };
  while (engine.step_count() < total) {
    const Timer t;
    if (s.profile) profile::start();
    StepResult r = task.train_step();
    const PhaseTable phases = s.profile ? profile::stop() : PhaseTable{};
    const int64_t step = engine.step_count();
    fault_point("step", step);
    const double dt = t.seconds();
    const bool abandoned = r.abandoned_after >= 0;
    if (!abandoned) {
      result.train_seconds += dt;
      result.final_loss = r.loss;
      // Timings live under their own keys so that everything else in a line is reproducible bit
      // for bit.
      r.metrics["step_time_s"] = dt;
      r.metrics[s.unit + "_per_s"] = s.units_per_step / dt;
      r.comm.step_s = dt;
      add_comm_metrics(r.comm, r.metrics);
      add_rank_timing(control, {dt, comm_figures(r.comm).compute_s, resident_memory()},
                      r.metrics);
      if (s.profile) add_rank_phases(control, phases, dt, r.metrics);
      metrics.write(r.metrics);
      progress.update({step, s.total_steps, r.loss, s.units_per_step / dt, r.lr,
                       r.metrics["imbalance"].get<double>()});
    }
    if (engine.stop_votes().any()) {
      // The checkpoint is of the last complete step, also when the stop cut the next one short.
      result.last_checkpoint = task.save_checkpoint();
      result.exit_code = engine.stop_votes().exit_code();
      finish();
      progress.finish();
      // Every rank says where it stopped: they agree on the step.
      std::string message = stop_message(engine.stop_votes(), step, result.last_checkpoint.string());
      if (abandoned)
        message += fmt::format(" (step {} was abandoned after {} of its micro-batches)", step + 1,
                               r.abandoned_after);
      log_message(LogLevel::Warn, true, message);
      return result;
    }
    const bool last = step == total;
    const bool before_end = s.evaluate_when_stopped ? !last : step < s.total_steps;
    if (s.eval_every > 0 && step % s.eval_every == 0 && before_end) {
      const Evaluation ev = evaluate();
      progress.note(fmt::format("step {}: {}", step, ev.note));
    }
    if (s.checkpoint_every > 0 && step % s.checkpoint_every == 0 && !last) {
      result.last_checkpoint = task.save_checkpoint();
      progress.note(fmt::format("step {}: checkpoint {}", step, result.last_checkpoint.string()));
    }
  }
  progress.finish();
  if (engine.step_count() < s.total_steps && !s.evaluate_when_stopped) {
    // Stopped early, as if interrupted: a checkpoint to resume from, no final evaluation.
    result.last_checkpoint = task.save_checkpoint();
    finish();
    return result;
  }
  engine.average_replicas();  // the final evaluation and checkpoint see one model
  const Evaluation ev = evaluate();
  result.last_checkpoint = task.save_checkpoint();
  finish();
  log_info("done: {} steps in {:.1f} s ({:.0f} {}/s); {}; checkpoint {}; peak resident memory "
           "{:.1f} MiB (the largest rank's)",
           result.steps_done, result.seconds, result.rate, s.unit, ev.note,
           result.last_checkpoint.string(), result.peak_rss / (1024.0 * 1024.0));
  return result;
}

}  // namespace moetrain
