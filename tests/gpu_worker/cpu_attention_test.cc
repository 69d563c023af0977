// Decode attention on the host: agreement with a double-precision softmax attention (grouped
// heads, sinks, head sizes off the 16-lane block), bfloat16 rounding where LibTorch rounds, the
// same bits from every instruction set this CPU runs and from any split of the heads, keys read in
// place wherever the pool keeps them, and the exponential's accuracy.
#include "gpu_worker/kernels/cpu_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string_view>
#include <vector>

namespace fmoe {
namespace {

uint16_t ToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
float RoundBf16(float f) { return FromBf16(ToBf16(f)); }

// A sequence's query and a pool holding its positions at scattered rows.
struct Case {
  int64_t heads, kv_heads, hd, positions, pool_rows;
  GemmType type;
  bool sinks;
  std::vector<float> q, k, v;  // As float32 (already rounded to bfloat16 for a bfloat16 case).
  std::vector<uint16_t> q16, k16, v16;
  std::vector<float> sink;
  std::vector<int64_t> rows;

  int64_t Ld() const { return kv_heads * hd; }
  DecodeAttentionProblem Problem(void* out) const {
    DecodeAttentionProblem p;
    const bool b = type == GemmType::kBFloat16;
    p.q = b ? static_cast<const void*>(q16.data()) : q.data();
    p.k_pool = b ? static_cast<const void*>(k16.data()) : k.data();
    p.v_pool = b ? static_cast<const void*>(v16.data()) : v.data();
    p.pool_ld = Ld();
    p.rows = rows.data();
    p.positions = positions;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.head_dim = hd;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    p.sinks = sinks ? sink.data() : nullptr;
    p.type = type;
    p.out = out;
    return p;
  }
};

Case MakeCase(std::mt19937& rng, int64_t heads, int64_t kv_heads, int64_t hd, int64_t positions,
              GemmType type, bool sinks) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Case c{heads, kv_heads, hd, positions, positions * 2 + 3, type, sinks, {}, {}, {}, {},
         {},    {},       {}, {}};
  auto fill = [&](std::vector<float>& x, std::vector<uint16_t>& x16, int64_t n, float scale) {
    x.resize(n);
    for (float& e : x) e = d(rng) * scale;
    if (type == GemmType::kBFloat16) {
      x16.resize(n);
      for (int64_t i = 0; i < n; ++i) x16[i] = ToBf16(x[i]), x[i] = FromBf16(x16[i]);
    }
  };
  fill(c.q, c.q16, heads * hd, 1.5f);
  fill(c.k, c.k16, c.pool_rows * c.Ld(), 1.0f);
  fill(c.v, c.v16, c.pool_rows * c.Ld(), 1.0f);
  c.sink.resize(heads);
  for (float& s : c.sink) s = d(rng);
  // Positions at distinct rows in a shuffled order, as a paged pool hands them out.
  std::vector<int64_t> all(c.pool_rows);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  c.rows.assign(all.begin(), all.begin() + positions);
  return c;
}

// softmax(q k^T * scale [, sink]) v in double, rounding as LibTorch's bfloat16 expression does
// for a bfloat16 case.
std::vector<double> Reference(const Case& c) {
  const int64_t group = c.heads / c.kv_heads;
  const bool b = c.type == GemmType::kBFloat16;
  const double scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.hd)));
  std::vector<double> out(c.heads * c.hd, 0.0);
  for (int64_t h = 0; h < c.heads; ++h) {
    const int64_t kvh = h / group;
    std::vector<double> s(c.positions);
    double max = -INFINITY;
    for (int64_t j = 0; j < c.positions; ++j) {
      double dot = 0;
      for (int64_t d = 0; d < c.hd; ++d) {
        dot += double{c.q[h * c.hd + d]} * c.k[c.rows[j] * c.Ld() + kvh * c.hd + d];
      }
      s[j] = b ? RoundBf16(RoundBf16(static_cast<float>(dot)) * static_cast<float>(scale))
               : dot * scale;
      max = std::max(max, s[j]);
    }
    if (c.sinks) max = std::max(max, double{c.sink[h]});
    double sum = c.sinks ? std::exp(c.sink[h] - max) : 0.0;
    for (double& e : s) sum += (e = std::exp(e - max));
    for (int64_t j = 0; j < c.positions; ++j) {
      const double pj = b ? RoundBf16(static_cast<float>(s[j] / sum)) : s[j] / sum;
      for (int64_t d = 0; d < c.hd; ++d) {
        out[h * c.hd + d] += pj * c.v[c.rows[j] * c.Ld() + kvh * c.hd + d];
      }
    }
  }
  return out;
}

// The output as float32, computed on `isa` ("" = the active code), the KV heads in `split`-sized
// parts (0 = all at once).
std::vector<float> Attend(const Case& c, std::string_view isa = "", int64_t split = 0) {
  std::vector<float> out32(c.heads * c.hd, -1.0f);
  std::vector<uint16_t> out16(c.heads * c.hd, 0xffff);
  const bool b = c.type == GemmType::kBFloat16;
  const DecodeAttentionProblem p = c.Problem(b ? static_cast<void*>(out16.data()) : out32.data());
  const int64_t step = split > 0 ? split : c.kv_heads;
  for (int64_t h = 0; h < c.kv_heads; h += step) {
    const int64_t h1 = std::min(c.kv_heads, h + step);
    if (isa.empty()) {
      DecodeAttentionHeads(p, h, h1);
    } else {
      EXPECT_TRUE(DecodeAttentionHeadsOn(isa, p, h, h1));
    }
  }
  if (b) {
    for (size_t i = 0; i < out16.size(); ++i) out32[i] = FromBf16(out16[i]);
  }
  return out32;
}

