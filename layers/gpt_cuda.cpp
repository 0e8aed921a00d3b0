#include "layers/gpt_cuda.h"

#include <algorithm>
#include <cstring>

#include "core/cast.h"
#include "core/cuda_check.h"
#include "core/current_scaling.h"
#include "core/dtype.h"
#include "core/error.h"
#include "layers/attention.h"
#include "layers/cross_entropy.h"
#include "layers/encoder.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"

namespace fp8lm::cuda {

using bf16 = __nv_bfloat16;

// One Linear: where its weight and bias sit in the parameter slabs, its shape
// (out_features N, in_features K), its FP8 scaling states and its FP8 weight copies.
struct GptModel::Linear {
  std::string name;
  size_t weight_offset = 0;
  size_t bias_offset = 0;
  int N = 0, K = 0;
  LinearFp8Operands states;
  size_t w8_offset = 0;   // E4M3 W   [N,K] in the FP8 weight slab
  size_t w8t_offset = 0;  // E4M3 W^T [K,N]
};

// Views of one block's saved activations. FP8 mode keeps FP8 copies of the GEMM inputs
// (ln1_8, atty8, ln2_8, gelu8); BF16 mode keeps BF16 ones (ln1, ln2, gelu).
struct GptModel::BlockActivations {
  bf16* resid_in = nullptr;   // [BT,C]
  bf16* qkv = nullptr;        // [BT,3C]
  bf16* atty = nullptr;       // [BT,C]
  bf16* resid_mid = nullptr;  // [BT,C]
  bf16* fch = nullptr;        // [BT,F] pre-activation, bias included
  bf16* resid_out = nullptr;  // [BT,C]
  bf16* ln1 = nullptr;        // [BT,C]  (bf16 mode)
  bf16* ln2 = nullptr;        // [BT,C]  (bf16 mode)
  bf16* gelu = nullptr;       // [BT,F]  (bf16 mode)
  uint8_t* ln1_8 = nullptr;   // [BT,C]  (fp8 mode)
  uint8_t* atty8 = nullptr;   // [BT,C]  (fp8 mode)
  uint8_t* ln2_8 = nullptr;   // [BT,C]  (fp8 mode)
  uint8_t* gelu8 = nullptr;   // [BT,F]  (fp8 mode)
  float* ln1_mean = nullptr;  // [BT]
  float* ln1_rstd = nullptr;
  float* ln2_mean = nullptr;
  float* ln2_rstd = nullptr;
  float* lse = nullptr;       // [B,NH,T]
};

// Every view into the activation and gradient slabs.
struct GptModel::Carved {
  bf16* encoded = nullptr;  // [BT,C]: block 0's residual input
  std::vector<BlockActivations> blocks;
  bf16* lnf = nullptr;       // [BT,C]
  float* lnf_mean = nullptr;
  float* lnf_rstd = nullptr;
  bf16* logits = nullptr;    // [BT,Vp]; dlogits in place after the loss
  float* losses = nullptr;   // [BT]
  // Backward scratch, reused by every block.
  bf16* dresid = nullptr;    // [BT,C] gradient of the residual stream
  bf16* dln = nullptr;       // [BT,C] gradient into a LayerNorm output
  bf16* datty = nullptr;     // [BT,C]
  bf16* dqkv = nullptr;      // [BT,3C]
  bf16* dgelu = nullptr;     // [BT,F] gradient of the GELU output
  bf16* staging = nullptr;   // [BT,max(F,3C)] BF16 tensors about to be quantized (current scaling) / dpre (bf16)
  uint8_t* dy8 = nullptr;    // [BT,max(F,3C)] output gradient in FP8
  uint8_t* dy8t = nullptr;   // [max(F,3C),BT] its transpose
  uint8_t* xt8 = nullptr;    // [max(F,C),BT] transposed FP8 GEMM input for wgrad
};

namespace {

// Hands out consecutive, 256-byte aligned pieces of a slab. Run once with a null base
// to size the slab, then again over the allocation.
template <typename T>
class Carver {
 public:
  explicit Carver(T* base) : base_(base) {}
  T* take(size_t count) {
    constexpr size_t kAlign = 256 / sizeof(T);
    offset_ = (offset_ + kAlign - 1) / kAlign * kAlign;
    T* view = base_ ? base_ + offset_ : nullptr;
    offset_ += count;
    return view;
  }
  size_t size() const { return offset_ + 256; }

