// The command line as a user meets it: real processes of the built binary, exit codes and
// messages.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "support/temp_dir.h"

namespace {

struct Result {
  int code;
  std::string output;  // stdout and stderr together
};

// env: assignments put before the command ("NAME=value ").
Result run(const std::string& args, const std::string& env = "") {
  std::string cmd = env + std::string(MOETRAIN_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace

TEST(Cli, HelpAndVersion) {
  Result help = run("--help");
  EXPECT_EQ(help.code, 0);
  for (const char* sub :
       {"train", "prepare", "eval", "sample", "forward", "version", "report", "plan", "config"})
    EXPECT_NE(help.output.find(sub), std::string::npos) << sub << " missing from --help";
  Result version = run("version");
  EXPECT_EQ(version.code, 0);
  EXPECT_NE(version.output.find("oneDNN"), std::string::npos) << version.output;
  EXPECT_NE(version.output.find("threads:"), std::string::npos) << version.output;
}

TEST(Cli, UnknownSubcommandAndFlagExitWithTwo) {
  Result sub = run("trian");
  EXPECT_EQ(sub.code, 2);
  EXPECT_NE(sub.output.find("unknown subcommand 'trian'"), std::string::npos) << sub.output;
  Result flag = run("version --fast");
  EXPECT_EQ(flag.code, 2);
  EXPECT_NE(flag.output.find("--fast"), std::string::npos) << flag.output;
  Result missing = run("train");
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.output.find("--config"), std::string::npos) << missing.output;
}

TEST(Cli, BadConfigIsAClearErrorNotACrash) {
  moetrain::testing::TempDir tmp("cli");
  auto cfg = tmp.write("bad.toml", "[model]\nn_experts = 0\n");
  Result r = run("train --config " + cfg.string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("model.n_experts = 0"), std::string::npos) << r.output;
  Result key = run("train --config " + std::string(MOETRAIN_SOURCE_DIR) +
                   "/configs/tiny.toml --set model.dimm=3");
  EXPECT_EQ(key.code, 1);
  EXPECT_NE(key.output.find("model.dimm"), std::string::npos) << key.output;
  Result ckpt = run("sample --checkpoint " + (tmp / "nothing").string() + " --prompt hi");
  EXPECT_EQ(ckpt.code, 1);
  EXPECT_NE(ckpt.output.find("nothing"), std::string::npos) << ckpt.output;
}

TEST(Cli, ErrorsNameTheSettingNotTheSourceLocation) {
  const std::string cfg = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  Result r = run("train --config " + cfg + " --set train.progress=fancy");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("train.progress = 'fancy'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("allowed are auto, bar, lines, off"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("src/"), std::string::npos) << r.output;
  // A developer asks for the location.
  Result debug =
      run("train --config " + cfg + " --set train.progress=fancy", "MOETRAIN_LOG_LEVEL=debug ");
  EXPECT_EQ(debug.code, 1);
  EXPECT_NE(debug.output.find("raised at src/train/run_config.h:"), std::string::npos)
      << debug.output;
}

TEST(Cli, ReportNamesAMissingRunAndWritesWhatIsThere) {
  moetrain::testing::TempDir tmp("cli");
  Result missing = run("report " + (tmp / "no_run").string());
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.output.find("no_run"), std::string::npos) << missing.output;
  tmp.write("run/metrics.jsonl", "{\"step\": 1, \"loss\": 3.5}\n{\"step\": 2, \"lo");
  const auto out = tmp / "r.html";
  Result torn = run("report " + (tmp / "run").string() + " --out " + out.string());
  EXPECT_EQ(torn.code, 0) << torn.output;
  EXPECT_NE(torn.output.find(out.string()), std::string::npos) << torn.output;
  EXPECT_TRUE(std::filesystem::is_regular_file(out));
}

TEST(Cli, PrepareTrainSampleForwardEndToEnd) {
  moetrain::testing::TempDir tmp("e2e");
  std::string text;
  for (int i = 0; i < 400; ++i)
    text +=
        "All that glitters is not gold; all who wander are not lost. " + std::to_string(i) + "\n";
  auto corpus = tmp.write("corpus.txt", text);
  ASSERT_EQ(run("prepare --input " + corpus.string() + " --out " + (tmp / "data").string()).code,
            0);
  std::string sets =
      " --set model.dim=32 --set model.n_layers=1 --set model.n_heads=2 --set model.n_kv_heads=1"
      " --set model.expert_hidden=16 --set model.n_experts=4 --set train.steps=6"
      " --set train.batch_size=2 --set train.seq_len=32 --set train.eval_every=0"
      " --set train.eval_batches=2 --set train.progress=lines --set data.dir=" +
      (tmp / "data").string() + " --set train.run_dir=" + (tmp / "run").string();
  Result train =
      run("train --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml" + sets);
  ASSERT_EQ(train.code, 0) << train.output;
  EXPECT_NE(train.output.find("validation loss"), std::string::npos) << train.output;
  EXPECT_NE(train.output.find("nats/byte"), std::string::npos) << train.output;
  // eval states the loss in train's unit.
  Result eval = run("eval --checkpoint " + (tmp / "run").string() + " --batches 2");
  ASSERT_EQ(eval.code, 0) << eval.output;
  EXPECT_NE(eval.output.find("nats/byte over 2 batches"), std::string::npos) << eval.output;
  EXPECT_EQ(eval.output.find("nats/token"), std::string::npos) << eval.output;
  Result sample =
      run("sample --checkpoint " + (tmp / "run").string() + " --prompt All --max-tokens 20");
  EXPECT_EQ(sample.code, 0) << sample.output;
  Result fwd = run("forward --checkpoint " + (tmp / "run").string() +
                   " --input 'All that' --backward --out " + (tmp / "f.safetensors").string());
  EXPECT_EQ(fwd.code, 0) << fwd.output;
  EXPECT_TRUE(std::filesystem::exists(tmp / "f.safetensors"));
  Result bad = run("forward --checkpoint " + (tmp / "run").string() + " --tokens 1,2,999 --out " +
                   (tmp / "g.safetensors").string());
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.output.find("999"), std::string::npos) << bad.output;
}

TEST(Cli, OutOfRangeValuesAreRefusedWithAReadableRule) {
  struct Case {
    const char* args;
    const char* says;
  };
  for (const Case& c : {
           Case{"sample --checkpoint x --temperature nan", "--temperature: nan is not a finite"},
           Case{"sample --checkpoint x --temperature inf", "--temperature: inf is not a finite"},
           Case{"sample --checkpoint x --temperature -0.5", "--temperature: -0.5 must be >= 0"},
           Case{"sample --checkpoint x --max-tokens 9223372036854775808", "out of range"},
           Case{"sample --checkpoint x --seed -1", "--seed: -1 is not a non-negative integer"},
           Case{"eval --checkpoint x --batches 0", "--batches: 0 must be >= 1"},
           Case{"launch -n 2 --backoff -1 -- train", "--backoff: -1 must be >= 0"},
           Case{"train -c x --collective-warn -1", "--collective-warn: -1 must be >= 0"},
       }) {
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
    // CLI11's own checks printed the type's limits (DBL_MAX in 309 digits).
    EXPECT_LT(r.output.size(), 400u) << c.args << "\n" << r.output;
  }
  // In range, the values pass the checks (and the missing checkpoint is what stops the run).
  Result ok =
      run("sample --checkpoint /nonexistent_ckpt --temperature 0.7 --seed 7 --max-tokens 3");
  EXPECT_EQ(ok.code, 1) << ok.output;
  EXPECT_NE(ok.output.find("nonexistent_ckpt"), std::string::npos) << ok.output;
}

TEST(Cli, ConfigThatIsADirectoryOrSetsNothingIsNamedAsSuch) {
  moetrain::testing::TempDir tmp("cli");
  std::filesystem::create_directories(tmp / "configs.d");
  Result dir = run("train --config " + (tmp / "configs.d").string());
  EXPECT_EQ(dir.code, 1) << dir.output;
  EXPECT_NE(dir.output.find("is a directory"), std::string::npos) << dir.output;
  // An empty file trains with every default: said before anything else happens (here the
  // missing data stops the run).
  auto empty = tmp.write("empty.toml", "# nothing yet\n");
  Result none =
      run("train --config " + empty.string() + " --set data.dir=" + (tmp / "no_data").string() +
          " --set train.run_dir=" + (tmp / "run").string());
  EXPECT_EQ(none.code, 1) << none.output;
  EXPECT_NE(none.output.find("sets no key: every setting takes its default"), std::string::npos)
      << none.output;
  // A file that leaves sections to their defaults is the common case, not worth a line.
  auto partial = tmp.write("model.toml", "[model]\ndim = 32\n");
  Result some =
      run("train --config " + partial.string() + " --set data.dir=" + (tmp / "no_data").string() +
          " --set train.run_dir=" + (tmp / "run").string());
  EXPECT_EQ(some.output.find("has no ["), std::string::npos) << some.output;
  EXPECT_EQ(some.output.find("take their defaults"), std::string::npos) << some.output;
}

// A path that is not a readable TOML file is named for what it is, not as missing.
TEST(Cli, ConfigThatIsNotAFileSaysWhatItIs) {
  moetrain::testing::TempDir tmp("cli_cfg_kind");
  Result dev = run("train --dry-run --config /dev/zero");
  EXPECT_EQ(dev.code, 1) << dev.output;
  EXPECT_NE(dev.output.find("config file '/dev/zero' is a character device, not a file"),
            std::string::npos)
      << dev.output;
  EXPECT_EQ(dev.output.find("does not exist"), std::string::npos) << dev.output;
  Result missing = run("train --dry-run --config " + (tmp / "absent.toml").string());
  EXPECT_EQ(missing.code, 1) << missing.output;
  EXPECT_NE(missing.output.find("absent.toml' does not exist"), std::string::npos)
      << missing.output;
  auto garbage = tmp.write("garbage.toml", std::string("\x7f"
                                                       "ELF\x02\x01\x01\0\0\0",
                                                       10));
  Result bad = run("train --dry-run --config " + garbage.string());
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_NE(bad.output.find("garbage.toml:1:1: TOML syntax error"), std::string::npos)
      << bad.output;
}

TEST(Cli, UnknownKeysAndFlagsSuggestTheNearest) {
  const std::string cfg = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  Result key = run("train --dry-run --config " + cfg + " --set model.n_expert=4");
  EXPECT_EQ(key.code, 1) << key.output;
  EXPECT_NE(key.output.find("unknown key 'model.n_expert'; did you mean 'model.n_experts'?"),
            std::string::npos)
      << key.output;
  EXPECT_LT(key.output.size(), 300u) << key.output;  // one line, not every key
  Result flag = run("train --config " + cfg + " --dry-rn");
  EXPECT_EQ(flag.code, 2) << flag.output;
  EXPECT_NE(flag.output.find("moetrain train: unknown option '--dry-rn'; did you mean '--dry-run'? "
                             "(see moetrain train --help)"),
            std::string::npos)
      << flag.output;
  // A flag that only means something with --dry-run is refused without it, not ignored.
  Result np = run("train --config " + cfg + " --np 4");
  EXPECT_EQ(np.code, 2) << np.output;
  EXPECT_NE(np.output.find("--np requires --dry-run"), std::string::npos) << np.output;
  Result cls = run("classify --config x.toml --resum");
  EXPECT_EQ(cls.code, 2) << cls.output;
  EXPECT_NE(
      cls.output.find("moetrain classify: unknown option '--resum'; did you mean '--resume'?"),
      std::string::npos)
      << cls.output;
  Result sub = run("trian --config x");
  EXPECT_EQ(sub.code, 2) << sub.output;
  EXPECT_NE(sub.output.find("did you mean 'train'?"), std::string::npos) << sub.output;
}

// What a user gets wrong most is said without where in the source it was noticed.
TEST(Cli, NoSourceLocationsInErrors) {
  moetrain::testing::TempDir tmp("cli_loc");
  const std::string cfg = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  for (const std::string& args : std::vector<std::string>{
           "train --dry-run --config " + cfg + " --set model.dim=0",
           "train --dry-run --config " + cfg + " --set model.nope=1",
           "train --dry-run --config /dev/zero", "train --dry-run --config " + cfg + " --lr -1",
           "classify --config " + cfg, "eval --checkpoint " + (tmp / "none").string(),
           "prepare --input " + (tmp / "none").string() + " --out " + (tmp / "o").string(),
           "config list nosuch", "plan --config " + cfg + " --set train.steps=x"}) {
    Result r = run(args);
    EXPECT_NE(r.code, 0) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find("src/"), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find(".cpp:"), std::string::npos) << args << "\n" << r.output;
  }
}

