// The training run's fast paths (runtime/fast.h) against chapter 03's code: the tiled attention
// kernel against causal_attention (output, log-sum-exp, and the gradients of q, k and v), the
// fused RMSNorm against the formula, FusedAdamW against torch::optim::AdamW step by step, and a
// whole model's loss and every gradient with the fast paths installed against the lesson's model.

#include <atomic>
#include <cmath>
#include <map>
#include <string>
#include <tuple>

#include "../10_tensor_parallel/fixtures.h"
#include "../14_memory/fixtures.h"
#include "02_flops_6np/flops.h"
#include "03_transformer/train.h"
#include "04_rope/rope.h"
#include "07_moe/moe.h"
#include "12_context_parallel/attention.h"
#include "14_memory/recompute.h"
#include "fivefold/adamw_state.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "runtime/fast.h"
#include "runtime/parallel.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::runtime;

namespace {

torch::Tensor draw(std::vector<int64_t> shape, const char* name, torch::Dtype dtype) {
  return torch::randn(shape, fivefold::generator_for(3, name), dtype);
}

// Output, lse and the gradients of q, k, v under a fixed upstream gradient of the output.
std::vector<torch::Tensor> run_kernel(const AttentionKernel& kernel, torch::Tensor q,
                                      torch::Tensor k, torch::Tensor v, int64_t seq_q) {
  q = q.clone().requires_grad_(true);
  k = k.clone().requires_grad_(true);
  v = v.clone().requires_grad_(true);
  const int64_t seq_k = k.size(2);
  const auto result = kernel.attend(q, k, v, position_range(seq_k - seq_q, seq_q),
                                    position_range(0, seq_k), 0.4);
  // Drawn in fp64 whatever the kernel's type, so that kernels of two types get one upstream.
  auto upstream = draw(result.output.sizes().vec(), "upstream", torch::kDouble)
                      .to(result.output.scalar_type());
  (result.output * upstream).sum().backward();
  return {result.output.detach(), result.lse, q.grad(), k.grad(), v.grad()};
}

// The fast paths' AVX-512 loops on or off for a scope (they are on outside it).
struct Avx512Loops {
  explicit Avx512Loops(bool on) { set_avx512_loops(on); }
  ~Avx512Loops() { set_avx512_loops(true); }
};

}  // namespace

TEST(TiledCausalAttention, EqualsTheLessonKernelWithItsGradients) {
  // (query heads, kv heads, seq_q, seq_k, tile): several tiles with a shorter last one, one tile,
  // tiles of one query, queries fewer than keys (a KV cache), grouped-query heads, v_dim != d.
  const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> cases = {
      {4, 4, 11, 11, 4}, {4, 2, 11, 11, 64}, {4, 1, 7, 7, 1}, {2, 2, 5, 9, 2}, {4, 2, 1, 6, 3}};
  for (const auto& [heads, kv_heads, seq_q, seq_k, tile] : cases) {
    SCOPED_TRACE(::testing::Message() << heads << " heads, " << kv_heads << " kv, seq " << seq_q
                                    << "/" << seq_k << ", tile " << tile);
    auto q = draw({2, heads, seq_q, 8}, "q", torch::kDouble);
    auto k = draw({2, kv_heads, seq_k, 8}, "k", torch::kDouble);
    auto v = draw({2, kv_heads, seq_k, 6}, "v", torch::kDouble);
    const auto want = run_kernel(CausalAttentionKernel(), q, k, v, seq_q);
    const auto got = run_kernel(TiledCausalAttentionKernel(tile), q, k, v, seq_q);
    const char* names[] = {"output", "lse", "grad q", "grad k", "grad v"};
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE(names[i]);
      EXPECT_TENSOR_CLOSE(got[i], want[i], 1e-12, 1e-12);
    }
  }
}

// Under chapter 14's bf16 kernel the products read bf16 and the passes over each score tile run
// in bf16 (max, exp, the gradient of the scores); the sums, the log-sum-exp and the output stay
// fp32. Against the exact result (fp64, the lesson's kernel): errors of bf16's size (8 bits of
// mantissa, 2⁻⁸ ≈ 4e-3 a rounding), and not fp32's (it did compute in bf16).
TEST(TiledCausalAttention, InBf16StaysWithinBf16sRounding) {
  fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
  struct Fp32Afterwards {
    ~Fp32Afterwards() { fivefold::ch14::use_precision(fivefold::ch14::Precision::Fp32, nullptr); }
  } restore;
  auto q = draw({2, 4, 70, 16}, "q", torch::kFloat);
  auto k = draw({2, 2, 70, 16}, "k", torch::kFloat);
  auto v = draw({2, 2, 70, 12}, "v", torch::kFloat);
  const auto want = run_kernel(CausalAttentionKernel(), q.to(torch::kDouble), k.to(torch::kDouble),
                               v.to(torch::kDouble), 70);
  const auto got = run_kernel(TiledCausalAttentionKernel(32), q, k, v, 70);
  const char* names[] = {"output", "lse", "grad q", "grad k", "grad v"};
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(names[i]);
    ASSERT_EQ(got[i].scalar_type(), torch::kFloat);
    const double error =
        ((got[i].to(torch::kDouble) - want[i]).norm() / want[i].norm()).item<double>();
    std::printf("%-7s relative error %.2e\n", names[i], error);
    EXPECT_LT(error, 1e-2);
    EXPECT_GT(error, 1e-5) << "computed in fp32, not bf16";
  }
}

