// What every path's kernels (gemm_impl.inc, attention_impl.inc, vec_math.inc) use, included by each
// path's file before it opens its target region: the shared types, contracts and scalar maths.
#pragma once
#include <cstdint>
#include <cstring>

#include "../attention_types.h"
#include "../gemm_types.h"
#include "../isa_target.h"
#include "../numeric.h"
#include "../vector_math.h"
