// The GPU tools' check of a CUDA runtime call: a benchmark cannot go on after one fails, so it
// names the call and the error and exits with status 2.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                        \
  do {                                                               \
    cudaError_t e_ = (x);                                            \
    if (e_ != cudaSuccess) {                                         \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                  \
    }                                                                \
  } while (0)