// Under chapter 14's kernel the tiled kernel takes bf16 q, k and v as they come (no widening in
// attend): what it computes from them is what it computes from their widened copies, bit for bit
// (it rounds its operands to bf16 itself), with the output and log-sum-exp in fp32, and each
// input's gradient returned in the input's own type.
TEST(TiledCausalAttention, TakesBf16InputsAsTheirWidenedCopies) {
  fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
  struct Fp32Afterwards {
    ~Fp32Afterwards() { fivefold::ch14::use_precision(fivefold::ch14::Precision::Fp32, nullptr); }
  } restore;
  const TiledCausalAttentionKernel kernel(32);
  std::vector<std::vector<torch::Tensor>> runs;
  for (auto type : {torch::kBFloat16, torch::kFloat}) {
    std::vector<torch::Tensor> in = {
        draw({2, 4, 70, 16}, "q", torch::kFloat).to(torch::kBFloat16).to(type),
        draw({2, 2, 70, 16}, "k", torch::kFloat).to(torch::kBFloat16).to(type),
        draw({2, 2, 70, 12}, "v", torch::kFloat).to(torch::kBFloat16).to(type)};
    for (auto& t : in) t.requires_grad_();
    const auto result = kernel.attend(in[0], in[1], in[2], position_range(0, 70),
                                      position_range(0, 70), 0.3);
    ASSERT_EQ(result.output.scalar_type(), torch::kFloat);
    ASSERT_EQ(result.lse.scalar_type(), torch::kFloat);
    result.output.backward(draw(result.output.sizes().vec(), "upstream", torch::kFloat));
    runs.push_back({result.output, result.lse, in[0].grad(), in[1].grad(), in[2].grad()});
  }
  const char* names[] = {"output", "lse", "grad q", "grad k", "grad v"};
  for (size_t i = 0; i < runs[0].size(); ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(runs[0][i].scalar_type(), i < 2 ? torch::kFloat : torch::kBFloat16);
    EXPECT_TRUE(torch::equal(runs[0][i], runs[1][i].to(runs[0][i].scalar_type())));
  }
}

TEST(TiledCausalAttention, ExecutesTheFlopsItsCountSays) {
  // scores(seq) x (8 d + 6 d_v) per row and query head, the figure `fivefold plan` uses, against
  // chapter 02's counter over forward and backward; and the lesson kernel's whole square at
  // 6 (d + d_v). Seq 11 in tiles of 4 (a shorter last tile), of 64 (one tile), of 1.
  for (const int64_t tile : {4, 64, 1}) {
    SCOPED_TRACE(::testing::Message() << "tile " << tile);
    const int64_t seq = 11, rows = 2, heads = 4, d = 8, dv = 6;
    auto q = draw({rows, heads, seq, d}, "q", torch::kFloat);
    auto k = draw({rows, 2, seq, d}, "k", torch::kFloat);
    auto v = draw({rows, 2, seq, dv}, "v", torch::kFloat);
    const TiledCausalAttentionKernel kernel(tile);
    double tiled = 0, lesson = 0;
    {
      fivefold::ch02::FlopCounter counter;
      run_kernel(kernel, q, k, v, seq);
      tiled = counter.flops();
      counter.reset();
      run_kernel(CausalAttentionKernel(), q, k, v, seq);
      lesson = counter.flops();
    }
    EXPECT_EQ(tiled, static_cast<double>(rows * heads * kernel.scores(seq) * (8 * d + 6 * dv)));
    EXPECT_EQ(lesson, static_cast<double>(rows * heads * seq * seq * 6 * (d + dv)));
  }
  EXPECT_EQ(TiledCausalAttentionKernel(4).scores(11), 4 * 4 + 4 * 8 + 3 * 11);
  // Chapter 15 predicts it with chapter 12's count of the visible tiles.
  const auto positions = torch::arange(11, torch::kLong);
  EXPECT_EQ(TiledCausalAttentionKernel(4).scores(11),
            fivefold::ch12::visible_scores(positions, positions, 4));
}

TEST(TiledCausalAttention, RefusesALayoutItCannotAttend) {
  auto q = torch::randn({1, 2, 4, 8}), k = torch::randn({1, 2, 4, 8}), v = torch::randn({1, 2, 4, 8});
  const TiledCausalAttentionKernel kernel(2);
  const auto shuffled = torch::tensor({0, 2, 1, 3}, torch::kLong);
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { kernel.attend(q, k, v, shuffled, shuffled, 0.3); }, "consecutive positions"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing([] { TiledCausalAttentionKernel(0); },
                                                "at least one query"));
}

