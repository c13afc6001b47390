// `moetrain prepare`: text files -> byte-token shards (train.bin, val.bin) and meta.json.
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "data/prepare.h"

namespace moetrain::app {

Run add_prepare_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("prepare",
                         "Turn text files into byte-token shards: DIR/train.bin, DIR/val.bin, "
                         "DIR/meta.json");
  struct Args {
    std::vector<std::string> inputs;
    std::string out;
    double val_fraction = 0.05;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--input", args->inputs,
                  "Text files or directories (read recursively, sorted by path) in any encoding: "
                  "tokens are bytes; symlinks, *.dat and binary files (a NUL byte) are skipped "
                  "and counted")
      ->required();
  cmd->add_option("--out", args->out, "Output directory (created if missing)")->required();
  cmd->add_option(
         "--val-fraction", args->val_fraction,
         "Share of the text held out for validation, in [0, 1); spread over the corpus in chunks")
      ->capture_default_str();
  return [args] {
    PrepareOptions opts;
    opts.inputs.assign(args->inputs.begin(), args->inputs.end());
    opts.out_dir = args->out;
    opts.val_fraction = args->val_fraction;
    PrepareReport r = prepare_text_corpus(opts);
    // The counts are in the library's log line; stdout names what was written.
    const std::filesystem::path out = args->out;
    fmt::print("wrote {} ({} tokens), {} ({} tokens), {}\n", (out / "train.bin").string(),
               r.train_tokens, (out / "val.bin").string(), r.val_tokens,
               (out / "meta.json").string());
    return 0;
  };
}

}  // namespace moetrain::app
