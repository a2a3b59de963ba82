// Torch wrapper of the FP8 KV-cache write (K rounded query-aware when a query is given): validates the inputs
// (errors name the op and the bad value), runs the framework-free launcher from fp8_kv_cache_write.cu on the
// current stream. Compiled by the host C++ compiler (docs/kernels.md, "File convention").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

void fp8_kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, const std::optional<at::Tensor>& query) {
  constexpr const char* op = "fp8_kv_cache_write";
  const InDtype in_dt = in_dtype_of(op, "key", key);
  CUBLADE_CHECK_VALUE(value.scalar_type() == key.scalar_type(), op, "value dtype ", dt(value.scalar_type()),
                      " differs from key dtype ", dt(key.scalar_type()));
  CUBLADE_CHECK_VALUE(key.dim() == 3, op, "key must be [num_tokens, num_heads, head_size], got shape ",
                      shape(key.sizes()));
  CUBLADE_CHECK_VALUE(value.sizes() == key.sizes(), op, "value shape ", shape(value.sizes()), " differs from key shape ",
                      shape(key.sizes()));
  for (const at::Tensor* c : {&key_cache, &value_cache}) {
    CUBLADE_CHECK_NOT_IMPLEMENTED(c->scalar_type() == at::kFloat8_e4m3fn || c->scalar_type() == at::kByte, op,
                                  "caches must be float8_e4m3fn or uint8 (E4M3 bytes), got ", dt(c->scalar_type()));
    CUBLADE_CHECK_VALUE(c->dim() == 4 && c->size(2) == key.size(1) && c->size(3) == key.size(2), op,
                        "caches must be [num_blocks, block_size, ", num(key.size(1)), ", ", num(key.size(2)),
                        "] for key of shape ", shape(key.sizes()), ", got ", shape(c->sizes()));
    CUBLADE_CHECK_VALUE(c->device() == key.device(), op, "caches must be on ", dev(key.device()), ", got ",
                        dev(c->device()));
  }
  CUBLADE_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), op, "value_cache shape ", shape(value_cache.sizes()),
                      " differs from key_cache shape ", shape(key_cache.sizes()));
  CUBLADE_CHECK_VALUE(value_cache.strides() == key_cache.strides(), op, "value_cache strides ",
                      shape(value_cache.strides()), " differ from key_cache strides ", shape(key_cache.strides()));
  CUBLADE_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, op,
                      "slot_mapping must be 1-D int64, got ", dt(slot_mapping.scalar_type()), " of shape ",
                      shape(slot_mapping.sizes()));
  // vLLM pads key/value but not slot_mapping: the slots count the tokens.
  CUBLADE_CHECK_VALUE(slot_mapping.size(0) <= key.size(0), op, "slot_mapping has ", num(slot_mapping.size(0)),
                      " entries but key has only ", num(key.size(0)), " tokens");
  CUBLADE_CHECK_VALUE(slot_mapping.device() == key.device(), op, "slot_mapping must be on ", dev(key.device()),
                      ", got ", dev(slot_mapping.device()));
  check_scale_tensor(op, "k_scale", k_scale, key);
  check_scale_tensor(op, "v_scale", v_scale, key);
  // Query-aware K rounding: the token's queries [>= slots, num_heads, head_size], num_heads = R * key's heads.
  int64_t R = 0;
  if (query.has_value()) {
    const at::Tensor& q = *query;
    const int64_t H = key.size(1);
    CUBLADE_CHECK_VALUE(q.dim() == 3 && q.size(0) >= slot_mapping.size(0) && q.size(2) == key.size(2) &&
                            (H == 0 || (q.size(1) >= H && q.size(1) % H == 0)),
                        op, "query must be [num_tokens >= ", num(slot_mapping.size(0)), ", a multiple of ", num(H),
                        " heads, ", num(key.size(2)), "] for key of shape ", shape(key.sizes()), ", got ",
                        shape(q.sizes()));
    R = H == 0 ? 1 : q.size(1) / H;  // no heads: nothing to write
    CUBLADE_CHECK_NOT_IMPLEMENTED(R <= kKvQueryAwareMaxR, op, "query-aware K rounding takes at most ",
                                  num(kKvQueryAwareMaxR), " query heads per KV head, got ", num(q.size(1)), " / ",
                                  num(H), " = ", num(R));
    CUBLADE_CHECK_NOT_IMPLEMENTED(key.size(2) <= kKvQueryAwareMaxD, op, "query-aware K rounding takes head_size <= ",
                                  num(kKvQueryAwareMaxD), ", got ", num(key.size(2)));
    CUBLADE_CHECK_VALUE(q.scalar_type() == key.scalar_type() || q.scalar_type() == at::kFloat8_e4m3fn, op,
                        "query dtype must be key's (", dt(key.scalar_type()), ") or float8_e4m3fn, got ",
                        dt(q.scalar_type()));
    CUBLADE_CHECK_VALUE(q.device() == key.device(), op, "query must be on ", dev(key.device()), ", got ",
                        dev(q.device()));
  }
  check_arch(op, key);
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor slots = slot_mapping.contiguous();
  Fp8KvCacheWriteArgs a;
  a.key = key.data_ptr(); a.value = value.data_ptr(); a.dtype = in_dt;
  a.T = slots.size(0); a.H = key.size(1); a.D = key.size(2);
  a.k_ts = key.stride(0); a.k_hs = key.stride(1); a.k_ds = key.stride(2);
  a.v_ts = value.stride(0); a.v_hs = value.stride(1); a.v_ds = value.stride(2);
  a.key_cache = static_cast<uint8_t*>(key_cache.data_ptr());
  a.value_cache = static_cast<uint8_t*>(value_cache.data_ptr());
  a.num_blocks = key_cache.size(0); a.block_size = key_cache.size(1);
  a.c_bs = key_cache.stride(0); a.c_ps = key_cache.stride(1); a.c_hs = key_cache.stride(2);
  a.c_ds = key_cache.stride(3);
  a.slots = slots.data_ptr<int64_t>(); a.k_scale = k_scale.data_ptr<float>(); a.v_scale = v_scale.data_ptr<float>();
  if (query.has_value()) {
    const at::Tensor& q = *query;
    a.query = q.data_ptr(); a.q_fp8 = q.scalar_type() == at::kFloat8_e4m3fn; a.R = R;
    a.q_ts = q.stride(0); a.q_hs = q.stride(1); a.q_ds = q.stride(2);
  }
  check_launch(op, launch_fp8_kv_cache_write(a, current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_kv_cache_write", &fp8_kv_cache_write); }

}  // namespace cublade
