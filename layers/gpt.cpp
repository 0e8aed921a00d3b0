#include "layers/gpt.h"

#include <cmath>

#include "core/error.h"
#include "core/random.h"
#include "layers/attention.h"
#include "layers/cross_entropy.h"
#include "layers/encoder.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"
#include "layers/residual.h"

namespace fp8lm {

TensorLayout make_gpt_layout(const GptConfig& cfg) {
  const int64_t C = cfg.n_embd, F = cfg.n_inner;
  TensorLayout layout;
  layout.add("wte.weight", {cfg.padded_vocab_size(), C}, true);
  layout.add("wpe.weight", {cfg.n_positions, C}, true);
  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    layout.add(h + "ln_1.weight", {C}, false);
    layout.add(h + "ln_1.bias", {C}, false);
    layout.add(h + "attn.c_attn.weight", {3 * C, C}, true);
    layout.add(h + "attn.c_attn.bias", {3 * C}, false);
    layout.add(h + "attn.c_proj.weight", {C, C}, true);
    layout.add(h + "attn.c_proj.bias", {C}, false);
    layout.add(h + "ln_2.weight", {C}, false);
    layout.add(h + "ln_2.bias", {C}, false);
    layout.add(h + "mlp.c_fc.weight", {F, C}, true);
    layout.add(h + "mlp.c_fc.bias", {F}, false);
    layout.add(h + "mlp.c_proj.weight", {C, F}, true);
    layout.add(h + "mlp.c_proj.bias", {C}, false);
  }
  layout.add("ln_f.weight", {C}, false);
  layout.add("ln_f.bias", {C}, false);
  return layout;
}

