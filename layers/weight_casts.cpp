#include <cstddef>
#include <vector>

#include "core/error.h"
#include "core/scaling.h"
#include "layers/ops.h"

namespace fp8lm {

void check_weight_casts(const TensorLayout& layout, const std::vector<WeightOperand>& operands) {
  std::vector<bool> seen(layout.tensors().size(), false);
  for (const WeightOperand& w : operands) {
    FP8LM_CHECK(w.tensor >= 0 && size_t(w.tensor) < layout.tensors().size(), "AdamW weight cast: tensor ", w.tensor,
                " is not in the optimizer's layout of ", layout.tensors().size());
    const TensorInfo& info = layout.tensors()[size_t(w.tensor)];
    FP8LM_CHECK(!seen[size_t(w.tensor)], "AdamW weight cast: ", info.name, " is cast twice");
    seen[size_t(w.tensor)] = true;
    FP8LM_CHECK(is_fp8(w.operand.dtype) && w.operand.scaling_state >= 0 &&
                    w.operand.block_scaling == BlockScaling::none,
                "AdamW weight cast: the operand of ", info.name, " is not a delayed-scaling FP8 operand");
    FP8LM_CHECK(w.operand.data != nullptr && w.operand.numel() == int64_t(info.numel), "AdamW weight cast: the operand of ",
                info.name, " is [", w.operand.rows, ",", w.operand.cols, "], the tensor has ", info.numel, " elements");
  }
}

}  // namespace fp8lm