// Both paths of the tile's softmax passes against fp64 from the same scores: each query's max over
// the keys it sees (exactly), e = exp(s − max) there and exactly 0 at its later keys, Σe of e as
// stored. The AVX-512 loop computes s − max and exp in fp32 and rounds e once: within one rounding
// of the tile's type (bf16: 2⁻⁸). ATen's passes round s − max to bf16 too: an error of 2⁻⁸·|s − max|
// more. Tiles: several 16-number chunks with a tail and five queries; a square tile; one number.
TEST(CausalTileExp, BothPathsGiveTheSoftmaxOfTheKeysEachQuerySees) {
  const auto future = torch::ones({32, 32}, torch::kBool).triu(1);
  for (const bool vector : {true, false}) {
    if (vector && !avx512_available()) {
      std::printf("this CPU has no AVX-512: the loop is not tested here\n");
      continue;
    }
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      for (const auto& shape :
           std::vector<std::vector<int64_t>>{{2, 3, 5, 37}, {1, 2, 20, 20}, {1, 1, 1, 1}}) {
        SCOPED_TRACE(::testing::Message() << (vector ? "AVX-512 loop, " : "ATen's passes, ") << type
                                          << ", tile " << torch::IntArrayRef(shape));
        auto scores = (3 * draw(shape, "scores", torch::kFloat)).to(type);
        const auto s = scores.to(torch::kDouble);
        const int64_t t = shape[2], n = shape[3];
        const auto seen = torch::arange(n).unsqueeze(0) <= torch::arange(t).unsqueeze(1) + (n - t);
        const auto want_max = s.masked_fill(~seen, -INFINITY).amax(-1, true);
        const auto want = (s - want_max).exp().masked_fill(~seen, 0);
        const Avx512Loops loops(vector);
        const auto got = causal_tile_exp(scores, future, /*with_sum=*/true);
        ASSERT_EQ(got.max.scalar_type(), torch::kFloat);
        EXPECT_TRUE(torch::equal(got.max.to(torch::kDouble), want_max));
        const auto e = scores.to(torch::kDouble);
        EXPECT_TRUE((e.masked_select(~seen) == 0).all().item<bool>())
            << "a query's later keys must get e = 0";
        const double rounding = type == torch::kFloat ? 1e-6 : std::ldexp(1.0, -8);
        auto bound = rounding * want;
        if (!vector && type == torch::kBFloat16)
          bound = bound + rounding * (s - want_max).abs() * want;
        EXPECT_TRUE(((e - want).abs() <= bound + 1e-30).all().item<bool>())
            << "largest error " << (e - want).abs().max().item<double>();
        EXPECT_TENSOR_CLOSE(got.sum.to(torch::kDouble), e.sum(-1, true), 0, 1e-6);
        // Shifted by the log-sum-exp (what the tiled attention's backward gives): the
        // probabilities themselves, within one rounding, the shift handed back as the max.
        const auto lse = (want_max + want.sum(-1, true).log()).to(torch::kFloat);
        auto probabilities = (3 * draw(shape, "scores", torch::kFloat)).to(type);
        const auto shifted = causal_tile_exp(probabilities, future, /*with_sum=*/false, lse);
        EXPECT_TRUE(torch::equal(shifted.max, lse));
        const auto p = probabilities.to(torch::kDouble), want_p = want / want.sum(-1, true);
        auto p_bound = rounding * want_p + 1e-7;
        if (!vector && type == torch::kBFloat16)
          p_bound = p_bound + rounding * (s - lse.to(torch::kDouble)).abs() * want_p;
        EXPECT_TRUE(((p - want_p).abs() <= p_bound).all().item<bool>())
            << "largest error " << (p - want_p).abs().max().item<double>();
      }
    }
  }
  // A mask smaller than the tile is refused, not read past its end.
  auto tile = torch::zeros({1, 1, 4, 6});
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] {
        causal_tile_exp(tile, torch::ones({2, 2}, torch::kBool).triu(1), true);
      },
      "a mask of at least T x T"));
}

// Softmax's backward over a tile against fp64 from the same numbers: ∂L/∂s = p∘(∂L/∂p − δ), on
// both paths, in fp32 and bf16; the loop computes it in fp32 and rounds once (ATen's passes round
// δ and each of their two steps to a bf16 tile's type). Rows of 37 numbers: two chunks and a tail.
TEST(SoftmaxTileBackward, BothPathsGiveTheGradientOfTheScores) {
  for (const bool vector : {true, false}) {
    if (vector && !avx512_available()) continue;
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << (vector ? "AVX-512 loop, " : "ATen's passes, ") << type);
      const auto p = torch::softmax(3 * draw({2, 3, 5, 37}, "p", torch::kFloat), -1).to(type);
      auto grad = (2 * draw({2, 3, 5, 37}, "dp", torch::kFloat)).to(type);
      const auto delta = draw({2, 3, 5, 1}, "delta", torch::kFloat);
      const auto pd = p.to(torch::kDouble), dp = grad.to(torch::kDouble);
      const auto want = pd * (dp - delta.to(torch::kDouble));
      const Avx512Loops loops(vector);
      softmax_tile_backward(grad, p, delta);
      ASSERT_EQ(grad.scalar_type(), type);
      const double rounding = type == torch::kFloat ? 1e-6 : std::ldexp(1.0, -8);
      // The loop: one rounding of the result. ATen's passes in bf16: δ, ∂L/∂p − δ and the product
      // each rounded to the tile's type.
      auto bound = rounding * want.abs() + 1e-9;
      if (!vector && type == torch::kBFloat16)
        bound = bound + rounding * pd * (delta.abs().to(torch::kDouble) + (dp - delta).abs());
      const auto err = (grad.to(torch::kDouble) - want).abs();
      EXPECT_TRUE((err <= bound).all().item<bool>())
          << "largest error " << err.max().item<double>();
    }
  }
  auto grad = torch::zeros({1, 1, 4, 6});
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] {
        softmax_tile_backward(grad, torch::zeros({1, 1, 4, 5}), torch::zeros({1, 1, 4, 1}));
      },
      "of one shape"));
}

// parallel_chunks runs on ATen's threads (the bug it mends: at::parallel_for ran every loop of the
// fast paths on the calling thread, this project's sources being compiled without OpenMP): with
// two threads, both take a chunk, the chunks cover the range once, in order; one grain or one
// thread runs the whole range on the caller.
TEST(ParallelChunks, SplitTheRangeOverAtensThreads) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  std::vector<int> owner(1000, -1);
  std::atomic<int> calls{0};
  parallel_chunks(0, 1000, 10, [&](int64_t first, int64_t last) {
    ++calls;
    for (int64_t i = first; i < last; ++i) owner[i] = thread_number();
  });
  EXPECT_EQ(calls.load(), 2) << "two threads, two chunks";
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(owner[i], i < 500 ? 0 : 1) << "at " << i;
  calls = 0;
  parallel_chunks(0, 10, 10, [&](int64_t first, int64_t last) {
    ++calls;
    EXPECT_EQ(first, 0);
    EXPECT_EQ(last, 10);
  });
  EXPECT_EQ(calls.load(), 1) << "one grain: the caller alone";
  at::set_num_threads(1);
  calls = 0;
  parallel_chunks(0, 1000, 10, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls.load(), 1) << "one thread: the caller alone";
  at::set_num_threads(before);
}

