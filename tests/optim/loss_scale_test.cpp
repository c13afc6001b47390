// The dynamic loss scaler's rule: back off and skip on overflow, grow after a run of good steps.
#include <gtest/gtest.h>

#include "optim/loss_scale.h"
#include "support/expect_error.h"

using namespace moetrain;

TEST(LossScaler, OverflowSkipsTheStepAndHalvesTheScale) {
  LossScaleConfig c;
  c.init = 1024;
  c.growth_interval = 3;
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_TRUE(s.update(false));
  EXPECT_FALSE(s.update(true));  // skipped
  EXPECT_EQ(s.scale(), 512.0f);
  EXPECT_EQ(s.good_steps(), 0);  // the run of good steps starts again
  EXPECT_EQ(s.skipped_steps(), 1);
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(s.scale(), 256.0f);
  EXPECT_EQ(s.skipped_steps(), 2);
}

TEST(LossScaler, GrowsAfterGrowthIntervalGoodSteps) {
  LossScaleConfig c;
  c.init = 8;
  c.growth_interval = 4;
  c.growth_factor = 2;
  LossScaler s(c);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 8.0f);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 16.0f);
  EXPECT_EQ(s.good_steps(), 0);
  // An overflow in the middle of a run resets it.
  for (int i = 0; i < 3; ++i) s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 8.0f);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 8.0f);
}

TEST(LossScaler, StaysWithinItsBounds) {
  LossScaleConfig c;
  c.init = 2;
  c.growth_interval = 1;
  c.min_scale = 1;
  c.max_scale = 8;
  LossScaler s(c);
  for (int i = 0; i < 5; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 8.0f);
  for (int i = 0; i < 6; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 1.0f);
}

TEST(LossScaler, RestoreContinuesExactly) {
  LossScaleConfig c;
  c.init = 100;
  c.growth_interval = 3;
  LossScaler a(c);
  a.update(false), a.update(true), a.update(false), a.update(false);
  LossScaler b(c);
  b.restore(a.raw_scale(), a.good_steps(), a.skipped_steps());
  for (bool bad : {false, false, true, false}) {
    EXPECT_EQ(a.update(bad), b.update(bad));
    EXPECT_EQ(a.raw_scale(), b.raw_scale());
    EXPECT_EQ(a.good_steps(), b.good_steps());
  }
  moetrain::testing::expect_error([&] { b.restore(-1, 0, 0); }, "loss scale state");
}

TEST(LossScaler, BadSettingsNameTheKey) {
  auto bad = [](auto edit, const char* needle) {
    LossScaleConfig c;
    edit(c);
    moetrain::testing::expect_error([&] { c.validate(); }, needle);
  };
  bad([](LossScaleConfig& c) { c.init = 0; }, "train.loss_scale_init = 0");
  bad([](LossScaleConfig& c) { c.growth_interval = 0; }, "train.loss_scale_growth_interval = 0");
  bad([](LossScaleConfig& c) { c.growth_factor = 1; }, "train.loss_scale_growth_factor = 1");
  bad([](LossScaleConfig& c) { c.backoff_factor = 1.5; }, "train.loss_scale_backoff_factor = 1.5");
}
