// A run on SentencePiece data: the model's vocabulary follows the tokenizer, every checkpoint
// carries it, and a resume or evaluation on data made with another tokenizer is refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "data/tokenizer_train.h"
#include "io/checkpoint.h"
#include "support/expect_error.h"
#include "support/small_run.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using namespace testing;

const fs::path kFortunes = "/usr/share/games/fortunes";

Tokenizer trained(const TempDir& tmp, const std::string& name, const fs::path& text) {
  TokenizerTrainOptions o;
  o.corpus.inputs = {text};
  o.out_dir = tmp / name;
  o.vocab_size = 512;
  return train_tokenizer(o);
}

void prepare(const fs::path& out, const Tokenizer& tok) {
  PrepareOptions o;
  o.inputs = {kFortunes / "fortunes"};
  o.out_dir = out;
  o.val_fraction = 0.1;
  o.tokenizer = tok;
  prepare_corpus(o);
}

TEST(TokenizerRun, VocabularyFollowsTheTokenizerAndTravelsWithCheckpoints) {
  TempDir tmp("tok_run");
  const Tokenizer a = trained(tmp, "tok_a", kFortunes / "fortunes");
  prepare(tmp / "data", a);
  std::vector<std::string> keys = testing::small_run_keys(tmp);
  keys.push_back("train.steps=4");
  keys.push_back("train.checkpoint_every=2");
  const RunConfig cfg = load_run_config("", keys);
  EXPECT_EQ(cfg.model.vocab_size, 512);
  {
    Trainer t(cfg, false);
    t.run();
  }
  const fs::path ckpt = *find_latest_checkpoint(cfg.train.run_dir);
  EXPECT_EQ(read_file_bytes(ckpt / "tokenizer.model"), a.model_bytes());
  EXPECT_EQ(read_checkpoint_json(ckpt, "trainer_state.json")["tokenizer"], a.fingerprint());
  EXPECT_EQ(read_checkpoint_json(ckpt, "config.json")["vocab_size"], 512);
  EXPECT_EQ(Tokenizer::from_dir(fs::path(cfg.train.run_dir) / "checkpoints" / "latest")
                .fingerprint(),
            a.fingerprint());

  // A model smaller than the tokenizer: refused, naming the shard and both sizes.
  std::vector<std::string> small = keys;
  small.push_back("model.vocab_size=300");
  small.push_back("train.run_dir=" + (tmp / "small").string());
  expect_error([&] { Trainer t(load_run_config("", small), false); },
               {(tmp / "data" / "train.bin").string(), "vocabulary 512", "model.vocab_size = 300"});

  // The same run resumed on data made with another tokenizer of the same size.
  const Tokenizer b = trained(tmp, "tok_b", kFortunes / "literature");
  ASSERT_NE(a.fingerprint(), b.fingerprint());
  prepare(tmp / "data_b", b);
  std::vector<std::string> other = keys;
  other.push_back("data.dir=" + (tmp / "data_b").string());
  other.push_back("train.steps=6");
  expect_error([&] { Trainer t(load_run_config("", other), true); },
               {"trained with the tokenizer " + a.fingerprint(), b.fingerprint(),
                "moetrain prepare --tokenizer"});
}

}  // namespace
}  // namespace moetrain