// swiglu against fp64 from the same inputs, on both paths, in fp32 and bf16: h = silu(g)·u and
// the gradients of g and u under a fixed upstream gradient, within one rounding of the type (both
// paths compute each result in fp32 and round it once; fp32: a few units of its last place), gates
// from −30 to 30 (σ from both sides, and e^(−|g|) near underflow). Sizes not a multiple of 16.
TEST(SwiGLU, BothPathsGiveSiluOfTheGateTimesUpWithItsGradients) {
  for (const bool vector : {true, false}) {
    if (vector && !avx512_available()) {
      std::printf("this CPU has no AVX-512: the loop is not tested here\n");
      continue;
    }
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      SCOPED_TRACE(::testing::Message()
                   << (vector ? "AVX-512 loop, " : "ATen's operations, ") << type);
      auto gate = (4 * draw({3, 7, 45}, "gate", torch::kFloat)).to(type);
      gate.view(-1).narrow(0, 0, 5).copy_(torch::tensor({-30.0, -12.5, 0.0, 12.5, 30.0}));
      auto up = draw({3, 7, 45}, "up", torch::kFloat).to(type);
      const auto upstream = draw({3, 7, 45}, "upstream", torch::kFloat).to(type);
      gate.requires_grad_();
      up.requires_grad_();
      const Avx512Loops loops(vector);  // forward and backward alike
      const auto h = swiglu(gate, up);
      h.backward(upstream);
      const auto g = gate.detach().to(torch::kDouble), u = up.detach().to(torch::kDouble);
      const auto d = upstream.to(torch::kDouble), s = torch::sigmoid(g);
      const std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs = {
          {h, g * s * u}, {gate.grad(), d * u * s * (1 + g * (1 - s))}, {up.grad(), d * g * s}};
      const char* names[] = {"h", "grad gate", "grad up"};
      const double rounding = type == torch::kFloat ? 1e-6 : std::ldexp(1.0, -8);
      for (size_t i = 0; i < pairs.size(); ++i) {
        SCOPED_TRACE(names[i]);
        const auto& [got, want] = pairs[i];
        ASSERT_EQ(got.scalar_type(), type);
        const auto error = (got.detach().to(torch::kDouble) - want).abs();
        // Plus fp32's rounding of the largest value, for values near a cancellation (g·(1 − σ)
        // near −1 in the gate's gradient).
        const auto bound = rounding * want.abs() + 1e-6 * want.abs().max();
        EXPECT_TRUE((error <= bound).all().item<bool>())
            << "largest error " << error.max().item<double>() << " where the value is "
            << want.view(-1)[error.view(-1).argmax()].item<double>();
      }
    }
  }
}

// RoPE's rotation of a product's rows viewed as heads (x [b, h, s, d] with the rows' strides):
// against chapter 04's apply_rope in fp64, from fp32 and bf16 rows into fp32 and bf16, with the
// loops and without; pairs of 20 (not a whole number of AVX-512 registers). The result is
// contiguous in the type asked for; the gradient comes back in the rows' own type and layout.
TEST(RotateHalfSplit, BothPathsTurnThePairsAsChapter04WithTheGradient) {
  const int64_t batch = 2, seq = 5, heads = 3, d = 40;
  const auto [cos, sin] = fivefold::ch04::rope_angles(fivefold::ch04::rope_frequencies(d, 10000.0),
                                                      position_range(3, seq));
  for (const bool vector : {true, false}) {
    if (vector && !avx512_available()) {
      std::printf("this CPU has no AVX-512: the loop is not tested here\n");
      continue;
    }
    const Avx512Loops loops(vector);
    for (const auto x_type : {torch::kFloat, torch::kBFloat16}) {
      for (const auto type : {torch::kFloat, torch::kBFloat16}) {
        SCOPED_TRACE(::testing::Message() << (vector ? "AVX-512 loop, " : "ATen's operations, ")
                                          << x_type << " rows into " << type);
        auto rows = (3 * draw({batch, seq, heads, d}, "rows", torch::kFloat)).to(x_type);
        rows.requires_grad_();
        const auto x = rows.transpose(1, 2);  // [b, h, s, d], as attend_heads splits the heads
        const auto y = rotate_half_split(x, cos, sin, type);
        ASSERT_EQ(y.scalar_type(), type);
        ASSERT_TRUE(y.is_contiguous());
        const auto upstream = draw({batch, heads, seq, d}, "dy", torch::kFloat).to(type);
        y.backward(upstream);
        ASSERT_EQ(rows.grad().scalar_type(), x_type);
        EXPECT_TRUE(rows.grad().is_contiguous());
        auto x64 = x.detach().to(torch::kDouble).requires_grad_();
        const auto want =
            fivefold::ch04::apply_rope(x64, cos.to(torch::kDouble), sin.to(torch::kDouble),
                                       fivefold::ch04::RopeLayout::HalfSplit);
        want.backward(upstream.to(torch::kDouble));
        const std::vector<std::tuple<const char*, torch::Tensor, torch::Tensor, torch::Dtype>>
            checks = {{"y", y, want.detach(), type},
                      {"grad", rows.grad().transpose(1, 2), x64.grad(), x_type}};
        for (const auto& [name, got, expected, rounded_to] : checks) {
          SCOPED_TRACE(name);
          const double rounding = rounded_to == torch::kFloat ? 1e-6 : std::ldexp(1.0, -8);
          const auto error = (got.detach().to(torch::kDouble) - expected).abs();
          const auto bound = rounding * expected.abs() + 2e-6 * expected.abs().max();
          EXPECT_TRUE((error <= bound).all().item<bool>())
              << "largest error " << error.max().item<double>();
        }
      }
    }
  }
  EXPECT_THROW(rotate_half_split(torch::zeros({2, 3, 5, 7}), cos, sin, torch::kFloat),
               fivefold::Error);  // an odd head_dim
}

