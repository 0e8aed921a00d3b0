// An Ops that forwards every call to a real backend and tells an observer about each op
// of work before and after it: the op-order tests record the sequence through it
// (tests/recording_ops.h), and --profile-ops times every op class with it
// (layers/op_profiler.h). The backends themselves know nothing of either.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/function_ref.h"
#include "layers/ops.h"

namespace fp8lm {

// What an op moves and computes, counted from its operands' shapes and dtypes in the
// backend's storage (Ops::element_bytes): bytes read plus bytes written, and FLOPs for
// the GEMMs and attention (a causal attention counts the half of Q K^T it computes; its
// backward counts 2.5 times the forward, as FlashAttention's papers count it).
struct OpCost {
  double flops = 0.0;
  double bytes = 0.0;
};

// An event refers to its callables (FunctionRef): it lives only for the call that reports it.
struct OpEvent {
  // The op's class in a profile ("gemm fp8 forward", "layernorm backward", ...), a string
  // literal; nullptr for calls that are not work (switches such as amax recording).
  const char* op_class = nullptr;
  Ops::Lane lane = Ops::Lane::main;
  // The op as the op-order tests log it ("gemm forward e4m3xe4m3 +bias"); built on request.
  FunctionRef<std::string()> describe;
  FunctionRef<OpCost()> cost;
};

class OpObserver {
 public:
  virtual ~OpObserver() = default;
  // Called once, by the ObservedOps that owns this observer: the backend it observes.
  virtual void attach(Ops& backend) { (void)backend; }
  virtual void before(const OpEvent& event) = 0;
  virtual void after(const OpEvent& event) { (void)event; }
};

// `inner` observed by `observer` (both owned).
std::unique_ptr<Ops> make_observed_ops(std::unique_ptr<Ops> inner, std::unique_ptr<OpObserver> observer);

}  // namespace fp8lm