TEST(Cli, RouteGroupsZeroIsRefused) {
  Result r = run("train --dry-run --config " + std::string(MOETRAIN_SOURCE_DIR) +
                 "/configs/tiny.toml --set model.route_groups=0");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("model.route_groups = 0: must be ≥ 1"), std::string::npos) << r.output;
}

TEST(Cli, ConfigListPrintsEveryKeyWithTypeDefaultAndHelp) {
  Result all = run("config list");
  EXPECT_EQ(all.code, 0) << all.output;
  for (const char* part : {"[model]", "  model.n_experts = 8  (integer)",
                           "  model.router = \"topk_softmax\"  (string: "
                           "topk_softmax, noisy_topk, expert_choice, sigmoid_bias)",
                           "[dist]", "  train.steps = 1000"})
    EXPECT_NE(all.output.find(part), std::string::npos) << part << "\n" << all.output;
  Result optim = run("config list optim");
  EXPECT_EQ(optim.code, 0) << optim.output;
  EXPECT_NE(optim.output.find("Peak learning rate"), std::string::npos) << optim.output;
  EXPECT_EQ(optim.output.find("[model]"), std::string::npos) << optim.output;
  Result cls = run("config list model --classify");
  EXPECT_NE(cls.output.find("model.n_classes = 10"), std::string::npos) << cls.output;
  Result bad = run("config list optm");
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_NE(bad.output.find("no section [optm]; did you mean 'optim'?"), std::string::npos)
      << bad.output;
}