// x and the weight in one type (fp64, fp32), and x in fp32 against a weight kept in bf16 (chapter
// 14's master weights: read widened, its gradient returned in bf16, rounded once); rows of 16 and
// of 300 numbers (not a whole number of AVX-512 registers), with the loops and without.
TEST(FusedRMSNorm, EqualsTheFormulaWithItsGradients) {
  const std::vector<std::pair<torch::Dtype, torch::Dtype>> types = {
      {torch::kDouble, torch::kDouble},
      {torch::kFloat, torch::kFloat},
      {torch::kFloat, torch::kBFloat16}};
  for (const bool vector : {true, false}) {
    const Avx512Loops loops(vector);
    for (const int64_t dim : {16, 300}) {
      for (const auto& [dtype, weight_type] : types) {
        SCOPED_TRACE(::testing::Message() << dtype << " x, " << weight_type << " weight, rows of "
                                          << dim << (vector ? ", loops" : ", no loops"));
        const double tolerance = dtype == torch::kDouble ? 1e-12 : 1e-5;
        auto x = draw({3, 5, dim}, "x", dtype);
        auto w = (1 + 0.1 * draw({dim}, "w", dtype));
        auto upstream = draw({3, 5, dim}, "dy", dtype);
        std::vector<torch::Tensor> results[2];
        for (int fused = 0; fused < 2; ++fused) {
          RMSNorm norm(dim, 1e-5);
          {
            torch::NoGradGuard no_grad;
            norm->to(dtype);
            norm->weight.copy_(w);
            norm->weight.set_data(norm->weight.to(weight_type));
          }
          if (fused == 1) norm->kernel = std::make_shared<FusedRMSNormKernel>();
          auto input = x.clone().requires_grad_(true);
          auto y = norm(input);
          ASSERT_EQ(y.scalar_type(), dtype);
          (y * upstream).sum().backward();
          ASSERT_EQ(norm->weight.grad().scalar_type(), weight_type);
          results[fused] = {y.detach(), input.grad(), norm->weight.grad().to(dtype)};
        }
        for (size_t i = 0; i < 3; ++i) {
          // The weight's gradient in bf16: the two sums round apart by at most one bf16 step.
          const double t = i == 2 && weight_type == torch::kBFloat16 ? 1e-2 : tolerance;
          EXPECT_TENSOR_CLOSE(results[1][i], results[0][i], t, t);
        }
      }
    }
  }
}

TEST(FusedAdamW, StepsAsTorchsAdamWInBothGroups) {
  TrainConfig config;
  config.grad_clip = 0;
  ModelConfig model_config;
  model_config.vocab_size = 31;
  model_config.d_model = 16;
  model_config.n_layers = 1;
  model_config.n_heads = model_config.n_kv_heads = 2;
  model_config.d_ff = 24;
  Transformer lesson(model_config), fast(model_config);
  auto reference = make_optimizer(lesson, config);
  config.make_adamw = fused_adamw;  // the seam chapter 03's make_optimizer leaves
  auto fused = make_optimizer(fast, config);
  ASSERT_NE(dynamic_cast<FusedAdamW*>(fused.get()), nullptr);
  ASSERT_EQ(dynamic_cast<FusedAdamW*>(reference.get()), nullptr);
  for (int step = 0; step < 4; ++step) {
    auto lesson_params = lesson->parameters(), fast_params = fast->parameters();
    for (size_t i = 0; i < lesson_params.size(); ++i) {
      // The same gradient on both, different each step; the first parameter gets none at step 1
      // (it keeps no state until its first gradient), as an expert no token chose.
      auto grad = draw(lesson_params[i].sizes().vec(), "g", torch::kFloat) * (step + 1);
      if (i == 0 && step == 1) continue;
      lesson_params[i].mutable_grad() = grad.clone();
      fast_params[i].mutable_grad() = grad.clone();
    }
    for (auto& group : reference->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(0.01 * (step + 1));
    for (auto& group : fused->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(0.01 * (step + 1));
    reference->step();
    fused->step();
    for (size_t i = 0; i < lesson_params.size(); ++i)
      EXPECT_TENSOR_CLOSE(fast_params[i], lesson_params[i], 1e-6, 1e-6);
  }
  // The state is AdamW's own: the same names, steps and moments.
  const auto want =
      fivefold::adamw::state_by_name(fivefold::adamw::parameters_by_name(*lesson), *reference);
  const auto got =
      fivefold::adamw::state_by_name(fivefold::adamw::parameters_by_name(*fast), *fused);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, tensor] : want) EXPECT_TENSOR_CLOSE(got.at(name), tensor, 1e-6, 1e-6);
}

// Every operand layout linear hands the kernel (x·Wᵀ, dy·W, dyᵀ·x) and the ones it must copy or
// pass on to at::mm: the product equals at::mm's.
TEST(OneDnnMatmul, EqualsAtMmOnEveryLayout) {
  if (!OneDnnMatmulKernel::available()) GTEST_SKIP() << "built without oneDNN (libdnnl-dev)";
  auto generator = fivefold::generator_for(3, "matmul");
  const auto a = torch::randn({45, 70}, generator), b = torch::randn({70, 33}, generator);
  const auto at_ = torch::randn({70, 45}, generator), bt = torch::randn({33, 70}, generator);
  const auto wide = torch::randn({45, 140}, generator);
  const OneDnnMatmulKernel kernel;
  const std::vector<std::pair<torch::Tensor, torch::Tensor>> cases = {
      {a, b},                             // N, N
      {a, bt.t()},                        // N, T: x·Wᵀ
      {at_.t(), b},                       // T, N: dyᵀ·x
      {at_.t(), bt.t()},                  // T, T
      {wide.narrow(1, 10, 70), b},        // rows strided wider than they are long
      {wide.slice(1, 0, 140, 2), b},      // neither rows nor columns contiguous: copied
      {a.to(torch::kDouble), b.to(torch::kDouble)},  // another dtype: at::mm
      {a.narrow(1, 0, 0), b.narrow(0, 0, 0)},        // k = 0: at::mm (zeros)
  };
  for (const auto& [x, y] : cases) {
    SCOPED_TRACE(::testing::Message() << x.sizes() << x.strides() << " x " << y.sizes()
                                      << y.strides());
    const auto got = kernel.mm(x, y), want = x.mm(y);
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_TENSOR_CLOSE(got, want, 1e-5, 1e-4);
  }
  EXPECT_THROW(kernel.mm(a, a), fivefold::Error);  // [45, 70] x [45, 70]
}

