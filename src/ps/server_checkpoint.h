// A parameter server's checkpoint: its key range of the parameters, the optimizer state for it,
// the clock (updates applied) and, for async / ssp, each worker's clock. One safetensors file per
// checkpoint, RUN_DIR/ps/server_I/clock_C.safetensors, written atomically (temporary name, fsync,
// rename) with a CRC-32C of every tensor's bytes in its metadata, so a torn or corrupted file is
// refused instead of restored. A restarted server, or every server of a job rolling back, reads
// the newest clock all of them hold.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace moetrain::ps {

struct ServerCheckpoint {
  int64_t index = 0;  // server index
  int64_t clock = 0;  // updates applied
  int64_t key_begin = 0, key_end = 0;
  int64_t optimizer_steps = 0;
  std::string config_hash;
  std::vector<float> params;                            // (key_end − key_begin)
  std::map<std::string, std::vector<float>> optimizer;  // state buffer → (key_end − key_begin)
  std::map<int64_t, int64_t> worker_clocks;             // async / ssp: worker → clock
  // The update rule's own state beyond the optimizer (the importance reweighting's moving
  // averages, as JSON text); empty when it has none.
  std::string rule_state;
};

std::filesystem::path server_checkpoint_dir(const std::filesystem::path& run_dir, int64_t index);
std::filesystem::path server_checkpoint_path(const std::filesystem::path& run_dir, int64_t index,
                                             int64_t clock);

// Writes the checkpoint of `clock` and removes all but the newest `keep` of this server's.
// params (key_end − key_begin)
void write_server_checkpoint(const std::filesystem::path& run_dir, int64_t index, int64_t clock,
                             int64_t key_begin, int64_t key_end, const float* params,
                             Optimizer& optimizer, const std::map<int64_t, int64_t>& worker_clocks,
                             const std::string& config_hash, int keep = 3,
                             const std::string& rule_state = {});

// Reads and verifies (checksum, key range, sizes, config hash); throws naming the file and what
// is wrong.
ServerCheckpoint read_server_checkpoint(const std::filesystem::path& path, int64_t key_begin,
                                        int64_t key_end, const std::string& config_hash);

// The clocks this server has checkpoints for, ascending (names only; read_ verifies contents).
std::vector<int64_t> list_server_checkpoints(const std::filesystem::path& run_dir, int64_t index);

// Loads `c` into a server's state: params (key range) and the optimizer's buffers and step.
void restore_optimizer(const ServerCheckpoint& c, Optimizer& optimizer);

}  // namespace moetrain::ps
