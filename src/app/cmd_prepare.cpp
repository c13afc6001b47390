// `moetrain prepare`: a corpus -> token shards (train.bin, val.bin) and meta.json.
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "core/threads.h"
#include "data/prepare.h"

namespace moetrain::app {

Run add_prepare_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "prepare",
      "Turn a corpus (text files, directories, JSONL; plain, gzip or zstd) into token shards: "
      "DIR/train.bin, DIR/val.bin, DIR/meta.json (docs/data.md)");
  struct Args {
    std::vector<std::string> inputs;
    std::string out, tokenizer = "byte", jsonl_field = "text", bad_lines = "refuse";
    double val_fraction = 0.05;
    bool no_progress = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--input", args->inputs,
                  "Files or directories (read recursively, sorted by path). A text file is one "
                  "document; *.jsonl / *.ndjson hold one per line; gzip and zstd files are "
                  "decompressed; symlinks, *.dat and binary files (a NUL byte) are skipped and "
                  "counted")
      ->required();
  cmd->add_option("--out", args->out, "Output directory (created if missing)")->required();
  cmd->add_option("--tokenizer", args->tokenizer,
                  "'byte' (256 byte tokens), or a SentencePiece tokenizer.model / a directory "
                  "holding one (`moetrain tokenizer train`, a Hugging Face model directory); "
                  "copied into the output directory")
      ->capture_default_str();
  cmd->add_option("--jsonl-field", args->jsonl_field, "The JSONL field holding each document")
      ->capture_default_str();
  cmd->add_option("--bad-lines", args->bad_lines,
                  "A JSONL line that is not an object with the field: refuse (stop, naming file "
                  "and line) or skip (count it in meta.json)")
      ->check(CLI::IsMember({"refuse", "skip"}))
      ->capture_default_str();
  cmd->add_option(
         "--val-fraction", args->val_fraction,
         "Share of the tokens held out for validation, in [0, 1); spread over the corpus in chunks")
      ->capture_default_str();
  cmd->add_flag("--no-progress", args->no_progress, "No progress bar (it is drawn on a terminal)");
  return [args] {
    init_threads();
    PrepareOptions opts;
    opts.inputs.assign(args->inputs.begin(), args->inputs.end());
    opts.out_dir = args->out;
    opts.val_fraction = args->val_fraction;
    opts.tokenizer = load_tokenizer(args->tokenizer);
    opts.jsonl_field = args->jsonl_field;
    opts.bad_lines = args->bad_lines == "skip" ? BadLines::Skip : BadLines::Refuse;
    opts.progress = !args->no_progress;
    PrepareReport r = prepare_corpus(opts);
    // The counts are in the library's log line; stdout names what was written.
    const std::filesystem::path out = args->out;
    fmt::print("wrote {} ({} tokens), {} ({} tokens), {}\n", (out / "train.bin").string(),
               r.train_tokens, (out / "val.bin").string(), r.val_tokens,
               (out / "meta.json").string());
    return 0;
  };
}

}  // namespace moetrain::app
