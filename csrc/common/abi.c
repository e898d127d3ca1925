/* The sizes of the structs the CPU ops' entry points take, for their Python declarations (see
 * [Note: CPU ops without C++] in zero/ops/native.py): tests/test_ops_builder.py compares each with
 * ctypes' size of its Python twin, so a field added on one side only is caught there. Every CPU op
 * links this file, like common/simd.c. */
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
