// Load balancing: the Switch/GShard auxiliary loss, the variance loss, the router z-loss and the
// aux-loss-free bias update of DeepSeek-V3.
//
//   L_aux = E · Σ_i f_i · P_i,  f_i = (top-K selections of expert i, before dropping or
//                               rerouting: what the router asked for) / (N·K),
//                               P_i = mean over tokens of the router probability of expert i.
//           f is piecewise constant, so the gradient flows through P only.
//   L_var = Var_i(Î_i) + Var_i(L̂_i)   (model.balance_loss = variance)
//           the design's "variance of importance + variance of load", with importance
//           I_i = Σ_t p_ti (the probabilities summed over the batch) and load_i = I_i / N (their
//           mean), each divided by its value under perfect balance: Î_i = I_i / (N/E) = E·P_i,
//           L̂_i = load_i / (1/E) = E·P_i; Var_i is the population variance over the E experts.
//           Undivided, Var(I) + Var(load) = (N² + 1)·Var(P) would grow with the batch, and the
//           weight that balances one batch size would swamp the next. Divided, L_var =
//           2·E²·Var_i(P_i) is 0 at perfect balance, independent of N, and, as the probabilities
//           of a softmax router sum to 1 (mean share 1/E), each term is the squared coefficient of
//           variation of Shazeer et al.'s importance loss: at most E − 1 per term when one expert
//           takes everything, the range of the Switch loss (1..E), so one aux_loss_coef suits both.
//           ∂L_var/∂P_i = 4·E·(P_i − mean_j P_j), ∂P_i/∂p_ti = 1/N.
//   L_z   = mean over tokens of logsumexp(clean logits)²
//   b_i  += γ · sign(mean_load − load_i)   once per optimizer step, outside autograd
// Both losses are 0 when no process has tokens.
//
// The forwards are taken over the tokens of every process of `stats` (null: this process only,
// as with a local communicator): per-process sums in fixed blocks of 256 tokens (independent of
// the thread count), then summed over the processes in rank order. A run split over processes
// thus gets the losses of the one-process run over all its tokens. The backwards take the local
// token count N: with the loss weight 1/processes and equal shares of tokens, that is each
// process's share of the gradient of the global mean.
#pragma once
#include <cstdint>

namespace moetrain {

class Comm;

// f (E) = selection fractions over every process; returns L_aux. probs (N, E), selected (N, S)
// with -1 for none.
double aux_loss_forward(float* f, const float* probs, const int32_t* selected, int64_t N, int64_t E,
                        int64_t S, int64_t K, Comm* stats = nullptr);
// dprobs (N, E) = scale · ∂L_aux/∂probs = scale · E · f_i / N. f (E)
void aux_loss_backward(float* dprobs, const float* f, int64_t N, int64_t E, float scale);

// dLdP (E) = ∂L_var/∂P_i over every process; returns L_var. probs (N, E)
double variance_loss_forward(float* dLdP, const float* probs, int64_t N, int64_t E,
                             Comm* stats = nullptr);
// dprobs (N, E) = scale · ∂L_var/∂probs = scale · dLdP_i / N. dLdP (E)
void variance_loss_backward(float* dprobs, const float* dLdP, int64_t N, int64_t E, float scale);

// Returns L_z over every process. lse (N)
double z_loss_forward(const float* lse, int64_t N, Comm* stats = nullptr);
// dlogits (N, E) = scale · ∂L_z/∂logits = scale · 2 · lse_t · softmax(logits)_t,e / N.
// logits (N, E), lse (N)
void z_loss_backward(float* dlogits, const float* logits, const float* lse, int64_t N, int64_t E,
                     float scale);

// bias (E) += rate · sign(mean(load) − load_i), sign(0) = 0. load (E)
void bias_update(float* bias, const int64_t* load, int64_t E, float rate);

}  // namespace moetrain