// The batched product on every layout the tiled attention hands it (heads flattened from
// [b, h, seq, d] views: a tile's rows, a transposed key block, a fresh [b·h, T, end] of scores),
// and the ones it must copy or pass on to at::bmm: the product equals at::bmm's.
TEST(OneDnnMatmul, BmmEqualsAtBmmOnEveryLayout) {
  if (!OneDnnMatmulKernel::available()) GTEST_SKIP() << "built without oneDNN (libdnnl-dev)";
  auto generator = fivefold::generator_for(3, "bmm");
  const auto q = torch::randn({2, 3, 20, 8}, generator), k = torch::randn({2, 3, 20, 8}, generator);
  const auto s = torch::randn({6, 7, 13}, generator), v = torch::randn({6, 13, 5}, generator);
  const auto tile = q.narrow(2, 4, 7).flatten(0, 1);                 // [6, 7, 8], rows of 8
  const auto keys = k.narrow(2, 0, 13).transpose(-2, -1).flatten(0, 1);  // [6, 8, 13], T
  const OneDnnMatmulKernel kernel;
  const std::vector<std::pair<torch::Tensor, torch::Tensor>> cases = {
      {tile, keys},                                       // scores: N, T
      {s, v},                                             // weighted values: N, N
      {s.transpose(-2, -1), tile.narrow(1, 0, 7)},        // pᵀ·dO: T, N
      {s.transpose(-2, -1), s},                           // T, N on one buffer
      {s.slice(2, 0, 13, 2), v.slice(1, 0, 13, 2)},       // neither layout: copied
      {s.expand({6, 7, 13}), v},                          // a broadcast operand
      {s.to(torch::kDouble), v.to(torch::kDouble)},      // another dtype: at::bmm
      {s.narrow(0, 0, 0), v.narrow(0, 0, 0)},            // no matrices: at::bmm
  };
  for (const auto& [x, y] : cases) {
    SCOPED_TRACE(::testing::Message() << x.sizes() << x.strides() << " x " << y.sizes()
                                      << y.strides());
    const auto got = kernel.bmm(x, y), want = at::bmm(x, y);
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_TENSOR_CLOSE(got, want, 1e-5, 1e-4);
  }
  EXPECT_THROW(kernel.bmm(s, s), fivefold::Error);  // [6, 7, 13] x [6, 7, 13]
  EXPECT_THROW(kernel.bmm(s, v.narrow(0, 0, 5)), fivefold::Error);  // 6 matrices against 5
}

// The tiled kernel with its heads multiplied by oneDNN: the same output, log-sum-exp and
// gradients as with torch::matmul, in float (oneDNN's type), and the FLOPs its count says.
TEST(OneDnnMatmul, TiledAttentionOnItGivesTheSameGradientsAndFlops) {
  if (!OneDnnMatmulKernel::available()) GTEST_SKIP() << "built without oneDNN (libdnnl-dev)";
  const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> cases = {
      {4, 4, 11, 11, 4}, {4, 2, 11, 11, 64}, {2, 2, 5, 9, 2}, {4, 2, 1, 6, 3}};
  for (const auto& [heads, kv_heads, seq_q, seq_k, tile] : cases) {
    SCOPED_TRACE(::testing::Message() << heads << " heads, " << kv_heads << " kv, seq " << seq_q
                                      << "/" << seq_k << ", tile " << tile);
    auto q = draw({2, heads, seq_q, 8}, "q", torch::kFloat);
    auto k = draw({2, kv_heads, seq_k, 8}, "k", torch::kFloat);
    auto v = draw({2, kv_heads, seq_k, 6}, "v", torch::kFloat);
    const TiledCausalAttentionKernel kernel(tile);
    const auto want = run_kernel(kernel, q, k, v, seq_q);
    set_matmul_kernel(std::make_shared<const OneDnnMatmulKernel>());
    double flops = 0;
    std::vector<torch::Tensor> got;
    {
      fivefold::ch02::FlopCounter counter;
      got = run_kernel(kernel, q, k, v, seq_q);
      flops = counter.flops();
    }
    set_matmul_kernel(nullptr);
    const char* names[] = {"output", "lse", "grad q", "grad k", "grad v"};
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE(names[i]);
      EXPECT_TENSOR_CLOSE(got[i], want[i], 1e-5, 1e-5);
    }
    if (seq_q == seq_k) {
      EXPECT_EQ(flops, static_cast<double>(2 * heads * kernel.scores(seq_q) * (8 * 8 + 6 * 6)));
    }
  }
}

// linear on the kernel: the same output and gradients as on at::mm, the weight's gradient put off
// too; and chapter 02's counter sees its three products.
TEST(OneDnnMatmul, LinearGivesTheSameGradientsAndFlops) {
  if (!OneDnnMatmulKernel::available()) GTEST_SKIP() << "built without oneDNN (libdnnl-dev)";
  auto generator = fivefold::generator_for(4, "linear");
  const auto x0 = torch::randn({3, 17, 24}, generator), w0 = torch::randn({40, 24}, generator);
  const auto dy = torch::randn({3, 17, 40}, generator);
  auto run = [&](bool defer) {
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    WeightGradientStore store;
    auto y = fivefold::ch03::linear(x, w);
    {
      std::unique_ptr<DeferWeightGradients> guard;
      if (defer) guard = std::make_unique<DeferWeightGradients>(store);
      y.backward(dy);
    }
    store.flush();
    return std::vector<torch::Tensor>{y.detach(), x.grad(), w.grad()};
  };
  const auto want = run(false);
  set_matmul_kernel(std::make_shared<const OneDnnMatmulKernel>());
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "weight gradient deferred" : "at once");
    const auto got = run(defer);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TENSOR_CLOSE(got[i], want[i], 1e-5, 1e-4);
  }
  double counted = 0;
  {
    fivefold::ch02::FlopCounter counter;
    run(false);
    counted = counter.flops();
  }
  set_matmul_kernel(nullptr);
  EXPECT_DOUBLE_EQ(counted, 3 * 2.0 * (3 * 17) * 24 * 40);  // forward, dx, dW
}