struct Shape {
  int64_t heads, kv_heads, hd, positions;
};
constexpr Shape kShapes[] = {
    {8, 4, 32, 1},  {8, 4, 32, 37},  {8, 8, 64, 200},  {32, 8, 128, 513}, {4, 1, 40, 17},
    {6, 2, 72, 70}, {2, 2, 16, 300}, {12, 4, 80, 129}, {4, 2, 8, 5},
};

TEST(DecodeAttention, AgreesWithADoublePrecisionSoftmaxInFloat32) {
  std::mt19937 rng(7);
  for (const Shape& s : kShapes) {
    for (bool sinks : {false, true}) {
      const Case c =
          MakeCase(rng, s.heads, s.kv_heads, s.hd, s.positions, GemmType::kFloat32, sinks);
      const std::vector<float> got = Attend(c);
      const std::vector<double> want = Reference(c);
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 2e-5 + 2e-5 * std::abs(want[i]))
            << "heads " << s.heads << " kv " << s.kv_heads << " hd " << s.hd << " positions "
            << s.positions << " sinks " << sinks << " at " << i;
      }
    }
  }
}

TEST(DecodeAttention, RoundsLikeLibTorchInBfloat16) {
  std::mt19937 rng(11);
  for (const Shape& s : kShapes) {
    for (bool sinks : {false, true}) {
      const Case c =
          MakeCase(rng, s.heads, s.kv_heads, s.hd, s.positions, GemmType::kBFloat16, sinks);
      const std::vector<float> got = Attend(c);
      const std::vector<double> want = Reference(c);
      size_t off_by_more_than_one = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i], RoundBf16(got[i])) << "the output is bfloat16";
        // Within one bfloat16 step of the reference (accumulation order and the exponential can
        // move a rounding point by one).
        const double step = std::abs(want[i]) * std::ldexp(1.0, -7) + 1e-6;
        if (std::abs(got[i] - want[i]) > 2 * step) ++off_by_more_than_one;
      }
      EXPECT_LE(off_by_more_than_one, got.size() / 100)
          << "heads " << s.heads << " hd " << s.hd << " positions " << s.positions;
    }
  }
}

TEST(DecodeAttention, EveryInstructionSetAndHeadSplitGivesTheSameBits) {
  std::mt19937 rng(3);
  for (const Shape& s : kShapes) {
    for (GemmType t : {GemmType::kFloat32, GemmType::kBFloat16}) {
      const Case c = MakeCase(rng, s.heads, s.kv_heads, s.hd, s.positions, t, s.hd % 16 == 8);
      const std::vector<float> portable = Attend(c, "portable");
      for (std::string_view isa : {"avx2", "avx512"}) {
        std::vector<float> probe(c.heads * c.hd);
        const DecodeAttentionProblem p = c.Problem(probe.data());
        if (!DecodeAttentionHeadsOn(isa, p, 0, 0)) continue;  // This CPU does not run it.
        EXPECT_EQ(Attend(c, isa), portable)
            << isa << " hd " << s.hd << " positions " << s.positions;
      }
      for (int64_t split = 1; split < c.kv_heads; ++split) {
        EXPECT_EQ(Attend(c, "", split), Attend(c)) << "split " << split;
      }
    }
  }
}

TEST(DecodeAttention, OnePositionGivesItsValueAndASinkTakesItsShare) {
  std::mt19937 rng(5);
  Case c = MakeCase(rng, 4, 2, 32, 1, GemmType::kFloat32, false);
  const std::vector<float> got = Attend(c);
  for (int64_t h = 0; h < c.heads; ++h) {
    for (int64_t d = 0; d < c.hd; ++d) {
      EXPECT_EQ(got[h * c.hd + d], c.v[c.rows[0] * c.Ld() + (h / 2) * c.hd + d]);
    }
  }
  // A sink far above every score takes nearly all the weight; far below, none.
  c.sinks = true;
  std::fill(c.sink.begin(), c.sink.end(), 80.0f);
  for (float v : Attend(c)) EXPECT_LT(std::abs(v), 1e-20f);
  std::fill(c.sink.begin(), c.sink.end(), -200.0f);
  EXPECT_EQ(Attend(c), got);
}

TEST(DecodeAttention, ExpIsWithinTwoUlpsAndFlushesBelowItsRange) {
  for (float x = -87.0f; x <= 0.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    const float got = DecodeAttentionExp(x);
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
    ASSERT_LE(std::abs(got - want), 2 * ulp) << "x = " << x;
  }
  EXPECT_EQ(DecodeAttentionExp(0.0f), 1.0f);
  EXPECT_EQ(DecodeAttentionExp(-88.0f), 0.0f);
  EXPECT_EQ(DecodeAttentionExp(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isnan(DecodeAttentionExp(NAN)));
}

TEST(DecodeAttention, ANanScoreMakesItsHeadNan) {
  std::mt19937 rng(9);
  Case c = MakeCase(rng, 4, 2, 16, 9, GemmType::kFloat32, false);
  c.k[c.rows[3] * c.Ld() + 0] = NAN;  // KV head 0: query heads 0 and 1.
  const std::vector<float> got = Attend(c);
  for (int64_t h = 0; h < c.heads; ++h) {
    for (int64_t d = 0; d < c.hd; ++d) {
      EXPECT_EQ(std::isnan(got[h * c.hd + d]), h < 2) << "head " << h;
    }
  }
}

}  // namespace
}  // namespace fmoe