// The common settings as flags of their own, on train and classify; every --help shows the
// defaults.
TEST(Cli, CommonFlagsSetTheirKeysAndHelpShowsDefaults) {
  moetrain::testing::TempDir tmp("cli_flags");
  Result r =
      run("train --dry-run --config " + std::string(MOETRAIN_SOURCE_DIR) +
          "/configs/tiny.toml --steps 7 --lr 0.01 --threads 1 --run-dir " + (tmp / "r").string());
  EXPECT_EQ(r.code, 0) << r.output;
  for (const std::string& part :
       std::vector<std::string>{"\"steps\": 7", "\"lr\": 0.01", "\"threads\": 1",
                                "\"run_dir\": \"" + (tmp / "r").string() + "\""})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  for (const char* cmd : {"train", "classify"}) {
    Result help = run(std::string(cmd) + " --help");
    EXPECT_EQ(help.code, 0) << help.output;
    for (const char* flag : {"--run-dir", "--steps", "--lr", "--threads"})
      EXPECT_NE(help.output.find(flag), std::string::npos) << cmd << " " << flag;
    EXPECT_NE(help.output.find("[default: the config's train.steps]"), std::string::npos)
        << help.output;
  }
  // A mistyped one is named with the nearest, and its value is not taken for another mistake.
  Result typo = run("train --config x.toml --stepz 5");
  EXPECT_EQ(typo.code, 2) << typo.output;
  EXPECT_NE(typo.output.find("moetrain train: unknown option '--stepz'; did you mean '--steps'?"),
            std::string::npos)
      << typo.output;
  EXPECT_EQ(typo.output.find("'5'"), std::string::npos) << typo.output;
  Result bad = run("classify --config x.toml --steps -3");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--steps"), std::string::npos) << bad.output;
  Result launch = run("launch --help");
  EXPECT_NE(launch.output.find("=3"), std::string::npos) << launch.output;   // --max-restarts
  EXPECT_EQ(launch.output.find("=[]"), std::string::npos) << launch.output;  // lists have none
  EXPECT_EQ(launch.output.find("INT=0 REQUIRED"), std::string::npos) << launch.output;
  Result sample = run("sample --help");
  EXPECT_NE(sample.output.find("=0.8"), std::string::npos) << sample.output;  // --temperature
}

