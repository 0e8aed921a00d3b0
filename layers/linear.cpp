#include "layers/linear.h"

#include <vector>

#include "core/error.h"

namespace fp8lm {

LinearFp8Operands register_linear_operands(ScalingTable& table, const std::string& name) {
  const Fp8Format format = table.config().format;
  LinearFp8Operands operands;
  operands.input = table.add(name + ".input", forward_dtype(format));
  operands.weight = table.add(name + ".weight", forward_dtype(format));
  operands.grad_output = table.add(name + ".grad_output", gradient_dtype(format));
  return operands;
}

namespace cpu {

namespace {

// A GEMM operand in the precision the tensor cores would see, plus the factor that
// undoes its scaling (scale_inv; 1 outside fp8).
struct PreparedOperand {
  std::vector<float> values;
  float scale_inv = 1.0f;
};

PreparedOperand prepare(const float* x, size_t n, const LinearPrecision& p, int fp8_state, bool record_amax) {
  PreparedOperand operand;
  operand.values.resize(n);
  switch (p.precision) {
    case GemmPrecision::fp32:
      std::copy(x, x + n, operand.values.begin());
      break;
    case GemmPrecision::bf16:
      round_bf16(operand.values.data(), x, n);
      break;
    case GemmPrecision::fp8: {
      FP8LM_CHECK(p.scaling != nullptr && fp8_state >= 0, "fp8 Linear without scaling state");
      ScalingTable& table = *p.scaling;
      const float tensor_amax = amax(x, n);
      const float scale = table.scale_for(fp8_state, tensor_amax);
      quantize_fp8(operand.values.data(), x, n, scale, table.dtype(fp8_state));
      operand.scale_inv = 1.0f / scale;
      if (record_amax && p.record_amax) table.record_amax(fp8_state, tensor_amax);
      break;
    }
  }
  return operand;
}

std::vector<float> transposed(const std::vector<float>& in, int rows, int cols) {
  std::vector<float> out(in.size());
  transpose(out.data(), in.data(), rows, cols);
  return out;
}

}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int M, int N, int K,
                    const LinearPrecision& p) {
  const PreparedOperand x = prepare(inp, size_t(M) * K, p, p.operands.input, true);
  const PreparedOperand w = prepare(weight, size_t(N) * K, p, p.operands.weight, true);
  gemm_nt(out, x.values.data(), w.values.data(), M, N, K, x.scale_inv * w.scale_inv, false);
  if (bias) {
    // BF16 epilogue on the GPU: the bias is added to the FP32 accumulator.
#pragma omp parallel for schedule(static)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) out[size_t(i) * N + j] += bias[j];
  }
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int M, int N, int K, const LinearPrecision& p) {
  const PreparedOperand dy = prepare(dout, size_t(M) * N, p, p.operands.grad_output, true);
  if (dinp) {
    // The weight's FP8 copy is the forward's: same scale, nothing new to record.
    const PreparedOperand w = prepare(weight, size_t(N) * K, p, p.operands.weight, false);
    const std::vector<float> w_t = transposed(w.values, N, K);  // [K,N]
    gemm_nt(dinp, dy.values.data(), w_t.data(), M, K, N, dy.scale_inv * w.scale_inv, false);
  }
  const PreparedOperand x = prepare(inp, size_t(M) * K, p, p.operands.input, false);
  const std::vector<float> dy_t = transposed(dy.values, M, N);  // [N,M]
  const std::vector<float> x_t = transposed(x.values, M, K);    // [K,M]
  gemm_nt(dweight, dy_t.data(), x_t.data(), N, K, M, dy.scale_inv * x.scale_inv, true);
  if (dbias) {
#pragma omp parallel for schedule(static)
    for (int j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < M; ++i) sum += dout[size_t(i) * N + j];
      dbias[j] += sum;
    }
  }
}

}  // namespace cpu
}  // namespace fp8lm