 private:
  T* base_;
  size_t offset_ = 0;
};

std::string mib(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / 1048576.0);
  return text;
}

}  // namespace

GptModel::GptModel(const GptConfig& config, int batch_size, int seq_length, const GptPrecision& precision,
                   cudaStream_t stream)
    : config_(config),
      B_(batch_size),
      T_(seq_length),
      precision_(precision),
      fp8_(precision.gemm == GemmPrecision::fp8),
      current_scaling_(true),  // until the delayed recipe's first scale update
      stream_(stream),
      layout_(make_gpt_layout(config)),
      scaling_table_(precision.fp8) {
  if (precision.gemm == GemmPrecision::fp32)
    throw InputError("--fp32 is a CPU reference mode; the GPU trains in --bf16 or FP8",
                     "drop --fp32, or pass --device cpu");
  if (precision.fp8_lm_head)
    throw InputError("--fp8-lm-head is not implemented on the GPU yet (the LM head runs in BF16 there)",
                     "drop --fp8-lm-head, or pass --device cpu");
  if (config.n_embd > kLayerNormMaxC)
    throw InputError("n_embd " + std::to_string(config.n_embd) + " exceeds the GPU LayerNorm limit " +
                     std::to_string(kLayerNormMaxC));

  // ---- Linears, their scaling states and FP8 weight copies.
  size_t fp8_bytes = 0;
  static const char* kNames[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
  for (int l = 0; l < config.n_layer; ++l) {
    for (const char* name : kNames) {
      Linear linear;
      linear.name = "h." + std::to_string(l) + "." + name;
      const TensorInfo* weight = layout_.find(linear.name + ".weight");
      linear.weight_offset = weight->offset;
      linear.bias_offset = layout_.find(linear.name + ".bias")->offset;
      linear.N = static_cast<int>(weight->shape[0]);
      linear.K = static_cast<int>(weight->shape[1]);
      if (fp8_) {
        linear.states = register_linear_operands(scaling_table_, linear.name);
        linear.w8_offset = fp8_bytes;
        fp8_bytes += (weight->numel + 255) / 256 * 256;
        linear.w8t_offset = fp8_bytes;
        fp8_bytes += (weight->numel + 255) / 256 * 256;
      }
      linears_.push_back(linear);
    }
  }

  auto layernorm_at = [&](const std::string& prefix) {
    return LayerNormOffsets{layout_.find(prefix + ".weight")->offset, layout_.find(prefix + ".bias")->offset};
  };
  for (int l = 0; l < config.n_layer; ++l) {
    ln1_.push_back(layernorm_at("h." + std::to_string(l) + ".ln_1"));
    ln2_.push_back(layernorm_at("h." + std::to_string(l) + ".ln_2"));
  }
  ln_f_ = layernorm_at("ln_f");
  wte_offset_ = layout_.find("wte.weight")->offset;
  wpe_offset_ = layout_.find("wpe.weight")->offset;

  // ---- Parameter-class slabs.
  master_.allocate(layout_.total_elements());
  params_bf16_.allocate(layout_.total_elements());
  grads_.allocate(layout_.total_elements());
  fp8_weights_.allocate(fp8_bytes);
  master_.fill_bytes(0);
  params_bf16_.fill_bytes(0);
  grads_.fill_bytes(0);

  // ---- Scaling table on the device (the host table holds names and dtypes).
  const int S = scaling_table_.size();
  const int L = precision.fp8.amax_history_len;
  history_.allocate(std::max<size_t>(1, size_t(S) * L));
  scale_.allocate(std::max(1, S));
  scale_inv_.allocate(std::max(1, S));
  format_max_.allocate(std::max(1, S));
  history_.fill_bytes(0);
  std::vector<float> ones(std::max(1, S), 1.0f), maxima(std::max(1, S), 1.0f);
  for (int s = 0; s < S; ++s) maxima[s] = fp8_max(scaling_table_.dtype(s));
  scale_.upload(ones);
  scale_inv_.upload(ones);
  format_max_.upload(maxima);
  amax_sink_.allocate(1);
  tensor_amax_.allocate(1);
  loss_sum_.allocate(1);
  eval_loss_sum_.allocate(1);
  loss_sum_.fill_bytes(0);
  eval_loss_sum_.fill_bytes(0);

  allocate_activations();

  // ---- Token staging.
  const size_t BT = size_t(B_) * T_;
  tokens_.allocate(5 * BT + 1);
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&staging_), kStagingSlots * (5 * BT + 1) * sizeof(int32_t),
                           cudaHostAllocDefault));
  for (cudaEvent_t& event : staging_done_) CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  CUDA_CHECK(cudaDeviceSynchronize());
}

