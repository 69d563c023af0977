// The CPU matrix product every linear layer on the host runs: y = x w^T, x float32 [m, k],
// w [n, k] float32 or bfloat16 read in place, y float32 or bfloat16 [m, n]. Batch-invariant by
// construction: every output is accumulated in one fixed order that depends only on k and the
// weights' type (16 partial sums, then one fixed reduction tree), never on m, on the other rows,
// on the tiling or on the thread split; and the AVX-512, AVX2 and portable code take the same
// steps (fused multiply-adds, the same tree), so a row's output is bit-identical alone, inside
// any batch and on any x86-64 CPU. With float32 weights partial sum l holds the products at
// k = l mod 16 in increasing k; with bfloat16 weights it holds, per block of 32 in increasing
// order, the product at 2l + 1 and then the one at 2l (a 64-byte load of weights widens into
// its odd and even halves with a mask and a shift; x is split to match once per call).
// Tiles of several rows times several columns reuse each loaded weight vector for every row of
// the tile, and the columns go in L2-sized panels that every row passes over, so a prefill reads
// each weight from memory once.
// Stateless and reentrant; the caller splits the columns over its threads (GemmColumns).
#pragma once

#include <cstdint>
#include <string_view>

namespace fmoe {

enum class GemmType : uint8_t { kFloat32, kBFloat16 };

struct GemmProblem {
  // [m, k], row stride ldx (elements); with bfloat16 weights unread when x_pairs is given.
  const float* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;  // [n, k], row stride ldw (elements), w_type
  GemmType w_type = GemmType::kFloat32;
  int64_t ldw = 0;
  void* y = nullptr;  // [m, n], row stride ldy (elements), y_type (bfloat16: round to nearest even)
  GemmType y_type = GemmType::kFloat32;
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  // Optional, for bfloat16 weights: x split in pairs by GemmSplitX, row stride GemmSplitLength(k).
  // Without it each call splits x itself; a caller that runs many products over one x (a column
  // split, an expert's chunks) splits it once and passes it to all.
  const float* x_pairs = nullptr;
};

// Computes the columns [n0, n1) of every row of y. Callers cover [0, n) once, in any split.
void GemmColumns(const GemmProblem& p, int64_t n0, int64_t n1);

// The columns of the kernel's widest tile: callers that split the columns over threads split on
// multiples of it (any split gives the same result; this one keeps every tile whole).
int64_t GemmColumnTile();

// x split in pairs for bfloat16 weights: row r of out (stride GemmSplitLength(k)) holds, per block
// of 32 along k, x[r]'s 16 odd elements and then its 16 even ones, the last block zero-padded.
// x float32, or bfloat16 (its bits, widened exactly on the way).
int64_t GemmSplitLength(int64_t k);
void GemmSplitX(const float* x, int64_t ldx, int64_t m, int64_t k, float* out);
void GemmSplitX(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, float* out);

// The code GemmColumns runs on this CPU: "avx512", "avx2" or "portable". FMOE_GEMM_ISA=avx2 or
// =portable in the environment picks a lower one (tests compare them; results are the same).
std::string_view GemmIsa();

// Whether this CPU runs the named code ("avx512": AVX-512 F, BW and VL; "avx2": AVX2 and FMA;
// "portable": always). The host's other kernels (cpu_attention.h) dispatch by it too.
bool CpuRunsIsa(std::string_view isa);

// As GemmColumns, on the named code ("avx512", "avx2" or "portable"); false, computing nothing,
// when this CPU does not run it. For tests and benchmarks that compare them.
bool GemmColumnsOn(std::string_view isa, const GemmProblem& p, int64_t n0, int64_t n1);

}  // namespace fmoe