// A kernel that counts its products, to see who multiplies with it.
class CountingKernel : public fivefold::ch03::MatmulKernel {
 public:
  torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) const override {
    ++calls;
    return a.mm(b);
  }
  mutable int calls = 0;
};

TEST(MatmulKernel, ThePeakIsMeasuredOnTheKernelLinearUses) {
  auto counting = std::make_shared<const CountingKernel>();
  EXPECT_EQ(set_matmul_kernel(counting), nullptr);
  EXPECT_EQ(matmul_kernel(), counting.get());
  EXPECT_GT(fivefold::runtime::matmul_peak_gflops(48), 0.0);
  EXPECT_EQ(counting->calls, 12);  // two warm-ups and the best of 10
  EXPECT_EQ(set_matmul_kernel(nullptr), counting);
  EXPECT_GT(fivefold::runtime::matmul_peak_gflops(48), 0.0);  // at::mm's
  EXPECT_EQ(counting->calls, 12);
}

// Without positions and with chapter 04's RoPE.
TEST(FastPaths, AWholeModelGivesTheLessonsLossAndGradients) {
  for (const double rope_theta : {0.0, 10000.0}) {
    SCOPED_TRACE(rope_theta > 0 ? "RoPE" : "no positions");
    ModelConfig c;
    c.vocab_size = 61;
    c.d_model = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.d_ff = 48;
    c.rope_theta = rope_theta;
    Transformer lesson = fivefold::ch04::make_model(c), fast = fivefold::ch04::make_model(c);
    const FastPaths installed = install_fast_paths(fast);
    EXPECT_EQ(installed.attention_kernels, 2);
    EXPECT_EQ(installed.norms, 5);  // two per block and the final norm
    EXPECT_EQ(installed.mlps, 2);
    EXPECT_EQ(installed.rotary, rope_theta > 0 ? 2 : 0);
    EXPECT_EQ(install_fast_paths(fast).norms, 0);  // once installed, left alone
    EXPECT_EQ(installed.matmul, OneDnnMatmulKernel::available());
    auto tokens = torch::randint(c.vocab_size, {3, 70}, fivefold::generator_for(5, "tokens"));
    const Batch batch{tokens.narrow(1, 0, 69), tokens.narrow(1, 1, 69)};
    // The lesson's model multiplies with at::mm: the matmul kernel is process-wide.
    const auto products = set_matmul_kernel(nullptr);
    auto lesson_loss = loss_of(lesson, batch);
    lesson_loss.backward();
    set_matmul_kernel(products);
    auto fast_loss = loss_of(fast, batch);
    fast_loss.backward();
    set_matmul_kernel(nullptr);
    EXPECT_NEAR(fast_loss.item<double>(), lesson_loss.item<double>(), 1e-6);
    const auto want = lesson->named_parameters(), got = fast->named_parameters();
    for (const auto& item : want) {
      SCOPED_TRACE(item.key());
      EXPECT_TENSOR_CLOSE(got[item.key()].grad(), item.value().grad(), 1e-5, 1e-6);
    }
  }
}

// What a block keeps with the fast paths: the growth of the storage alive after the loss as a
// block is added, against runtime::block_activation_bytes, in fp32 and bf16, with and without
// grouped-query attention, at two sequence lengths, without recomputation, with the attention
// core recomputed (selective) and with whole blocks recomputed (full).
TEST(FastPaths, KeepWhatTheirFormulaSays) {
  struct Fp32Afterwards {
    ~Fp32Afterwards() { set_matmul_kernel(nullptr); }
  } restore;
  for (auto precision : {fivefold::ch14::Precision::Fp32, fivefold::ch14::Precision::Bf16}) {
    for (int64_t kv_heads : {4, 2}) {
      for (int64_t seq : {8, 20}) {
        SCOPED_TRACE(to_string(precision) + ", " + std::to_string(kv_heads) + " kv heads, seq " +
                     std::to_string(seq));
        ModelConfig c;
        c.vocab_size = 61;
        c.d_model = 64;
        c.n_heads = 4;
        c.n_kv_heads = kv_heads;
        c.rope_theta = 10000;
        c.d_ff = 48;
        const int64_t batch = 3;
        auto tokens = torch::randint(c.vocab_size, {batch, seq}, fivefold::generator_for(5, "t"));
        using fivefold::ch14::Recompute;
        for (auto mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
          std::vector<int64_t> kept;
          for (int64_t layers : {1, 2}) {
            c.n_layers = layers;
            Transformer model = fivefold::ch07::make_model(c);  // with RoPE
            set_matmul_kernel(nullptr);
            install_fast_paths(model);
            fivefold::ch14::apply_recompute(model, {mode, 1, 0});
            if (precision == fivefold::ch14::Precision::Bf16)
              fivefold::ch14::use_precision(precision, nullptr);
            fivefold::MemoryTracker memory;
            auto loss = loss_of(model, {tokens, tokens});
            kept.push_back(memory.current_bytes());
          }
          EXPECT_EQ(kept[1] - kept[0],
                    block_activation_bytes(c.shape(), batch, seq, precision, mode))
              << to_string(mode);
        }
      }
    }
  }
}