// --dry-run validates and prints the configuration without training: nothing is written, and a
// bad key fails exactly as a real run would.
// `make demo` trains configs/demo.toml as it is (scripts/demo.sh adds no setting), and that is
// the model of configs/tiny.toml.
TEST(Cli, TheDemoIsItsOwnConfigWithTinysModel) {
  const std::string dir = std::string(MOETRAIN_SOURCE_DIR);
  Result demo = run("train --dry-run --all --config " + dir + "/configs/demo.toml");
  Result tiny = run("train --dry-run --all --config " + dir + "/configs/tiny.toml");
  ASSERT_EQ(demo.code, 0) << demo.output;
  ASSERT_EQ(tiny.code, 0) << tiny.output;
  const auto model = [](const std::string& json) {
    const std::size_t at = json.find("\"model\": {");
    return json.substr(at, json.find('}', at) - at);
  };
  EXPECT_EQ(model(demo.output), model(tiny.output));
  std::ifstream script(dir + "/scripts/demo.sh");
  const std::string text((std::istreambuf_iterator<char>(script)), {});
  EXPECT_NE(text.find("train --config configs/demo.toml --resume ${DEMO_ARGS:-}\n"),
            std::string::npos);
  EXPECT_EQ(text.find("--set"), std::string::npos) << "demo.sh overrides settings again";
}

