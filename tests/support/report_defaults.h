// Test support: the settings' defaults a report compares with, as `moetrain report` gives them.
#pragma once
#include "io/report.h"
#include "train/classifier_config.h"
#include "train/run_config.h"

namespace moetrain::testing {

inline SettingDefaults report_defaults() {
  return {RunConfig{}.to_json(), ClassifierRunConfig{}.to_json()};
}

}  // namespace moetrain::testing
