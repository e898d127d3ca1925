/* The layout of the structs the CPU ops' entry points take, for their Python declarations (see
 * [Note: CPU ops without C++] in zero/ops/native.py): tests/test_ops_builder.py compares every
 * size and field offset with ctypes' for the Python twin, so a field added, removed or moved on
 * one side only is caught there. Every CPU op links this file, like common/simd.c. */
#include <stddef.h>
#include <string.h>

#include "adam/adam_formats.h"
#include "adam/adam_math.h"
#include "sparse_attention/sparse_attention.h"

/* sizeof the struct named `name` ("adam_config", "adam_format", "sparse_problem"), 0 if unknown. */
size_t zero_abi_sizeof(const char *name) {
    if (name == NULL) return 0;
    if (strcmp(name, "adam_config") == 0) return sizeof(zero_adam_config);
    if (strcmp(name, "adam_format") == 0) return sizeof(zero_adam_format);
    if (strcmp(name, "sparse_problem") == 0) return sizeof(zero_sparse_attention_problem);
    return 0;
}

#define FIELD(S, F)                                     \
    if (strcmp(field, #F) == 0) return (long long)offsetof(S, F);

/* offsetof field `field` in the struct named `name` (as zero_abi_sizeof), -1 if either is unknown. */
long long zero_abi_offsetof(const char *name, const char *field) {
    if (name == NULL || field == NULL) return -1;
    if (strcmp(name, "adam_config") == 0) {
        FIELD(zero_adam_config, lr) FIELD(zero_adam_config, beta1) FIELD(zero_adam_config, beta2)
        FIELD(zero_adam_config, eps) FIELD(zero_adam_config, weight_decay) FIELD(zero_adam_config, grad_scale)
        FIELD(zero_adam_config, step) FIELD(zero_adam_config, adamw_mode) FIELD(zero_adam_config, bias_correction)
    } else if (strcmp(name, "adam_format") == 0) {
        FIELD(zero_adam_format, master_dtype) FIELD(zero_adam_format, state_dtype)
        FIELD(zero_adam_format, stochastic) FIELD(zero_adam_format, seed) FIELD(zero_adam_format, index)
    } else if (strcmp(name, "sparse_problem") == 0) {
        FIELD(zero_sparse_attention_problem, batch) FIELD(zero_sparse_attention_problem, heads)
        FIELD(zero_sparse_attention_problem, seq) FIELD(zero_sparse_attention_problem, head_dim)
        FIELD(zero_sparse_attention_problem, block) FIELD(zero_sparse_attention_problem, dtype)
        FIELD(zero_sparse_attention_problem, causal) FIELD(zero_sparse_attention_problem, scale)
        FIELD(zero_sparse_attention_problem, layout_heads) FIELD(zero_sparse_attention_problem, row_ptr)
        FIELD(zero_sparse_attention_problem, col_idx) FIELD(zero_sparse_attention_problem, col_ptr)
        FIELD(zero_sparse_attention_problem, row_idx) FIELD(zero_sparse_attention_problem, key_bias)
        FIELD(zero_sparse_attention_problem, attn_bias) FIELD(zero_sparse_attention_problem, attn_bias_len)
    }
    return -1;
}