TEST(Cli, TrainDryRunPrintsWhatDiffersUnlessAll) {
  const std::string base =
      "train --dry-run --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  Result changed = run(base + " --set optim.beta2=0.99");
  EXPECT_EQ(changed.code, 0) << changed.output;
  EXPECT_NE(changed.output.find("\"beta2\": 0.99"), std::string::npos) << changed.output;
  EXPECT_NE(changed.output.find("\"run_dir\": \"runs/tiny\""), std::string::npos) << changed.output;
  EXPECT_EQ(changed.output.find("\"beta1\""), std::string::npos) << changed.output;  // a default
  EXPECT_EQ(changed.output.find("\"n_experts\""), std::string::npos) << changed.output;
  Result all = run(base + " --set optim.beta2=0.99 --all");
  EXPECT_EQ(all.code, 0) << all.output;
  EXPECT_NE(all.output.find("\"beta1\": 0.9"), std::string::npos) << all.output;
  EXPECT_NE(all.output.find("\"n_experts\": 8"), std::string::npos) << all.output;
}

TEST(Cli, TrainDryRunValidatesWithoutTraining) {
  moetrain::testing::TempDir tmp("cli_dry");
  const std::string base = "train --dry-run --config " + std::string(MOETRAIN_SOURCE_DIR) +
                           "/configs/tiny.toml --set train.run_dir=" + (tmp / "run").string();
  Result ok = run(base + " --set model.router_skew=1.2");
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("\"router_skew\": 1.2"), std::string::npos) << ok.output;
  EXPECT_FALSE(std::filesystem::exists(tmp / "run"));
  Result bad = run(base + " --set dist.grad_reduce_dtype=f64");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.output.find("dist.grad_reduce_dtype"), std::string::npos) << bad.output;
}
