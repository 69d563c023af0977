// The CPU matrix product: agreement with a double-precision product, bit-identical rows whatever
// the batch and the column split, the same bits from every instruction set this CPU runs, each
// weight type's documented accumulation order, and bfloat16 output rounded to nearest even.
#include "gpu_worker/kernels/cpu_gemm.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

namespace fmoe {
namespace {

uint16_t ToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

struct Case {
  int64_t m, n, k;
  GemmType w_type;
  std::vector<float> x;
  std::vector<float> w32;
  std::vector<uint16_t> w16;
  const void* w() const {
    return w_type == GemmType::kBFloat16 ? static_cast<const void*>(w16.data()) : w32.data();
  }
  float W(int64_t j, int64_t k2) const {
    return w_type == GemmType::kBFloat16 ? FromBf16(w16[j * k + k2]) : w32[j * k + k2];
  }
};

Case MakeCase(std::mt19937& rng, int64_t m, int64_t n, int64_t k, GemmType t) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Case c{m, n, k, t, {}, {}, {}};
  c.x.resize(m * k);
  for (float& v : c.x) v = d(rng);
  c.w32.resize(n * k);
  for (float& v : c.w32) v = d(rng) * 0.1f;
  if (t == GemmType::kBFloat16) {
    c.w16.resize(n * k);
    for (size_t i = 0; i < c.w32.size(); ++i) c.w16[i] = ToBf16(c.w32[i]);
  }
  return c;
}

// y for rows [r0, r0 + rows) of c.x, columns split at `split` (0 = none), on `isa` ("" = the
// active code).
std::vector<float> Multiply(const Case& c, const float* x, int64_t rows, int64_t split = 0,
                            std::string_view isa = "") {
  std::vector<float> y(rows * c.n, -1.0f);
  GemmProblem p;
  p.x = x;
  p.ldx = c.k;
  p.w = c.w();
  p.w_type = c.w_type;
  p.ldw = c.k;
  p.y = y.data();
  p.ldy = c.n;
  p.m = rows;
  p.n = c.n;
  p.k = c.k;
  const int64_t cut = split > 0 ? std::min(split, c.n) : c.n;
  if (isa.empty()) {
    GemmColumns(p, 0, cut);
    GemmColumns(p, cut, c.n);
  } else {
    EXPECT_TRUE(GemmColumnsOn(isa, p, 0, cut));
    EXPECT_TRUE(GemmColumnsOn(isa, p, cut, c.n));
  }
  return y;
}

// y[i][j] in double precision, and the sum of its products' magnitudes (the error's scale).
std::pair<double, double> DoubleProduct(const Case& c, int64_t i, int64_t j) {
  double ref = 0.0, mag = 0.0;
  for (int64_t l = 0; l < c.k; ++l) {
    ref += static_cast<double>(c.x[i * c.k + l]) * c.W(j, l);
    mag += std::abs(static_cast<double>(c.x[i * c.k + l]) * c.W(j, l));
  }
  return {ref, mag};
}

bool SameBits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, sizeof(float) * static_cast<size_t>(n)) == 0;
}

TEST(CpuGemmTest, AgreesWithADoubleProduct) {
  std::mt19937 rng(7);
  for (GemmType t : {GemmType::kFloat32, GemmType::kBFloat16}) {
    for (auto [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 1},
                                                                             {1, 7, 5},
                                                                             {3, 13, 16},
                                                                             {5, 6, 17},
                                                                             {9, 25, 64},
                                                                             {17, 31, 100},
                                                                             {64, 48, 257},
                                                                             {70, 19, 33}}) {
      const Case c = MakeCase(rng, m, n, k, t);
      const std::vector<float> y = Multiply(c, c.x.data(), m);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const auto [ref, mag] = DoubleProduct(c, i, j);
          ASSERT_NEAR(y[i * n + j], ref, 1e-5 * mag + 1e-6)
              << "m=" << m << " n=" << n << " k=" << k << " i=" << i << " j=" << j;
        }
      }
    }
  }
}

TEST(CpuGemmTest, ARowIsBitIdenticalAloneAndInAnyBatch) {
  std::mt19937 rng(11);
  for (GemmType t : {GemmType::kFloat32, GemmType::kBFloat16}) {
    for (int64_t k : {16, 40, 96, 1000}) {
      const int64_t rows = 64, n = 37;
      const Case c = MakeCase(rng, rows, n, k, t);
      const std::vector<float> all = Multiply(c, c.x.data(), rows);
      // Each row alone.
      for (int64_t i = 0; i < rows; ++i) {
        const std::vector<float> one = Multiply(c, c.x.data() + i * k, 1);
        ASSERT_TRUE(SameBits(one.data(), all.data() + i * n, n)) << "row " << i << " k=" << k;
      }
      // Inside batches of 2..64 starting anywhere, with columns split anywhere.
      std::uniform_int_distribution<int64_t> start(0, rows - 1), cut(0, n);
      for (int64_t b = 2; b <= rows; ++b) {
        const int64_t s = start(rng) % (rows - b + 1);
        const std::vector<float> part = Multiply(c, c.x.data() + s * k, b, cut(rng));
        ASSERT_TRUE(SameBits(part.data(), all.data() + s * n, b * n))
            << "batch " << b << " from row " << s << " k=" << k;
      }
    }
  }
}