GptModel::~GptModel() {
  for (cudaEvent_t event : staging_done_)
    if (event) cudaEventDestroy(event);
  if (staging_) cudaFreeHost(staging_);
}

void GptModel::allocate_activations() {
  const size_t BT = size_t(B_) * T_, C = config_.n_embd, F = config_.n_inner, NH = config_.n_head;
  const size_t Vp = config_.padded_vocab_size(), L = config_.n_layer;
  const size_t widest = std::max(F, 3 * C);

  auto carve = [&](bf16* bf16_base, uint8_t* fp8_base, float* f32_base, Carved& v) {
    Carver<bf16> h(bf16_base);
    Carver<uint8_t> q(fp8_base);
    Carver<float> f(f32_base);
    v.encoded = h.take(BT * C);
    v.blocks.assign(L, BlockActivations{});
    for (size_t l = 0; l < L; ++l) {
      BlockActivations& a = v.blocks[l];
      a.resid_in = l == 0 ? v.encoded : v.blocks[l - 1].resid_out;
      a.qkv = h.take(BT * 3 * C);
      a.atty = h.take(BT * C);
      a.resid_mid = h.take(BT * C);
      a.fch = h.take(BT * F);
      a.resid_out = h.take(BT * C);
      if (fp8_) {
        a.ln1_8 = q.take(BT * C);
        a.atty8 = q.take(BT * C);
        a.ln2_8 = q.take(BT * C);
        a.gelu8 = q.take(BT * F);
      } else {
        a.ln1 = h.take(BT * C);
        a.ln2 = h.take(BT * C);
        a.gelu = h.take(BT * F);
      }
      a.ln1_mean = f.take(BT);
      a.ln1_rstd = f.take(BT);
      a.ln2_mean = f.take(BT);
      a.ln2_rstd = f.take(BT);
      a.lse = f.take(NH * BT);
    }
    v.lnf = h.take(BT * C);
    v.lnf_mean = f.take(BT);
    v.lnf_rstd = f.take(BT);
    v.logits = h.take(BT * Vp);
    v.losses = f.take(BT);
    v.dresid = h.take(BT * C);
    v.dln = h.take(BT * C);
    v.datty = h.take(BT * C);
    v.dqkv = h.take(BT * 3 * C);
    v.dgelu = h.take(BT * F);
    v.staging = h.take(BT * widest);
    if (fp8_) {
      v.dy8 = q.take(BT * widest);
      v.dy8t = q.take(BT * widest);
      v.xt8 = q.take(BT * std::max(F, C));
    }
    return std::make_tuple(h.size(), q.size(), f.size());
  };

  Carved sizing;
  const auto [bf16_count, fp8_count, f32_count] = carve(nullptr, nullptr, nullptr, sizing);
  act_bf16_.allocate(bf16_count);
  act_fp8_.allocate(fp8_count);
  act_f32_.allocate(f32_count);
  carved_ = std::make_unique<Carved>();
  carve(act_bf16_.data(), act_fp8_.data(), act_f32_.data(), *carved_);

  size_t scratch = layernorm_backward_scratch_floats(int(BT), int(C));
  scratch = std::max(scratch, gelu_backward_scratch_floats(int(BT), int(F)));
  scratch = std::max(scratch, attention_backward_scratch_floats(B_, T_, int(C), int(NH)));
  scratch = std::max(scratch, dbias_scratch_floats(int(BT), int(widest)));
  scratch = std::max(scratch, dbias_scratch_floats(int(std::max(C, F)), int(std::max(C, F))));  // weight casts
  scratch_.allocate(scratch);
}

GptModel::BlockActivations GptModel::block(int layer) { return carved_->blocks[layer]; }

// ---------------------------------------------------------------------------------------
// Parameters

