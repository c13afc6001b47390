// `moetrain forward`: logits, loss and (with --backward) every parameter gradient of one
// sequence, written to a safetensors file under the parameters' own names — so anyone can check
// our numbers against another implementation.
#include <fmt/format.h>

#include <memory>
#include <vector>

#include "app/commands.h"
#include "core/check.h"
#include "core/parse.h"
#include "core/threads.h"
#include "data/tokenizer.h"
#include "io/safetensors.h"
#include "train/trainer.h"

namespace moetrain::app {

Run add_forward_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("forward",
                                 "Dump logits, loss and gradients of one sequence to safetensors");
  struct Args {
    std::string checkpoint, input, tokens, out;
    bool backward = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--checkpoint", args->checkpoint, "Checkpoint directory or run directory")
      ->required();
  auto* in = cmd->add_option("--input", args->input, "Text, encoded with the checkpoint's tokenizer (bytes where it has none)");
  auto* tk = cmd->add_option("--tokens", args->tokens, "Token ids, comma or space separated");
  in->excludes(tk);
  cmd->add_option("--out", args->out, "Output .safetensors file")->required();
  cmd->add_flag("--backward", args->backward, "Also write every parameter's gradient of the loss");
  return [args] {
    init_threads();
    LoadedModel m = load_model(args->checkpoint);
    const ModelConfig& cfg = m.config.model;
    std::vector<int32_t> tokens;
    if (!args->tokens.empty()) {
      for (const std::string& w : split_list(args->tokens, /*spaces=*/true)) {
        const std::optional<int64_t> v = parse_whole(w);
        MOETRAIN_CHECK(v, "--tokens: '{}' is not an integer", w);
        MOETRAIN_CHECK(*v >= 0 && *v < cfg.vocab_size,
                       "--tokens: id {} is outside the vocabulary [0, {})", *v, cfg.vocab_size);
        tokens.push_back(static_cast<int32_t>(*v));
      }
    } else {
      MOETRAIN_CHECK(!args->input.empty(), "forward: give --input TEXT or --tokens IDS");
      tokens = m.tokenizer.encode_prompt(args->input);
    }
    const int64_t T = static_cast<int64_t>(tokens.size());
    MOETRAIN_CHECK(
        T >= 2, "forward: need at least 2 tokens (the loss predicts each next token), got {}", T);
    MOETRAIN_CHECK(T <= cfg.max_seq_len, "forward: {} tokens exceed model.max_seq_len = {}", T,
                   cfg.max_seq_len);
    std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
    targets.push_back(-1);
    MoeStep step;
    step.training = false;
    LossParts parts = m.model->forward(m.params.data(), tokens.data(), targets.data(), 1, T, step);
    std::vector<float> grads;
    SafetensorsWriter w;
    w.add("tokens", SafetensorsDType::I32, {T}, tokens.data());
    w.add("logits", SafetensorsDType::F32, {T, cfg.vocab_size}, m.model->logits());
    float loss = static_cast<float>(parts.total), ce = static_cast<float>(parts.ce);
    float aux = static_cast<float>(parts.aux), z = static_cast<float>(parts.z);
    w.add("loss", SafetensorsDType::F32, {}, &loss);
    w.add("loss_ce", SafetensorsDType::F32, {}, &ce);
    w.add("loss_aux", SafetensorsDType::F32, {}, &aux);
    w.add("loss_z", SafetensorsDType::F32, {}, &z);
    if (args->backward) {
      grads.assign(m.params.size(), 0.0f);
      m.model->backward(m.params.data(), grads.data(), 1.0f);
      for (const auto& p : m.model->layout().params())
        w.add(p.name, SafetensorsDType::F32, p.shape, grads.data() + p.offset);
    }
    w.set_metadata("loss",
                   "cross-entropy (mean over next-token targets) + aux_coef*aux + z_coef*z");
    w.set_metadata("gradients",
                   args->backward ? "d loss / d parameter, under each parameter's name" : "none");
    w.write(args->out);
    fmt::print("loss {:.6f} (cross-entropy {:.6f}, aux {:.6f}, z {:.6f}) over {} tokens -> {}\n",
               parts.total, parts.ce, parts.aux, parts.z, T, args->out);
    return 0;
  };
}

}  // namespace moetrain::app