TEST(CpuGemmTest, EveryInstructionSetGivesTheSameBits) {
  std::mt19937 rng(13);
  for (GemmType t : {GemmType::kFloat32, GemmType::kBFloat16}) {
    const Case c = MakeCase(rng, 23, 29, 203, t);
    const std::vector<float> portable = Multiply(c, c.x.data(), c.m, 0, "portable");
    for (std::string_view isa : {"avx2", "avx512"}) {
      GemmProblem probe;
      if (!GemmColumnsOn(isa, probe, 0, 0)) {
        std::printf("%.*s: not on this CPU\n", static_cast<int>(isa.size()), isa.data());
        continue;
      }
      const std::vector<float> y = Multiply(c, c.x.data(), c.m, 5, isa);
      EXPECT_TRUE(SameBits(y.data(), portable.data(), c.m * c.n)) << isa;
    }
  }
  std::printf("active: %.*s, column tile %ld\n", static_cast<int>(GemmIsa().size()),
              GemmIsa().data(), static_cast<long>(GemmColumnTile()));
}

// Batches of many rows with a long inner dimension (panels of a few columns, k not a multiple of
// 16; 300 x 4100 splits bfloat16's x per row tile rather than whole): every row has the bits it
// has alone, on every instruction set.
TEST(CpuGemmTest, LongInnerDimensionsKeepTheBits) {
  std::mt19937 rng(19);
  for (GemmType t : {GemmType::kFloat32, GemmType::kBFloat16}) {
    for (auto [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {70, 37, 4100}, {150, 15, 2061}, {17, 50, 6000}, {300, 9, 4100}}) {
      const Case c = MakeCase(rng, m, n, k, t);
      const std::vector<float> portable = Multiply(c, c.x.data(), m, 0, "portable");
      for (std::string_view isa : {"portable", "avx2", "avx512"}) {
        GemmProblem probe;
        if (!GemmColumnsOn(isa, probe, 0, 0)) continue;
        const std::vector<float> all = Multiply(c, c.x.data(), m, 11, isa);
        ASSERT_TRUE(SameBits(all.data(), portable.data(), m * n))
            << isa << " m=" << m << " k=" << k;
        for (int64_t i = 0; i < m; i += 7) {
          const std::vector<float> one = Multiply(c, c.x.data() + i * k, 1, 0, isa);
          ASSERT_TRUE(SameBits(one.data(), all.data() + i * n, n))
              << isa << " row " << i << " m=" << m << " k=" << k;
        }
      }
      // Against a double-precision product, a few outputs.
      for (int64_t i : {int64_t{0}, m - 1}) {
        for (int64_t j : {int64_t{0}, n - 1}) {
          const auto [ref, mag] = DoubleProduct(c, i, j);
          ASSERT_NEAR(portable[i * n + j], ref, 1e-5 * mag + 1e-6);
        }
      }
    }
  }
}

// y[i][j] in the order cpu_gemm.h documents for the weights' type, written out plainly: 16
// partial sums (float32 weights: k = l mod 16 in increasing k; bfloat16 weights: per block of 32,
// the product at 2l + 1 and then the one at 2l), the last block zero-padded, then the tree.
float DocumentedOrder(const Case& c, int64_t i, int64_t j) {
  float s[16] = {};
  auto x = [&](int64_t l) { return l < c.k ? c.x[i * c.k + l] : 0.0f; };
  auto w = [&](int64_t l) { return l < c.k ? c.W(j, l) : 0.0f; };
  if (c.w_type == GemmType::kFloat32) {
    for (int64_t b = 0; b < c.k; b += 16) {
      for (int l = 0; l < 16; ++l) s[l] = std::fma(x(b + l), w(b + l), s[l]);
    }
  } else {
    for (int64_t b = 0; b < c.k; b += 32) {
      for (int l = 0; l < 16; ++l) {
        s[l] = std::fma(x(b + 2 * l + 1), w(b + 2 * l + 1), s[l]);
        s[l] = std::fma(x(b + 2 * l), w(b + 2 * l), s[l]);
      }
    }
  }
  float t[8], u[4];
  for (int l = 0; l < 8; ++l) t[l] = s[l] + s[l + 8];
  for (int l = 0; l < 4; ++l) u[l] = t[l] + t[l + 4];
  return (u[0] + u[2]) + (u[1] + u[3]);
}

