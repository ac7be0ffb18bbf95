// tests/models/test_llama_kernels.cpp: every kernel call of a real Llama training step (forward, loss,
// backward, gradient clipping, AdamW, zeroing) has a CUDA kernel rule in core/kernel_choice.h and none
// is naive: the step runs on the CPU under the call log, and each call's operands, as the kernel entry
// received them, are asked which kernel a GPU would run. A new op in the step without a rule fails here.
#include <map>
#include <string>

#include "autograd/functional.h"
#include "core/call_log.h"
#include "core/kernel_choice.h"
#include "models/llama.h"
#include "optim/optimizer.h"
#include "tests/check.h"

namespace shardlab {
namespace {

TEST_CASE("every kernel call of a Llama training step has a CUDA kernel rule, none naive",
          "[models][llama][dispatch]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), /*seed=*/3);
  optim::AdamW optimizer(model->named_parameters(), {.weight_decay = 0.1});
  const std::int64_t vocab = model->config.vocab_size;
  const Tensor tokens =
      (test::random_tensor({2, 24}, 4, DType::f64, 0.0, 1.0) * double(vocab - 1)).to(DType::i64);
  const Tensor padding = zeros({2, 24}, dtype(DType::boolean));
  call_log::start();
  const Variable logits = model(tokens, padding);
  const Variable loss = cross_entropy(reshape(logits, {-1, vocab}), tokens.reshape({-1}), -100);
  loss.backward();
  (void)optim::clip_grad_norm_(model->parameters(), 1.0);
  optimizer.step();
  optimizer.zero_grad();
  const std::vector<call_log::Call> calls = call_log::stop();

  std::map<std::string, int> per_op;
  for (const call_log::Call& call : calls) {
    ++per_op[call.op];
    INFO(call.op << " with " << call.operands.size() << " operands");
    KernelChoice choice;
    REQUIRE_NOTHROW(choice = cuda_kernel_choice(call.op, call.operands));
    INFO("takes " << choice.kernel);
    CHECK(!choice.naive);
  }
  // The step's fused kernels ran as such, not composed from smaller ops.
  for (const char* op :
       {"attention_forward", "attention_backward", "rms_norm", "add_rms_norm", "rms_norm_backward", "swiglu",
        "swiglu_backward", "rotary_embedding", "cross_entropy", "cross_entropy_backward", "embedding",
        "embedding_backward", "foreach_sum_squares", "adam_step"}) {
    INFO(op);
    CHECK(per_op[op] > 0);
  }
  CHECK(per_op["softmax"] == 0);
  // Each layer's second norm takes the residual add with it; the first and the final norm stand alone.
  const std::int64_t layers = model->config.num_hidden_layers;
  CHECK(per_op["add_rms_norm"] == layers);
  CHECK(per_op["rms_norm"] == layers + 1);
  CHECK(per_op["foreach_sum_squares"] == 1);  // one for all the gradients
  CHECK(per_op["adam_step"] == 1);            // one for all the parameters
}

TEST_CASE("an op without a CUDA kernel rule is named", "[models][dispatch]") {
  CHECK_THROWS_ERROR(cuda_kernel_choice("frobnicate", {}), "cuda_kernel_choice: no rule for op 'frobnicate'");
  CHECK_THROWS_ERROR(cuda_kernel_choice("matmul", {}), "cuda_kernel_choice: matmul needs 2 operands, got 0");
}

}  // namespace
}  // namespace shardlab
