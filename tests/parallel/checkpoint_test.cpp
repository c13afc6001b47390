// Checkpoints written by every rank at once (MPI, np 2 and 4): transformers' sharded layout for
// the parameters, slices for the optimizer state, read back whole or in any cut by every rank;
// damage found by whichever rank checksums the file is refused by all; a rank that fails while
// writing fails every rank and commits nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "parallel/runtime.h"
#include "support/shared_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kEmbed = 16 * 8;

float value(const std::string& name, int64_t i, int64_t step) {
  float h = static_cast<float>(step);
  for (char c : name) h = h * 1.5f + static_cast<float>(c % 17);
  return h + 0.125f * static_cast<float>(i);
}

std::vector<float> values(const std::string& name, int64_t n, int64_t step) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = value(name, i, step);
  return v;
}

std::string expert_name(int64_t e) {
  return "experts." + std::to_string(e) + ".weight";
}

// Rank q of W: experts 2q and 2q+1, the embedding on the last rank, slice q of the embedding's
// moment, the bias on rank 0.
struct RankShare {
  std::vector<std::vector<float>> experts;
  std::vector<float> embed, moment, bias;
  CheckpointShare share;
  RankShare(int q, int W, int64_t step) {
    for (int64_t e = 2 * q; e < 2 * q + 2; ++e) experts.push_back(values(expert_name(e), 12, step));
    embed = values("embed", kEmbed, step);
    const int64_t lo = kEmbed * q / W, hi = kEmbed * (q + 1) / W;
    std::vector<float> all = values("m.embed", kEmbed, step);
    moment.assign(all.begin() + lo, all.begin() + hi);
    bias = values("bias", 4, step);
    for (int64_t k = 0; k < 2; ++k)
      share.model.push_back(whole_tensor(expert_name(2 * q + k), {4, 3}, experts[k].data()));
    if (q == W - 1) share.model.push_back(whole_tensor("embed", {16, 8}, embed.data()));
    share.optimizer.push_back({"m.embed", {16, 8}, lo, hi, moment.data()});
    if (q == 0) share.state.push_back(whole_tensor("bias", {4}, bias.data()));
  }
};

fs::path write_step(Comm& comm, const fs::path& run, int64_t step, int64_t keep = 3) {
  RankShare mine(comm.rank(), comm.size(), step);
  CheckpointDocs docs;
  docs.config = {{"model_type", "test"}};
  docs.trainer = {{"step", step}};
  return write_checkpoint(comm, run, step, mine.share, docs, keep);
}

}  // namespace