// Every instruction set computes each weight type's documented order, to the bit, for inner
// dimensions on both sides of the 16- and 32-element blocks.
TEST(CpuGemmTest, FollowsTheDocumentedOrder) {
  std::mt19937 rng(23);
  for (GemmType t : {GemmType::kFloat32, GemmType::kBFloat16}) {
    for (int64_t k : {1, 15, 16, 17, 31, 32, 33, 47, 64, 95, 200, 1001}) {
      const Case c = MakeCase(rng, 6, 13, k, t);
      for (std::string_view isa : {"portable", "avx2", "avx512"}) {
        GemmProblem probe;
        if (!GemmColumnsOn(isa, probe, 0, 0)) continue;
        const std::vector<float> y = Multiply(c, c.x.data(), c.m, 7, isa);
        for (int64_t i = 0; i < c.m; ++i) {
          for (int64_t j = 0; j < c.n; ++j) {
            const float ref = DocumentedOrder(c, i, j);
            ASSERT_TRUE(SameBits(&y[i * c.n + j], &ref, 1))
                << isa << (t == GemmType::kBFloat16 ? " bf16" : " f32") << " k=" << k << " i=" << i
                << " j=" << j << ": " << y[i * c.n + j] << " against " << ref;
          }
        }
      }
      if (t != GemmType::kBFloat16) continue;
      // x split once by the caller (GemmSplitX) gives the same bits, for any column split.
      std::vector<float> pairs(static_cast<size_t>(c.m * GemmSplitLength(k)), -1.0f);
      GemmSplitX(c.x.data(), k, c.m, k, pairs.data());
      std::vector<float> y(c.m * c.n, -1.0f);
      GemmProblem p;
      p.x = c.x.data();
      p.ldx = k;
      p.x_pairs = pairs.data();
      p.w = c.w();
      p.w_type = t;
      p.ldw = k;
      p.y = y.data();
      p.ldy = c.n;
      p.m = c.m;
      p.n = c.n;
      p.k = k;
      GemmColumns(p, 0, 4);
      GemmColumns(p, 4, c.n);
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          const float ref = DocumentedOrder(c, i, j);
          ASSERT_TRUE(SameBits(&y[i * c.n + j], &ref, 1)) << "x_pairs k=" << k << " i=" << i;
        }
      }
    }
  }
}

// bfloat16 x split directly gives the split of its float32 widening, padding included.
TEST(CpuGemmTest, BFloat16XSplitsAsItsFloat32Widening) {
  std::mt19937 rng(29);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (int64_t k : {1, 31, 32, 33, 100, 4096}) {
    const int64_t m = 3, ldx = k + 5, len = GemmSplitLength(k);
    std::vector<uint16_t> x16(m * ldx);
    for (uint16_t& v : x16) v = ToBf16(d(rng));
    std::vector<float> x32(m * ldx);
    for (size_t i = 0; i < x16.size(); ++i) x32[i] = FromBf16(x16[i]);
    std::vector<float> from16(m * len, -1.0f), from32(m * len, -2.0f);
    GemmSplitX(x16.data(), ldx, m, k, from16.data());
    GemmSplitX(x32.data(), ldx, m, k, from32.data());
    ASSERT_TRUE(SameBits(from16.data(), from32.data(), m * len)) << "k=" << k;
  }
}

TEST(CpuGemmTest, BFloat16OutputRoundsToNearestEven) {
  std::mt19937 rng(17);
  const Case c = MakeCase(rng, 7, 21, 50, GemmType::kBFloat16);
  const std::vector<float> y32 = Multiply(c, c.x.data(), c.m);
  std::vector<uint16_t> y16(c.m * c.n);
  GemmProblem p;
  p.x = c.x.data();
  p.ldx = c.k;
  p.w = c.w();
  p.w_type = c.w_type;
  p.ldw = c.k;
  p.y = y16.data();
  p.y_type = GemmType::kBFloat16;
  p.ldy = c.n;
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  GemmColumns(p, 0, c.n);
  for (size_t i = 0; i < y16.size(); ++i) ASSERT_EQ(y16[i], ToBf16(y32[i])) << i;
}

TEST(CpuGemmTest, StridesNanAndEmptyShapes) {
  // x and y with row strides wider than k and n; a NaN in one row stays in that row.
  const int64_t m = 3, n = 5, k = 20, ldx = 24, ldy = 9;
  std::vector<float> x(m * ldx, 1.0f), w(n * k, 0.5f), y(m * ldy, 7.0f);
  x[1 * ldx + 3] = std::nanf("");
  GemmProblem p;
  p.x = x.data();
  p.ldx = ldx;
  p.w = w.data();
  p.ldw = k;
  p.y = y.data();
  p.ldy = ldy;
  p.m = m;
  p.n = n;
  p.k = k;
  GemmColumns(p, 0, n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < ldy; ++j) {
      const float v = y[i * ldy + j];
      if (j >= n) {
        EXPECT_EQ(v, 7.0f);  // past n: untouched
      } else if (i == 1) {
        EXPECT_TRUE(std::isnan(v));
      } else {
        EXPECT_EQ(v, 10.0f);
      }
    }
  }
  p.k = 0;  // an empty inner dimension gives zeros
  GemmColumns(p, 0, n);
  for (int64_t i = 0; i < m; ++i) EXPECT_EQ(y[i * ldy], 0.0f);
  p.m = 0;  // no rows: nothing written, nothing read
  p.x = nullptr;
  GemmColumns(p, 0, n);
}

}  // namespace
}  // namespace fmoe
