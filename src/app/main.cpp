// moetrain: the only catch site. Parse, run the chosen subcommand, turn errors into a message
// and a non-zero exit (2 for bad usage, 1 for everything else). Under an MPI launcher an error
// ends every process of the run (MPI_Abort), so no rank is left waiting in a collective.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "app/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "core/suggest.h"
#include "parallel/runtime.h"

namespace {

// "moetrain train: unknown option '--stepz'; did you mean '--steps'? (see moetrain train --help)"
// for the innermost command given that was left arguments it does not take; "" when none was.
std::string unknown_options(const CLI::App& app) {
  const CLI::App* cmd = &app;
  std::string path = "moetrain";
  for (bool deeper = true; deeper;) {
    deeper = false;
    for (const CLI::App* sub : cmd->get_subcommands()) {
      cmd = sub, path += " " + sub->get_name(), deeper = true;
      break;
    }
  }
  const std::vector<std::string> left = cmd->remaining();
  if (left.empty()) return "";
  std::vector<std::string> names;
  for (const CLI::Option* opt : cmd->get_options()) {
    for (const auto& l : opt->get_lnames()) names.push_back("--" + l);
    for (const auto& s : opt->get_snames()) names.push_back("-" + s);
  }
  std::string out;
  bool after_option = false;  // the word before was an unknown option without '=': its value
  for (const std::string& word : left) {
    const std::string name = word.substr(0, word.find('='));
    const bool option = name.size() > 1 && name[0] == '-';
    const bool value = after_option && !option;
    after_option = option && name == word;
    if (value) continue;
    out += fmt::format("{}{}: unknown {} '{}'", out.empty() ? "" : "\n", path,
                       option ? "option" : "argument", option ? name : word);
    if (option)
      if (const auto near = moetrain::nearest(name, names))
        out += fmt::format("; did you mean '{}'?", *near);
  }
  return out + fmt::format(" (see {} --help)", path);
}

// Keeps the captured defaults --help shows only where they say something: not for lists, empty
// texts or required options, nor where the help text says the default itself ("default: the
// run's train.eval_batches"), whose stored value only stands for "not given".
void show_defaults(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands({})) {
    for (CLI::Option* opt : sub->get_options()) {
      const std::string& d = opt->get_default_str();
      if (d == "[]" || d.empty() || opt->get_required() ||
          opt->get_description().find("default") != std::string::npos)
        opt->default_str("");
    }
    show_defaults(*sub);
  }
}

int run_command(int argc, char** argv) {
  CLI::App app{"moetrain: trains Mixture-of-Experts models on CPUs, across processes and machines"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MOETRAIN_VERSION);
  // Every --help shows the default of each option that has one.
  app.option_defaults()->always_capture_default();

  std::map<CLI::App*, moetrain::app::Run> runs;
  auto add = [&](moetrain::app::Run run) { runs[app.get_subcommands({}).back()] = std::move(run); };
  add(moetrain::app::add_version_command(app));
  add(moetrain::app::add_prepare_command(app));
  add(moetrain::app::add_tokenizer_command(app));
  add(moetrain::app::add_train_command(app));
  add(moetrain::app::add_eval_command(app));
  add(moetrain::app::add_sample_command(app));
  add(moetrain::app::add_forward_command(app));
  add(moetrain::app::add_classify_command(app));
  add(moetrain::app::add_launch_command(app));
  add(moetrain::app::add_report_command(app));
  add(moetrain::app::add_plan_command(app));
  add(moetrain::app::add_config_command(app));
#ifdef MOETRAIN_WITH_ZMQ
  add(moetrain::app::add_ps_command(app));
#endif
  show_defaults(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Name the unknown subcommand rather than CLI11's generic "a subcommand is required".
    bool known_sub = false;
    std::string known;
    for (auto* sub : app.get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      if (argc > 1 && sub->get_name() == argv[1]) known_sub = true;
    }
    if (argc > 1 && argv[1][0] != '-' && !known_sub) {
      std::vector<std::string> names;
      for (auto* sub : app.get_subcommands({})) names.push_back(sub->get_name());
      const auto near = moetrain::nearest(argv[1], names);
      std::fprintf(
          stderr, "moetrain: unknown subcommand '%s'%s (known: %s); see 'moetrain --help'\n",
          argv[1], near ? fmt::format("; did you mean '{}'?", *near).c_str() : "", known.c_str());
      return 2;
    }
    if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
      if (const std::string said = unknown_options(app); !said.empty()) {
        std::fprintf(stderr, "%s\n", said.c_str());
        return 2;
      }
    }
    app.exit(e);
    return 2;
  }

  for (auto* sub : app.get_subcommands()) return runs.at(sub)();
  return 2;
}

int fail(const char* message) {
  std::fprintf(stderr, "moetrain: error: %s\n", message);
  std::fflush(stderr);
  if (moetrain::dist_mpi_active()) moetrain::dist_abort(1);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int code = 1;
  // MOETRAIN_LOG_LEVEL=debug: also what only a developer needs (where an error was raised).
  if (const char* level = std::getenv("MOETRAIN_LOG_LEVEL");
      level && std::strcmp(level, "debug") == 0)
    moetrain::set_log_level(moetrain::LogLevel::Debug);
  try {
    moetrain::dist_init(&argc, &argv);
    code = run_command(argc, argv);
  } catch (const moetrain::Error& e) {
    // The user reads what is wrong and what to do; where the code noticed it is for a developer
    // (MOETRAIN_LOG_LEVEL=debug).
    if (moetrain::log_level() <= moetrain::LogLevel::Debug)
      moetrain::log_message(moetrain::LogLevel::Debug, true,
                            fmt::format("the error was raised at {}", e.location()));
    return fail(e.what());
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  moetrain::dist_finalize();
  return code;
}