TEST(DistCheckpoint, EveryRankWritesItsShareAndReadsAnyCut) {
  auto world = dist_world("ckpt_write");
  const int W = world->size();
  SharedDir dir(*world, "dist_ckpt");
  fs::path ckpt = write_step(*world, dir.path(), 7);
  EXPECT_EQ(ckpt, checkpoint_dir(dir.path(), 7));

  // Parameters in transformers' sharded layout: W files, an index naming each tensor's file,
  // every tensor whole in the file the index names.
  nlohmann::json index = read_checkpoint_json(ckpt, "model.safetensors.index.json");
  const nlohmann::json& map = index["weight_map"];
  EXPECT_EQ(map.size(), static_cast<std::size_t>(2 * W + 1));
  std::set<std::string> files;
  for (auto& [name, file] : map.items()) {
    files.insert(file.get<std::string>());
    SafetensorsReader r(ckpt / file.get<std::string>());
    EXPECT_TRUE(r.contains(name)) << name;
    EXPECT_EQ(r.metadata().at("format"), "pt");
  }
  EXPECT_EQ(files.size(), static_cast<std::size_t>(W));
  EXPECT_TRUE(files.count("model-00001-of-0000" + std::to_string(W) + ".safetensors"));
  EXPECT_EQ(index["metadata"]["total_size"], (2 * W * 12 + kEmbed) * 4);
  EXPECT_FALSE(fs::exists(ckpt / "model.safetensors"));
  EXPECT_TRUE(fs::exists(ckpt / "state.safetensors"));  // one writer: no shard suffix
  nlohmann::json manifest = read_checkpoint_json(ckpt, "manifest.json");
  EXPECT_EQ(manifest["world_size"], W);
  EXPECT_EQ(manifest["tensors"]["optimizer"]["m.embed"]["pieces"].size(),
            static_cast<std::size_t>(W));

  // Every rank reads everything, whole, and a range across every slice.
  auto found = find_latest_checkpoint(dir.path(), world.get());
  ASSERT_TRUE(found);
  EXPECT_EQ(*found, ckpt);
  std::vector<std::vector<float>> experts(2 * W, std::vector<float>(12));
  std::vector<float> embed(kEmbed), moment(kEmbed - 2), bias(4);
  CheckpointShare want;
  for (int64_t e = 0; e < 2 * W; ++e)
    want.model.push_back(whole_tensor(expert_name(e), {4, 3}, experts[e].data()));
  want.model.push_back(whole_tensor("embed", {16, 8}, embed.data()));
  want.optimizer.push_back({"m.embed", {16, 8}, 1, kEmbed - 1, moment.data()});
  want.state.push_back(whole_tensor("bias", {4}, bias.data()));
  read_checkpoint_pieces(ckpt, want);
  for (int64_t e = 0; e < 2 * W; ++e) EXPECT_EQ(experts[e], values(expert_name(e), 12, 7)) << e;
  EXPECT_EQ(embed, values("embed", kEmbed, 7));
  std::vector<float> all = values("m.embed", kEmbed, 7);
  EXPECT_EQ(0, std::memcmp(moment.data(), all.data() + 1, moment.size() * sizeof(float)));
  EXPECT_EQ(bias, values("bias", 4, 7));
}

TEST(DistCheckpoint, DamageFoundByAnyRankIsRefusedByAll) {
  auto world = dist_world("ckpt_verify");
  const int W = world->size();
  SharedDir dir(*world, "dist_ckpt_verify");
  write_step(*world, dir.path(), 1);
  fs::path second = write_step(*world, dir.path(), 2);
  world->barrier();
  // A flipped byte in the last model shard (the files are checksummed biggest first, round
  // robin, so with several ranks another rank than 0 may be the one to find it).
  if (world->rank() == 0) {
    fs::path shard = second / fmt::format("model-0000{}-of-0000{}.safetensors", W, W);
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(shard) - 3));
    f.put('\x7f');
  }
  world->barrier();
  EXPECT_THROW(verify_checkpoint(second, world.get()), Error);
  auto found = find_latest_checkpoint(dir.path(), world.get());
  ASSERT_TRUE(found);
  EXPECT_EQ(*found, checkpoint_dir(dir.path(), 1));
}

TEST(DistCheckpoint, ARankThatFailsFailsEveryRankAndNothingIsCommitted) {
  auto world = dist_world("ckpt_fail");
  const int W = world->size();
  SharedDir dir(*world, "dist_ckpt_fail");
  write_step(*world, dir.path(), 1);
  RankShare mine(world->rank(), W, 2);
  if (world->rank() == W - 1) mine.share.optimizer[0].end = kEmbed + 5;  // past the tensor
  try {
    write_checkpoint(*world, dir.path(), 2, mine.share, {}, 3);
    ADD_FAILURE() << "the checkpoint was written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lies outside"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(checkpoint_dir(dir.path(), 2)));
  // A rank that leaves a gap (writes nothing of the moment): refused at the commit.
  RankShare gap(world->rank(), W, 2);
  if (world->rank() == W - 1) gap.share.optimizer.clear();
  EXPECT_THROW(write_checkpoint(*world, dir.path(), 2, gap.share, {}, 3), Error);
  EXPECT_FALSE(fs::exists(checkpoint_dir(dir.path(), 2)));
  auto found = find_latest_checkpoint(dir.path(), world.get());
  ASSERT_TRUE(found);
  EXPECT_EQ(*found, checkpoint_dir(dir.path(), 1));
}