void GptModel::set_parameters(const std::vector<float>& host_master) {
  FP8LM_CHECK(host_master.size() == layout_.total_elements());
  master_.upload(host_master);
  std::vector<uint16_t> copy(host_master.size());
  for (size_t i = 0; i < copy.size(); ++i) copy[i] = bf16_from_float(host_master[i]);
  CUDA_CHECK(cudaMemcpy(params_bf16_.data(), copy.data(), copy.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  refresh_fp8_weights();
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<float> GptModel::parameters() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return master_.download();
}

void GptModel::mark_scales_initialized() {
  if (precision_.fp8.recipe == ScalingRecipe::delayed) current_scaling_ = false;
}

void GptModel::refresh_fp8_weights() {
  if (!fp8_) return;
  const Fp8Dtype dtype = forward_dtype(precision_.fp8.format);
  for (const Linear& linear : linears_) {
    const int s = linear.states.weight;
    const float* weight = master_.data() + linear.weight_offset;
    uint8_t* w8 = fp8_weights_.data() + linear.w8_offset;
    uint8_t* w8t = fp8_weights_.data() + linear.w8t_offset;
    if (current_scaling_) {
      CUDA_CHECK(cudaMemsetAsync(tensor_amax_.data(), 0, sizeof(float), stream_));
      amax_of(tensor_amax_.data(), weight, size_t(linear.N) * linear.K, stream_);
      current_scale_and_record(scale_.data() + s, scale_inv_.data() + s, amax_slot(s), tensor_amax_.data(),
                               fp8_max(dtype), precision_.fp8.margin, stream_);
      cast_transpose_fp8(w8, w8t, nullptr, sink(), weight, scale_.data() + s, dtype, linear.N, linear.K,
                         scratch_.data(), stream_);
    } else {
      cast_transpose_fp8(w8, w8t, nullptr, amax_slot(s), weight, scale_.data() + s, dtype, linear.N, linear.K,
                         scratch_.data(), stream_);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Steps

void GptModel::zero_gradients_and_loss() {
  grads_.fill_bytes(0, stream_);
  loss_sum_.fill_bytes(0, stream_);
}

void GptModel::upload_tokens(const int32_t* inputs, const int32_t* targets) {
  const size_t BT = size_t(B_) * T_;
  const size_t slot_ints = 5 * BT + 1;
  const int slot = staging_next_;
  staging_next_ = (staging_next_ + 1) % kStagingSlots;
  // Waits only if the GPU has not yet copied this slot's previous contents, i.e. the host
  // is kStagingSlots micro-batches ahead: flow control, not a per-step sync.
  CUDA_CHECK(cudaEventSynchronize(staging_done_[slot]));
  int32_t* host = staging_ + slot * slot_ints;
  std::memcpy(host, inputs, BT * sizeof(int32_t));
  std::memcpy(host + BT, targets, BT * sizeof(int32_t));
  build_encoder_backward_index(inputs, B_, T_, encoder_index_);
  num_unique_tokens_ = encoder_index_.num_unique();
  std::memcpy(host + 2 * BT, encoder_index_.unique_tokens.data(), num_unique_tokens_ * sizeof(int32_t));
  std::memcpy(host + 3 * BT, encoder_index_.offsets.data(), (num_unique_tokens_ + 1) * sizeof(int32_t));
  std::memcpy(host + 4 * BT + 1, encoder_index_.positions.data(), BT * sizeof(int32_t));
  tokens_.upload(host, slot_ints, 0, stream_);
  CUDA_CHECK(cudaEventRecord(staging_done_[slot], stream_));
}

void GptModel::forward_backward(const int32_t* inputs, const int32_t* targets, float dloss) {
  upload_tokens(inputs, targets);
  forward(/*training=*/true);
  const size_t BT = size_t(B_) * T_;
  cross_entropy_forward_backward(carved_->logits, carved_->losses, tokens_.data() + BT, int(BT), config_.vocab_size,
                                 config_.padded_vocab_size(), dloss, stream_);
  sum_losses(loss_sum_.data(), carved_->losses, int(BT), stream_);
  backward();
}

void GptModel::forward_eval(const int32_t* inputs, const int32_t* targets) {
  upload_tokens(inputs, targets);
  forward(/*training=*/false);
  const size_t BT = size_t(B_) * T_;
  cross_entropy_forward_backward(carved_->logits, carved_->losses, tokens_.data() + BT, int(BT), config_.vocab_size,
                                 config_.padded_vocab_size(), 0.0f, stream_);
  sum_losses(eval_loss_sum_.data(), carved_->losses, int(BT), stream_);
}

// Quantizes a BF16 tensor [M,N] with current scaling: its own amax sets the state's
// scale (and is recorded when training), then one cast writes the FP8 copy, its
// transpose (out_t) and the column sums (dbias) as requested.
void GptModel::quantize(uint8_t* out, uint8_t* out_t, float* dbias, int state, const bf16* in, int M, int N,
                        bool record) {
  const Fp8Dtype dtype = scaling_table_.dtype(state);
  CUDA_CHECK(cudaMemsetAsync(tensor_amax_.data(), 0, sizeof(float), stream_));
  amax_of(tensor_amax_.data(), in, size_t(M) * N, stream_);
  current_scale_and_record(scale_.data() + state, scale_inv_.data() + state, record ? amax_slot(state) : nullptr,
                           tensor_amax_.data(), fp8_max(dtype), precision_.fp8.margin, stream_);
  if (out_t || dbias) {
    cast_transpose_fp8(out, out_t, dbias, sink(), in, scale_.data() + state, dtype, M, N, scratch_.data(), stream_);
  } else {
    cast_fp8(out, sink(), in, scale_.data() + state, dtype, size_t(M) * N, stream_);
  }
}

// One Linear GEMM. `which`: 0 forward, 1 dgrad, 2 wgrad; A/B/D as core/gemm_cuda.h.
void GptModel::gemm(const Linear& linear, int which, void* D, GemmType d_type, const void* A, const void* B,
                    const void* C, float beta, const void* bias, int M, int N, int K, bool a_transposed,
                    bool b_transposed) {
  GemmDesc desc;
  desc.M = M;
  desc.N = N;
  desc.K = K;
  desc.d_type = d_type;
  desc.a_transposed = a_transposed;
  desc.b_transposed = b_transposed;
  GemmArgs args;
  args.D = D;
  args.A = A;
  args.B = B;
  args.C = C;
  args.beta = beta;
  args.bias = bias;
  if (fp8_ && linear.N > 0) {
    const Fp8Format format = precision_.fp8.format;
    const LinearFp8Operands& s = linear.states;
    // forward: input x weight; dgrad: grad x weight^T; wgrad: grad^T x input^T.
    const int a_state = which == 0 ? s.input : s.grad_output;
    const int b_state = which == 0 || which == 1 ? s.weight : s.input;
    desc.a_type = gemm_type(which == 0 ? forward_dtype(format) : gradient_dtype(format));
    desc.b_type = gemm_type(forward_dtype(format));
    args.a_scale_inv = scale_inv_.data() + a_state;
    args.b_scale_inv = scale_inv_.data() + b_state;
    desc.fast_accum = which == 0;  // Transformer Engine: fast accumulation in forward only
  } else {
    desc.a_type = GemmType::bf16;
    desc.b_type = GemmType::bf16;
  }
  gemm_engine_.gemm(desc, args, stream_);
}

void GptModel::forward(bool training) {
  const int B = B_, T = T_, C = config_.n_embd, F = config_.n_inner, NH = config_.n_head;
  const int BT = B * T, Vp = config_.padded_vocab_size();
  const float eps = config_.layer_norm_epsilon;
  const bf16* P = params_bf16_.data();
  Carved& v = *carved_;
  const Fp8Dtype fwd = forward_dtype(precision_.fp8.format);
  auto slot = [&](int state) { return training ? amax_slot(state) : sink(); };

  encoder_forward(v.encoded, tokens_.data(), P + wte_offset_, P + wpe_offset_, B, T, C, stream_);
  for (int l = 0; l < config_.n_layer; ++l) {
    const BlockActivations a = block(l);
    const Linear* lin = &linears_[size_t(l) * 4];
    const bf16* ln1_w = P + ln1_[l].weight;
    const bf16* ln1_b = P + ln1_[l].bias;
    const bf16* ln2_w = P + ln2_[l].weight;
    const bf16* ln2_b = P + ln2_[l].bias;
    if (fp8_) {
      const uint8_t* W = fp8_weights_.data();
      // ln_1 -> FP8 input of c_attn
      if (current_scaling_) {
        layernorm_forward_bf16(v.staging, a.ln1_mean, a.ln1_rstd, a.resid_in, ln1_w, ln1_b, BT, C, eps, stream_);
        quantize(a.ln1_8, nullptr, nullptr, lin[0].states.input, v.staging, BT, C, training);
      } else {
        const int s = lin[0].states.input;
        layernorm_forward_fp8(a.ln1_8, slot(s), scale_.data() + s, fwd, a.ln1_mean, a.ln1_rstd, a.resid_in, ln1_w,
                              ln1_b, BT, C, eps, stream_);
      }
      gemm(lin[0], 0, a.qkv, GemmType::bf16, a.ln1_8, W + lin[0].w8_offset, nullptr, 0.0f, P + lin[0].bias_offset,
           BT, 3 * C, C, false, false);
      // attention -> BF16 output (for backward) and the FP8 input of attn.c_proj
      if (current_scaling_) {
        attention_forward(a.atty, a.lse, nullptr, nullptr, nullptr, fwd, a.qkv, B, T, C, NH, stream_);
        quantize(a.atty8, nullptr, nullptr, lin[1].states.input, a.atty, BT, C, training);
      } else {
        const int s = lin[1].states.input;
        attention_forward(a.atty, a.lse, a.atty8, slot(s), scale_.data() + s, fwd, a.qkv, B, T, C, NH, stream_);
      }
      // residual_mid = residual_in + attn.c_proj(atty): the residual add rides on the GEMM's C.
      gemm(lin[1], 0, a.resid_mid, GemmType::bf16, a.atty8, W + lin[1].w8_offset, a.resid_in, 1.0f,
           P + lin[1].bias_offset, BT, C, C, false, false);
      if (current_scaling_) {
        layernorm_forward_bf16(v.staging, a.ln2_mean, a.ln2_rstd, a.resid_mid, ln2_w, ln2_b, BT, C, eps, stream_);
        quantize(a.ln2_8, nullptr, nullptr, lin[2].states.input, v.staging, BT, C, training);
      } else {
        const int s = lin[2].states.input;
        layernorm_forward_fp8(a.ln2_8, slot(s), scale_.data() + s, fwd, a.ln2_mean, a.ln2_rstd, a.resid_mid, ln2_w,
                              ln2_b, BT, C, eps, stream_);
      }
      // c_fc without bias: the bias joins the GELU kernel, which also casts to FP8.
      gemm(lin[2], 0, a.fch, GemmType::bf16, a.ln2_8, W + lin[2].w8_offset, nullptr, 0.0f, nullptr, BT, F, C, false,
           false);
      if (current_scaling_) {
        bias_gelu_forward_bf16(v.staging, a.fch, P + lin[2].bias_offset, BT, F, stream_);
        quantize(a.gelu8, nullptr, nullptr, lin[3].states.input, v.staging, BT, F, training);
      } else {
        const int s = lin[3].states.input;
        bias_gelu_forward_fp8(a.gelu8, slot(s), scale_.data() + s, fwd, a.fch, P + lin[2].bias_offset, BT, F,
                              stream_);
      }
      gemm(lin[3], 0, a.resid_out, GemmType::bf16, a.gelu8, W + lin[3].w8_offset, a.resid_mid, 1.0f,
           P + lin[3].bias_offset, BT, C, F, false, false);
    } else {
      layernorm_forward_bf16(a.ln1, a.ln1_mean, a.ln1_rstd, a.resid_in, ln1_w, ln1_b, BT, C, eps, stream_);
      gemm(lin[0], 0, a.qkv, GemmType::bf16, a.ln1, P + lin[0].weight_offset, nullptr, 0.0f, P + lin[0].bias_offset,
           BT, 3 * C, C, false, false);
      attention_forward(a.atty, a.lse, nullptr, nullptr, nullptr, fwd, a.qkv, B, T, C, NH, stream_);
      gemm(lin[1], 0, a.resid_mid, GemmType::bf16, a.atty, P + lin[1].weight_offset, a.resid_in, 1.0f,
           P + lin[1].bias_offset, BT, C, C, false, false);
      layernorm_forward_bf16(a.ln2, a.ln2_mean, a.ln2_rstd, a.resid_mid, ln2_w, ln2_b, BT, C, eps, stream_);
      gemm(lin[2], 0, a.fch, GemmType::bf16, a.ln2, P + lin[2].weight_offset, nullptr, 0.0f, nullptr, BT, F, C, false,
           false);
      bias_gelu_forward_bf16(a.gelu, a.fch, P + lin[2].bias_offset, BT, F, stream_);
      gemm(lin[3], 0, a.resid_out, GemmType::bf16, a.gelu, P + lin[3].weight_offset, a.resid_mid, 1.0f,
           P + lin[3].bias_offset, BT, C, F, false, false);
    }
  }
  const BlockActivations last = block(config_.n_layer - 1);
  layernorm_forward_bf16(v.lnf, v.lnf_mean, v.lnf_rstd, last.resid_out, P + ln_f_.weight, P + ln_f_.bias, BT,
                         C, eps, stream_);
  // The tied LM head stays in BF16 (as Megatron's output layer does).
  const Linear lm_head;
  gemm(lm_head, 0, v.logits, GemmType::bf16, v.lnf, P + wte_offset_, nullptr, 0.0f, nullptr, BT, Vp, C, false,
       false);
}

void GptModel::backward() {
  const int B = B_, T = T_, C = config_.n_embd, F = config_.n_inner, NH = config_.n_head;
  const int BT = B * T, Vp = config_.padded_vocab_size();
  const bf16* P = params_bf16_.data();
  float* G = grads_.data();
  Carved& v = *carved_;
  float* scratch = scratch_.data();
  const uint8_t* W = fp8_weights_.data();

  // LM head (BF16): dlnf = dlogits . wte ; dwte += dlogits^T . lnf
  const Linear lm_head;
  gemm(lm_head, 1, v.dln, GemmType::bf16, v.logits, P + wte_offset_, nullptr, 0.0f, nullptr, BT, C, Vp,
       false, true);
  gemm(lm_head, 2, G + wte_offset_, GemmType::fp32, v.logits, v.lnf, G + wte_offset_, 1.0f, nullptr,
       Vp, C, BT, true, true);
  CUDA_CHECK(cudaMemsetAsync(v.dresid, 0, size_t(BT) * C * sizeof(bf16), stream_));
  layernorm_backward(v.dresid, G + ln_f_.weight, G + ln_f_.bias, v.dln,
                     block(config_.n_layer - 1).resid_out, P + ln_f_.weight, v.lnf_mean, v.lnf_rstd, BT, C,
                     scratch, stream_);

  // Output gradient of a Linear into FP8 (both layouts) with its bias gradient fused.
  auto quantize_grad = [&](const Linear& linear, const bf16* dy, int M, int N) {
    const int s = linear.states.grad_output;
    if (current_scaling_) {
      quantize(v.dy8, v.dy8t, G + linear.bias_offset, s, dy, M, N, true);
    } else {
      cast_transpose_fp8(v.dy8, v.dy8t, G + linear.bias_offset, amax_slot(s), dy, scale_.data() + s,
                         scaling_table_.dtype(s), M, N, scratch, stream_);
    }
  };
  // dgrad and wgrad of an FP8 Linear whose output gradient is in v.dy8 / v.dy8t and
  // whose forward input (FP8, [BT,K]) is x8.
  auto fp8_linear_backward = [&](const Linear& linear, bf16* dinp, const uint8_t* x8) {
    gemm(linear, 1, dinp, GemmType::bf16, v.dy8, W + linear.w8t_offset, nullptr, 0.0f, nullptr, BT, linear.K,
         linear.N, false, false);
    transpose_fp8(v.xt8, x8, BT, linear.K, stream_);
    gemm(linear, 2, G + linear.weight_offset, GemmType::fp32, v.dy8t, v.xt8, G + linear.weight_offset, 1.0f, nullptr,
         linear.N, linear.K, BT, false, false);
  };
  auto bf16_linear_backward = [&](const Linear& linear, bf16* dinp, const bf16* dy, const bf16* x) {
    gemm(linear, 1, dinp, GemmType::bf16, dy, P + linear.weight_offset, nullptr, 0.0f, nullptr, BT, linear.K, linear.N,
         false, true);
    gemm(linear, 2, G + linear.weight_offset, GemmType::fp32, dy, x, G + linear.weight_offset, 1.0f, nullptr, linear.N,
         linear.K, BT, true, true);
    column_sum(G + linear.bias_offset, dy, BT, linear.N, scratch, stream_);
  };

  for (int l = config_.n_layer - 1; l >= 0; --l) {
    const BlockActivations a = block(l);
    const Linear* lin = &linears_[size_t(l) * 4];
    if (fp8_) {
      // mlp.c_proj: its output gradient is the residual gradient.
      quantize_grad(lin[3], v.dresid, BT, C);
      fp8_linear_backward(lin[3], v.dgelu, a.gelu8);
      // GELU backward, fused with the FP8 cast (both layouts) and c_fc's bias gradient.
      {
        const int s = lin[2].states.grad_output;
        if (current_scaling_) {
          gelu_backward_dbias_bf16(v.staging, G + lin[2].bias_offset, v.dgelu, a.fch, BT, F, scratch, stream_);
          quantize(v.dy8, v.dy8t, nullptr, s, v.staging, BT, F, true);
        } else {
          gelu_backward_cast_transpose_dbias_fp8(v.dy8, v.dy8t, G + lin[2].bias_offset, amax_slot(s),
                                                 scale_.data() + s, scaling_table_.dtype(s), v.dgelu, a.fch, BT, F,
                                                 scratch, stream_);
        }
      }
      fp8_linear_backward(lin[2], v.dln, a.ln2_8);
      layernorm_backward(v.dresid, G + ln2_[l].weight, G + ln2_[l].bias, v.dln, a.resid_mid,
                         P + ln2_[l].weight, a.ln2_mean, a.ln2_rstd, BT, C, scratch, stream_);
      quantize_grad(lin[1], v.dresid, BT, C);
      fp8_linear_backward(lin[1], v.datty, a.atty8);
      attention_backward(v.dqkv, v.datty, a.qkv, a.atty, a.lse, B, T, C, NH, scratch, stream_);
      quantize_grad(lin[0], v.dqkv, BT, 3 * C);
      fp8_linear_backward(lin[0], v.dln, a.ln1_8);
    } else {
      bf16_linear_backward(lin[3], v.dgelu, v.dresid, a.gelu);
      gelu_backward_dbias_bf16(v.staging, G + lin[2].bias_offset, v.dgelu, a.fch, BT, F, scratch, stream_);
      // c_fc: dgrad and wgrad from the BF16 pre-activation gradient (bias already done).
      gemm(lin[2], 1, v.dln, GemmType::bf16, v.staging, P + lin[2].weight_offset, nullptr, 0.0f, nullptr, BT, C, F,
           false, true);
      gemm(lin[2], 2, G + lin[2].weight_offset, GemmType::fp32, v.staging, a.ln2, G + lin[2].weight_offset, 1.0f,
           nullptr, F, C, BT, true, true);
      layernorm_backward(v.dresid, G + ln2_[l].weight, G + ln2_[l].bias, v.dln, a.resid_mid,
                         P + ln2_[l].weight, a.ln2_mean, a.ln2_rstd, BT, C, scratch, stream_);
      bf16_linear_backward(lin[1], v.datty, v.dresid, a.atty);
      attention_backward(v.dqkv, v.datty, a.qkv, a.atty, a.lse, B, T, C, NH, scratch, stream_);
      bf16_linear_backward(lin[0], v.dln, v.dqkv, a.ln1);
    }
    layernorm_backward(v.dresid, G + ln1_[l].weight, G + ln1_[l].bias, v.dln, a.resid_in,
                       P + ln1_[l].weight, a.ln1_mean, a.ln1_rstd, BT, C, scratch, stream_);
  }
  const size_t BTs = size_t(BT);
  encoder_backward(G + wte_offset_, G + wpe_offset_, v.dresid, tokens_.data() + 2 * BTs,
                   tokens_.data() + 3 * BTs, tokens_.data() + 4 * BTs + 1, num_unique_tokens_, B, T, C, stream_);
}

// ---------------------------------------------------------------------------------------

size_t GptModel::total_bytes() const {
  return master_.bytes() + params_bf16_.bytes() + grads_.bytes() + fp8_weights_.bytes() + history_.bytes() +
         act_bf16_.bytes() + act_fp8_.bytes() + act_f32_.bytes() + scratch_.bytes() + tokens_.bytes() +
         GemmEngine::kWorkspaceBytes;
}

SettingsTable GptModel::memory_table() const {
  return {
      {"parameters: FP32 master", mib(master_.bytes())},
      {"parameters: BF16 working copy", mib(params_bf16_.bytes())},
      {"parameters: FP8 weights (W and W^T)", mib(fp8_weights_.bytes())},
      {"gradients: FP32", mib(grads_.bytes())},
      {"activations (BF16 + FP8 + FP32)", mib(act_bf16_.bytes() + act_fp8_.bytes() + act_f32_.bytes())},
      {"scaling table (history, scales)", mib(history_.bytes() + scale_.bytes() * 3)},
      {"scratch + GEMM workspace", mib(scratch_.bytes() + GemmEngine::kWorkspaceBytes)},
  };
}

}  // namespace fp8lm::cuda
