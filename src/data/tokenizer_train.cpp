#include "data/tokenizer_train.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <thread>
#include <unordered_map>

#include "core/check.h"
#include "core/log.h"
#include "io/file.h"

// Defined by libsentencepiece, not declared in its public headers: quiets its per-step INFO log.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}

namespace moetrain {

namespace {

// The corpus's lines, one training sentence each.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(CorpusReader& reader) : reader_(reader) { Next(); }
  bool done() const override { return done_; }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return status_; }
  void Next() override {
    for (;;) {
      if (at_ < piece_.text.size()) {
        std::size_t nl = piece_.text.find('\n', at_);
        if (nl == std::string::npos) nl = piece_.text.size();
        line_.assign(piece_.text, at_, nl - at_);
        at_ = nl + 1;
        if (!line_.empty() && line_.back() == '\r') line_.pop_back();
        if (line_.empty()) continue;
        ++lines_;
        return;
      }
      try {
        if (!reader_.next(piece_)) {
          done_ = true;
          return;
        }
      } catch (const std::exception& e) {
        error_ = e.what();
        status_ = sentencepiece::util::Status(sentencepiece::util::StatusCode::kInternal, error_);
        done_ = true;
        return;
      }
      at_ = 0;
    }
  }
  uint64_t lines() const { return lines_; }
  const std::string& error() const { return error_; }

 private:
  CorpusReader& reader_;
  TextPiece piece_;
  std::size_t at_ = 0;
  std::string line_;
  bool done_ = false;
  uint64_t lines_ = 0;
  std::string error_;
  sentencepiece::util::Status status_;
};

}  // namespace

Tokenizer train_tokenizer(const TokenizerTrainOptions& o) {
  MOETRAIN_CHECK(o.vocab_size >= kMinTrainedVocab && o.vocab_size <= 2147483647,
                 "tokenizer train: --vocab-size {} outside [{}, 2147483647] (the 256 byte "
                 "pieces and <unk>, <s>, </s> come first)",
                 o.vocab_size, kMinTrainedVocab);
  MOETRAIN_CHECK(o.model_type == "bpe" || o.model_type == "unigram",
                 "tokenizer train: --model-type '{}', expected bpe or unigram", o.model_type);
  MOETRAIN_CHECK(o.max_sentences >= 1, "tokenizer train: --max-sentences {} must be at least 1",
                 o.max_sentences);
  MOETRAIN_CHECK(!o.out_dir.empty(), "tokenizer train: no output directory given");

  const CorpusScan scan = scan_corpus(o.corpus);
  CorpusReader reader(scan, o.corpus);
  LineIterator lines(reader);
  MOETRAIN_CHECK(!lines.done() || !lines.error().empty(),
                 "tokenizer train: the inputs hold no text ({} files, {} skipped)",
                 scan.files.size(), scan.skipped.size() + reader.skipped().size());

  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", o.model_type},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"character_coverage", "0.9995"},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"input_sentence_size", std::to_string(o.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", "16384"},
      {"num_threads", std::to_string(threads)},
      {"hard_vocab_limit", "true"},
  };
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(o.seed));
  sentencepiece::logging::SetMinLogLevel(log_level() == LogLevel::Debug ? 0 : 1);
  std::string model;
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  MOETRAIN_CHECK(lines.error().empty(), "tokenizer train: {}", lines.error());
  MOETRAIN_CHECK(st.ok(), "tokenizer train: SentencePiece refused --vocab-size {} ({} lines read): {}",
                 o.vocab_size, lines.lines(), st.ToString());
  Tokenizer tok = Tokenizer::sentencepiece(std::move(model), "the trained tokenizer");

  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  MOETRAIN_CHECK(!ec, "tokenizer train: cannot create '{}': {}", o.out_dir.string(), ec.message());
  for (const auto& [name, bytes] : tok.hf_files(4096)) write_file_atomic(o.out_dir / name, bytes);
  log_info("tokenizer train: {} pieces ({}) from {} lines of {} files -> {}", tok.vocab_size(),
           o.model_type, lines.lines(), reader.sources().size(),
           (o.out_dir / kTokenizerFile).string());
  return tok;
}

}  // namespace moetrain
