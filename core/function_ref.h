// A non-owning reference to a callable: what std::function_ref (C++26) will be. It never
// allocates, so a hot path can take a lambda without std::function's cost. The callable
// must outlive the reference (pass lambdas as arguments, never store the reference).
#pragma once

#include <type_traits>
#include <utility>

namespace fp8lm {

template <typename Signature>
class FunctionRef;

template <typename Result, typename... Args>
class FunctionRef<Result(Args...)> {
 public:
  template <typename Callable,
            typename = std::enable_if_t<!std::is_same_v<std::decay_t<Callable>, FunctionRef> &&
                                        std::is_invocable_r_v<Result, Callable&, Args...>>>
  FunctionRef(Callable&& callable)  // NOLINT(google-explicit-constructor): a lambda converts
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(callable)))),
        call_([](void* object, Args... args) -> Result {
          return (*static_cast<std::add_pointer_t<Callable>>(object))(std::forward<Args>(args)...);
        }) {}

  Result operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  Result (*call_)(void*, Args...);
};

}  // namespace fp8lm