// Recomputation on the fast paths in bf16 (bf16 products and parameters beside fp32 masters, as
// the trainer runs it) gives the loss and every gradient of the run without it, bit for bit: the
// checkpointed core takes q, k and v as the tiled kernel inside does, and runs it again on them;
// with MLA (whose k reaches the core in fp32 and is kept rounded) and MoE too.
TEST(FastPaths, RecomputationInBf16GivesTheGradientsOfTheRunWithout) {
  using fivefold::ch14::Recompute;
  fivefold::ch14::testing::Fp32Afterwards restore;
  ModelConfig llama;
  llama.vocab_size = 61;
  llama.d_model = 64;
  llama.n_heads = 4;
  llama.n_kv_heads = 2;
  llama.rope_theta = 10000;
  llama.d_ff = 48;
  llama.n_layers = 2;
  auto deepseek = fivefold::ch10::testing::deepseek_config();
  deepseek.n_layers = 2;
  for (const ModelConfig& c : {llama, deepseek}) {
    SCOPED_TRACE(c.extensions.is_null() ? "llama" : "deepseek");
    const auto tokens = torch::randint(c.vocab_size, {3, 20}, fivefold::generator_for(5, "t"));
    auto run = [&](Recompute mode) {
      Transformer model = fivefold::ch07::make_model(c);  // with RoPE
      set_matmul_kernel(nullptr);
      install_fast_paths(model);
      fivefold::ch14::apply_recompute(model, {mode, 1, 0});
      fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
      MasterWeights masters(model, torch::kBFloat16);
      const auto loss = loss_of(model, {tokens, tokens});
      loss.backward();
      std::map<std::string, torch::Tensor> grads;
      for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad();
      return std::pair{loss.item<double>(), grads};
    };
    const auto [want_loss, want] = run(Recompute::None);
    for (auto mode : {Recompute::Selective, Recompute::Full}) {
      SCOPED_TRACE(fivefold::ch14::to_string(mode));
      const auto [loss, grads] = run(mode);
      EXPECT_EQ(loss, want_loss);
      for (const auto& [name, grad] : want) {
        SCOPED_TRACE(name);
        if (!grad.defined()) {  // MoE's routing bias: moved by the load, not by a gradient
          EXPECT_FALSE(grads.at(name).defined());
          continue;
        }
        ASSERT_EQ(grad.scalar_type(), torch::kBFloat16);
        EXPECT_TENSOR_EQ(grads.at(name), grad);
      }
    }
  }
}

TEST(FastPaths, LeaveAnotherAttentionKernelAlone) {
  struct Mine : AttentionKernel {
    AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& qp, const torch::Tensor& kp,
                            double scale) const override {
      return CausalAttentionKernel().attend(q, k, v, qp, kp, scale);
    }
  };
  ModelConfig c;
  c.vocab_size = 31;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = c.n_kv_heads = 2;
  c.d_ff = 24;
  Transformer model(c);
  model->set_attention_kernel(std::make_shared<Mine>());
  EXPECT_EQ(install_fast_paths(model).attention_kernels, 0);
}

// A DeepSeek-V3-shaped block (chapter 06's MLA, chapter 07's MoE) with the fast paths keeps what
// block_activation_bytes says: its dense first layer and a MoE layer, 1, 2 and 3 rows, at two
// lengths, with every width the formula reads changed on its own, in every recomputation mode, in
// fp32 and bf16.
TEST(FastPaths, ADeepSeekBlockKeepsWhatItsFormulaSays) {
  using fivefold::ch14::Precision;
  using fivefold::ch14::Recompute;
  fivefold::ch14::testing::Fp32Afterwards restore;
  const std::pair<const char*, int64_t> widths[] = {{"", 0},
                                                    {"qk_nope_head_dim", 12},
                                                    {"qk_rope_head_dim", 6},
                                                    {"v_head_dim", 10},
                                                    {"kv_lora_rank", 24},
                                                    {"q_lora_rank", 24},
                                                    {"q_lora_rank", 0},
                                                    {"d_model", 48},
                                                    {"n_heads", 4}};
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      for (const auto& [key, width] : widths) {
        for (int64_t seq : {4, 8}) {
          for (int64_t batch : {1, 2, 3}) {
            auto config = fivefold::ch10::testing::deepseek_config();
            config.extensions["first_k_dense_replace"] = 2;  // block 1 dense, block 2 MoE
            if (std::string(key) == "d_model")
              config.d_model = width;
            else if (std::string(key) == "n_heads")
              config.n_heads = config.n_kv_heads = width;
            else if (width == 0 && *key != '\0')
              config.extensions[key] = nullptr;
            else if (*key != '\0')
              config.extensions[key] = width;
            SCOPED_TRACE(to_string(precision) + ", " + fivefold::ch14::to_string(mode) + ", " +
                         key + " " + std::to_string(width) + ", seq " + std::to_string(seq) +
                         ", batch " + std::to_string(batch));
            auto tokens =
                torch::randint(0, config.vocab_size, {batch, seq}, fivefold::generator_for(5, "t"));
            const auto kept = fivefold::ch14::testing::kept_per_block(
                [&, mode = mode](int64_t layers) {
                  config.n_layers = layers;
                  Transformer model = fivefold::ch07::make_model(config);
                  set_matmul_kernel(nullptr);
                  install_fast_paths(model);
                  fivefold::ch14::apply_recompute(model, {mode, 1, 0});
                  fivefold::ch14::use_precision(precision, nullptr);
                  return model;
                },
                {tokens, tokens}, 3);
            for (int64_t layer : {1, 2})
              EXPECT_EQ(kept[layer - 1],
                        block_activation_bytes(config, layer, batch, seq, precision, mode))
                  << "block " << layer;
          }
        }
      }
    }
  }
}