void init_gpt_parameters(float* params, const TensorLayout& layout, const GptConfig& cfg, uint64_t seed) {
  const double residual_std = 0.02 / std::sqrt(2.0 * cfg.n_layer);
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // Each chunk of a tensor draws from its own stream, keyed by (seed, tensor, chunk), so
  // a 1.5B-parameter model initialises in parallel and identically for any thread count.
  constexpr size_t kChunk = 1 << 16;
  const auto& tensors = layout.tensors();
  for (size_t index = 0; index < tensors.size(); ++index) {
    const TensorInfo& t = tensors[index];
    float* p = params + t.offset;
    if (ends_with(t.name, ".bias")) {
      std::fill(p, p + t.numel, 0.0f);
      continue;
    }
    if (t.shape.size() == 1) {  // LayerNorm gains
      std::fill(p, p + t.numel, 1.0f);
      continue;
    }
    const double std_dev = ends_with(t.name, "c_proj.weight") ? residual_std : 0.02;
    // Padded vocabulary rows stay 0: they never see a token.
    const size_t filled = t.name == "wte.weight" ? size_t(cfg.vocab_size) * cfg.n_embd : t.numel;
    const size_t chunks = (t.numel + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
    for (size_t chunk = 0; chunk < chunks; ++chunk) {
      Random random(seed * 0x9E3779B97F4A7C15ull + index * 0xD1B54A32D192ED03ull + chunk);
      random.next_u64();  // decorrelate neighbouring keys
      const size_t end = std::min(t.numel, (chunk + 1) * kChunk);
      for (size_t i = chunk * kChunk; i < end; ++i) p[i] = i < filled ? static_cast<float>(random.normal() * std_dev) : 0.0f;
    }
  }
}

namespace cpu {

// Views of one block's parameters (or gradients: same offsets in the other slab).
struct GptModel::BlockTensors {
  float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attproj_w, *attproj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
};

// Views of one block's saved forward activations; residual_in is the block's input.
struct GptModel::BlockActivations {
  float* residual_in;   // [B,T,C]
  float* ln1;           // [B,T,C]
  float* ln1_mean;      // [B,T]
  float* ln1_rstd;      // [B,T]
  float* qkv;           // [B,T,3C]
  float* atty;          // [B,T,C]   attention output (heads concatenated)
  float* lse;           // [B,NH,T]  softmax log-sum-exp per query row
  float* attproj;       // [B,T,C]
  float* residual_mid;  // [B,T,C]   residual_in + attproj
  float* ln2;           // [B,T,C]
  float* ln2_mean;      // [B,T]
  float* ln2_rstd;      // [B,T]
  float* fch;           // [B,T,F]   pre-GELU
  float* fch_gelu;      // [B,T,F]
  float* fcproj;        // [B,T,C]
  float* residual_out;  // [B,T,C]   residual_mid + fcproj
};

namespace {

size_t per_block_floats(const GptConfig& c, size_t BT) {
  const size_t C = c.n_embd, F = c.n_inner, NH = c.n_head;
  return BT * C /*ln1*/ + 2 * BT + BT * 3 * C + BT * C /*atty*/ + NH * BT /*lse*/ + BT * C /*attproj*/ +
         BT * C /*mid*/ + BT * C /*ln2*/ + 2 * BT + 2 * BT * F + BT * C /*fcproj*/ + BT * C /*out*/;
}


}  // namespace

GptModel::GptModel(const GptConfig& config, int batch_size, int seq_length, const GptPrecision& precision)
    : config_(config), B_(batch_size), T_(seq_length), precision_(precision), layout_(make_gpt_layout(config)),
      scaling_(precision.fp8) {
  FP8LM_CHECK(seq_length <= config.n_positions);
  params_.assign(layout_.total_elements(), 0.0f);
  grads_.assign(layout_.total_elements(), 0.0f);
  const size_t BT = size_t(B_) * T_, C = config.n_embd;
  const size_t Vp = config.padded_vocab_size();
  activations_.assign(BT * C + config.n_layer * per_block_floats(config, BT) + BT * C + 2 * BT + BT * Vp + BT, 0.0f);
  const size_t F = config.n_inner;
  grad_activations_.assign(BT * C /*dresidual*/ + BT * F /*dgelu out / dfch*/ + BT * F + BT * 3 * C + BT * C /*datty*/ +
                               BT * C /*dln*/,
                           0.0f);

  const bool fp8 = precision.gemm == GemmPrecision::fp8;
  static const char* kLinearNames[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
  for (int l = 0; l < config.n_layer; ++l) {
    for (const char* name : kLinearNames) {
      LinearPrecision lp;
      lp.precision = precision.gemm;
      if (fp8) {
        lp.scaling = &scaling_;
        lp.operands = register_linear_operands(scaling_, "h." + std::to_string(l) + "." + name);
      }
      block_linears_.push_back(lp);
    }
  }
  lm_head_.precision = precision.lm_head();
  if (lm_head_.precision == GemmPrecision::fp8) {
    lm_head_.scaling = &scaling_;
    lm_head_.operands = register_linear_operands(scaling_, "lm_head");
  }
}

GptModel::BlockTensors GptModel::block_tensors(float* slab, int l) const {
  const std::string h = "h." + std::to_string(l) + ".";
  auto at = [&](const char* suffix) { return slab + layout_.find(h + suffix)->offset; };
  return {at("ln_1.weight"), at("ln_1.bias"),    at("attn.c_attn.weight"), at("attn.c_attn.bias"),
          at("attn.c_proj.weight"), at("attn.c_proj.bias"), at("ln_2.weight"), at("ln_2.bias"),
          at("mlp.c_fc.weight"), at("mlp.c_fc.bias"), at("mlp.c_proj.weight"), at("mlp.c_proj.bias")};
}

GptModel::BlockActivations GptModel::block_activations(int l) {
  const size_t BT = size_t(B_) * T_, C = config_.n_embd, F = config_.n_inner, NH = config_.n_head;
  float* encoded = activations_.data();
  float* base = encoded + BT * C + l * per_block_floats(config_, BT);
  BlockActivations a;
  a.residual_in = l == 0 ? encoded : block_activations(l - 1).residual_out;
  float* p = base;
  auto take = [&](size_t n) {
    float* view = p;
    p += n;
    return view;
  };
  a.ln1 = take(BT * C);
  a.ln1_mean = take(BT);
  a.ln1_rstd = take(BT);
  a.qkv = take(BT * 3 * C);
  a.atty = take(BT * C);
  a.lse = take(NH * BT);
  a.attproj = take(BT * C);
  a.residual_mid = take(BT * C);
  a.ln2 = take(BT * C);
  a.ln2_mean = take(BT);
  a.ln2_rstd = take(BT);
  a.fch = take(BT * F);
  a.fch_gelu = take(BT * F);
  a.fcproj = take(BT * C);
  a.residual_out = take(BT * C);
  return a;
}

const float* GptModel::losses() const {
  const size_t BT = size_t(B_) * T_;
  return activations_.data() + activations_.size() - BT;
}

void GptModel::zero_gradients() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void GptModel::set_amax_recording(bool record) {
  for (LinearPrecision& lp : block_linears_) lp.record_amax = record;
  lm_head_.record_amax = record;
}

float GptModel::evaluate(const int32_t* inputs, const int32_t* targets) {
  set_amax_recording(false);
  const float loss = run_forward(inputs, targets, 0.0f);
  set_amax_recording(true);
  return loss;
}

float GptModel::forward_backward(const int32_t* inputs, const int32_t* targets, float dloss) {
  const float loss = run_forward(inputs, targets, dloss);
  if (dloss != 0.0f) run_backward(inputs);
  return loss;
}

float GptModel::run_forward(const int32_t* inputs, const int32_t* targets, float dloss) {
  const int B = B_, T = T_, C = config_.n_embd, F = config_.n_inner, NH = config_.n_head, L = config_.n_layer;
  const int V = config_.vocab_size, Vp = config_.padded_vocab_size();
  const int BT = B * T;
  for (int i = 0; i < BT; ++i) {
    FP8LM_INPUT_CHECK(inputs[i] >= 0 && inputs[i] < V, "input token ", inputs[i], " is outside the vocabulary [0, ", V, ")");
    FP8LM_INPUT_CHECK(targets[i] >= 0 && targets[i] < V, "target token ", targets[i], " is outside the vocabulary [0, ", V, ")");
  }
  float* P = params_.data();
  const float* wte = P + layout_.find("wte.weight")->offset;
  const float* wpe = P + layout_.find("wpe.weight")->offset;

  // Residual stream, LayerNorm, attention and GELU are BF16 on the GPU; FP32 here.
  encoder_forward(activations_.data(), inputs, wte, wpe, B, T, C);
  for (int l = 0; l < L; ++l) {
    const BlockTensors w = block_tensors(P, l);
    const BlockActivations a = block_activations(l);
    const LinearPrecision* lin = &block_linears_[size_t(l) * 4];
    layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.residual_in, w.ln1_w, w.ln1_b, BT, C, config_.layer_norm_epsilon);
    linear_forward(a.qkv, a.ln1, w.qkv_w, w.qkv_b, BT, 3 * C, C, lin[0]);
    attention_forward(a.atty, a.lse, a.qkv, B, T, C, NH);
    linear_forward(a.attproj, a.atty, w.attproj_w, w.attproj_b, BT, C, C, lin[1]);
    residual_forward(a.residual_mid, a.residual_in, a.attproj, size_t(BT) * C);
    layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual_mid, w.ln2_w, w.ln2_b, BT, C, config_.layer_norm_epsilon);
    linear_forward(a.fch, a.ln2, w.fc_w, w.fc_b, BT, F, C, lin[2]);
    gelu_forward(a.fch_gelu, a.fch, size_t(BT) * F);
    linear_forward(a.fcproj, a.fch_gelu, w.fcproj_w, w.fcproj_b, BT, C, F, lin[3]);
    residual_forward(a.residual_out, a.residual_mid, a.fcproj, size_t(BT) * C);
  }
  float* final_residual = block_activations(L - 1).residual_out;
  float* lnf = activations_.data() + size_t(BT) * C + size_t(L) * per_block_floats(config_, BT);
  float* lnf_mean = lnf + size_t(BT) * C;
  float* lnf_rstd = lnf_mean + BT;
  float* logits = lnf_rstd + BT;
  float* losses = logits + size_t(BT) * Vp;
  layernorm_forward(lnf, lnf_mean, lnf_rstd, final_residual, P + layout_.find("ln_f.weight")->offset,
                    P + layout_.find("ln_f.bias")->offset, BT, C, config_.layer_norm_epsilon);
  linear_forward(logits, lnf, wte, nullptr, BT, Vp, C, lm_head_);
  // Overwrites logits with dlogits when dloss != 0 (the GPU does this in place too).
  cross_entropy_forward_backward(logits, losses, targets, BT, V, Vp, dloss);
  double sum = 0.0;
  for (int i = 0; i < BT; ++i) sum += losses[i];
  return static_cast<float>(sum / BT);
}

void GptModel::run_backward(const int32_t* inputs) {
  const int B = B_, T = T_, C = config_.n_embd, F = config_.n_inner, NH = config_.n_head, L = config_.n_layer;
  const int Vp = config_.padded_vocab_size();
  const int BT = B * T;
  float* P = params_.data();
  float* G = grads_.data();
  float* lnf = activations_.data() + size_t(BT) * C + size_t(L) * per_block_floats(config_, BT);
  float* lnf_mean = lnf + size_t(BT) * C;
  float* lnf_rstd = lnf_mean + BT;
  float* dlogits = lnf_rstd + BT;

  float* dresidual = grad_activations_.data();  // [BT,C] gradient of the residual stream
  float* dfch_gelu = dresidual + size_t(BT) * C;  // [BT,F]
  float* dfch = dfch_gelu + size_t(BT) * F;       // [BT,F]
  float* dqkv = dfch + size_t(BT) * F;            // [BT,3C]
  float* datty = dqkv + size_t(BT) * 3 * C;       // [BT,C]
  float* dln = datty + size_t(BT) * C;            // [BT,C] gradient into a LayerNorm output

  const size_t wte_offset = layout_.find("wte.weight")->offset;
  linear_backward(dln, G + wte_offset, nullptr, dlogits, lnf, P + wte_offset, BT, Vp, C, lm_head_);
  std::fill(dresidual, dresidual + size_t(BT) * C, 0.0f);
  const BlockActivations last = block_activations(L - 1);
  layernorm_backward(dresidual, G + layout_.find("ln_f.weight")->offset, G + layout_.find("ln_f.bias")->offset, dln,
                     last.residual_out, P + layout_.find("ln_f.weight")->offset, lnf_mean, lnf_rstd, BT, C);

  for (int l = L - 1; l >= 0; --l) {
    const BlockTensors w = block_tensors(P, l);
    const BlockTensors g = block_tensors(G, l);
    const BlockActivations a = block_activations(l);
    const LinearPrecision* lin = &block_linears_[size_t(l) * 4];
    // residual_out = residual_mid + fcproj: dresidual flows to both unchanged.
    linear_backward(dfch_gelu, g.fcproj_w, g.fcproj_b, dresidual, a.fch_gelu, w.fcproj_w, BT, C, F, lin[3]);
    gelu_backward(dfch, a.fch, dfch_gelu, size_t(BT) * F);
    linear_backward(dln, g.fc_w, g.fc_b, dfch, a.ln2, w.fc_w, BT, F, C, lin[2]);
    layernorm_backward(dresidual, g.ln2_w, g.ln2_b, dln, a.residual_mid, w.ln2_w, a.ln2_mean, a.ln2_rstd, BT, C);
    // residual_mid = residual_in + attproj.
    linear_backward(datty, g.attproj_w, g.attproj_b, dresidual, a.atty, w.attproj_w, BT, C, C, lin[1]);
    attention_backward(dqkv, datty, a.qkv, a.atty, a.lse, B, T, C, NH);
    linear_backward(dln, g.qkv_w, g.qkv_b, dqkv, a.ln1, w.qkv_w, BT, 3 * C, C, lin[0]);
    layernorm_backward(dresidual, g.ln1_w, g.ln1_b, dln, a.residual_in, w.ln1_w, a.ln1_mean, a.ln1_rstd, BT, C);
  }
  encoder_backward(G + wte_offset, G + layout_.find("wpe.weight")->offset, dresidual, inputs, B, T, C);
}

}  // namespace cpu
}  // namespace fp8lm
