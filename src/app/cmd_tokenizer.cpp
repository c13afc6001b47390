// `moetrain tokenizer train|encode|decode`: SentencePiece tokenizers for `prepare --tokenizer`.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <string>
#include <vector>

#include "app/checks.h"
#include "app/commands.h"
#include "core/check.h"
#include "core/parse.h"
#include "core/threads.h"
#include "data/tokenizer_train.h"

namespace moetrain::app {

Run add_tokenizer_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenizer", "Train a SentencePiece tokenizer, or encode and "
                                              "decode with one");
  cmd->require_subcommand(1);
  struct Args {
    std::vector<std::string> inputs;
    std::string out, model_type = "bpe", jsonl_field = "text", bad_lines = "refuse";
    int64_t vocab_size = 8000, max_sentences = 2'000'000;
    std::string tokenizer, text, ids;
  };
  auto args = std::make_shared<Args>();
  auto* train = cmd->add_subcommand(
      "train",
      "Learn a SentencePiece tokenizer from a corpus (as `prepare` reads it) in the form Llama "
      "and Mixtral ship: DIR/tokenizer.model plus the files Hugging Face transformers loads");
  train->add_option("--input", args->inputs, "Files or directories, as for `prepare --input`")
      ->required();
  train->add_option("--out", args->out, "Output directory (created if missing)")->required();
  train->add_option("--vocab-size", args->vocab_size, "Pieces in the vocabulary")
      ->check(integer_in(kMinTrainedVocab))
      ->capture_default_str();
  train->add_option("--model-type", args->model_type, "bpe or unigram")
      ->check(CLI::IsMember({"bpe", "unigram"}))
      ->capture_default_str();
  train->add_option("--max-sentences", args->max_sentences,
                    "Lines sampled for training (memory grows with it)")
      ->check(integer_in(1))
      ->capture_default_str();
  train->add_option("--jsonl-field", args->jsonl_field, "As for `prepare`")->capture_default_str();
  train->add_option("--bad-lines", args->bad_lines, "As for `prepare`: refuse or skip")
      ->check(CLI::IsMember({"refuse", "skip"}))
      ->capture_default_str();

  auto* encode = cmd->add_subcommand("encode", "Print the token ids of a text");
  encode->add_option("--tokenizer", args->tokenizer,
                     "'byte', a tokenizer.model, or a directory holding one (a checkpoint)")
      ->required();
  encode->add_option("text", args->text, "The text")->required();
  auto* decode = cmd->add_subcommand("decode", "Print the text of token ids");
  decode->add_option("--tokenizer", args->tokenizer, "As for encode")->required();
  decode->add_option("ids", args->ids, "Token ids, comma or space separated")->required();

  return [args, train, encode] {
    if (train->parsed()) {
      init_threads();
      TokenizerTrainOptions o;
      o.corpus.inputs.assign(args->inputs.begin(), args->inputs.end());
      o.corpus.jsonl_field = args->jsonl_field;
      o.corpus.bad_lines = args->bad_lines == "skip" ? BadLines::Skip : BadLines::Refuse;
      o.out_dir = args->out;
      o.vocab_size = args->vocab_size;
      o.model_type = args->model_type;
      o.max_sentences = args->max_sentences;
      Tokenizer t = train_tokenizer(o);
      fmt::print("wrote {} ({} pieces)\n", (o.out_dir / kTokenizerFile).string(), t.vocab_size());
      return 0;
    }
    const Tokenizer t = load_tokenizer(args->tokenizer);
    if (encode->parsed()) {
      const std::vector<int32_t> ids = t.encode_prompt(args->text);
      fmt::print("{}\n", fmt::join(ids, " "));
      return 0;
    }
    std::vector<int32_t> ids;
    for (const std::string& w : split_list(args->ids, /*spaces=*/true)) {
      const std::optional<int64_t> v = parse_whole(w);
      MOETRAIN_CHECK(v && *v >= 0 && *v < t.vocab_size(),
                     "tokenizer decode: '{}' is not a token id in [0, {})", w, t.vocab_size());
      ids.push_back(static_cast<int32_t>(*v));
    }
    fmt::print("{}\n", t.decode(ids));
    return 0;
  };
}

}  // namespace moetrain::app
