// The model held in parts, as pipeline stages hold it (chapter 11): each rank builds a range of
// layers under their global names (the first rank the embedding, the last the final norm and the
// head, a tied head with its table), and gather_named_tensors brings the parts together into the
// whole model's tensors, which a consolidated checkpoint saves. The parts start from the whole
// model's weights bit for bit; after each rank changes its own, the gathered map carries each
// rank's values.

#include <unistd.h>

#include <filesystem>

#include "03_transformer/checkpoint.h"
#include "03_transformer/model.h"
#include "fivefold/consolidate.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch03;
using fivefold::testing::world;

TEST(ModelParts, GatherIntoTheWholeModelAndItsCheckpoint) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    ModelConfig config;
    config.d_model = 32;
    config.n_layers = 5;  // 5 layers over 2 or 4 ranks: uneven stages (3 + 2, 2 + 1 + 1 + 1)
    config.n_heads = config.n_kv_heads = 4;
    config.d_ff = 64;
    config.tied_embeddings = tied;
    ModelPart part;
    part.first_layer = split_offset(config.n_layers, r, n);
    part.last_layer = part.first_layer + split_sizes(config.n_layers, n)[static_cast<size_t>(r)];
    part.embedding = r == 0;
    part.head = r == n - 1;
    Transformer stage = build_model(config, part);
    Transformer whole = build_model(config);
    io::TensorMap mine;
    {
      torch::NoGradGuard no_grad;
      for (auto& item : stage->named_parameters()) {
        EXPECT_TENSOR_EQ(item.value(), whole->named_parameters()[item.key()]);
        item.value().add_(1.0);  // this rank's training moved its weights
        mine[item.key()] = item.value();
      }
    }
    const auto gathered = gather_named_tensors(mine, *comm);
    const auto want = whole->named_parameters();
    ASSERT_EQ(gathered.size(), want.size());
    for (const auto& item : want) EXPECT_TENSOR_EQ(gathered.at(item.key()), item.value() + 1.0);

    // The consolidated checkpoint: the whole model with the gathered weights, loadable alone.
    {
      torch::NoGradGuard no_grad;
      for (auto& item : whole->named_parameters()) item.value().copy_(gathered.at(item.key()));
    }
    const auto dir = std::filesystem::temp_directory_path() /
                     ("fivefold-parts-" + std::to_string(::getpid()) + "-" + std::to_string(r));
    save_model(dir.string(), whole);
    auto loaded = load_model(dir.string());
    for (const auto& item : want)
      EXPECT_TENSOR_EQ(loaded->named_parameters()[item.key()], gathered.at(item.key()));
    std::filesystem::remove_all(dir);
  }
}
