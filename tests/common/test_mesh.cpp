// DeviceMesh membership: for several shapes, every sub-communicator holds exactly the ranks that
// share all the other coordinates, in row-major order of its own coordinates.

#include <cstdlib>

#include "fivefold/error.h"
#include "fivefold/mesh.h"
#include "testing.h"

using fivefold::testing::world;
using namespace fivefold::dist;

namespace {

// The world ranks of `dims`'s group that contains `coords`, computed from coordinates alone.
std::vector<int64_t> expected_members(const DeviceMesh& mesh, const std::vector<std::string>& names,
                                      const std::vector<int>& sizes, const std::string& dims) {
  std::vector<bool> in_group(names.size(), false);
  std::stringstream in(dims);
  std::string part;
  while (std::getline(in, part, '+')) {
    in_group[std::find(names.begin(), names.end(), part) - names.begin()] = true;
  }
  std::vector<int64_t> members;
  const int total = std::accumulate(sizes.begin(), sizes.end(), 1, std::multiplies<int>());
  for (int r = 0; r < total;
       ++r) {  // ascending world rank == row-major order of the group's coords
    auto c = mesh.coords_of(r);
    bool same = true;
    for (size_t d = 0; d < names.size(); ++d)
      same = same && (in_group[d] || c[d] == mesh.coords()[d]);
    if (same) members.push_back(r);
  }
  return members;
}

void check_mesh(const std::vector<std::pair<std::string, int>>& dims) {
  auto comm = world();
  DeviceMesh mesh(comm, dims);
  std::vector<std::string> names;
  std::vector<int> sizes;
  for (const auto& [name, size] : dims) {
    names.push_back(name);
    sizes.push_back(size);
  }
  EXPECT_EQ(mesh.rank_of(mesh.coords()), comm->rank());
  // Every subset of dimensions.
  for (unsigned mask = 1; mask < (1u << names.size()); ++mask) {
    std::string key;
    for (size_t d = 0; d < names.size(); ++d) {
      if (mask & (1u << d)) key += (key.empty() ? "" : "+") + names[d];
    }
    auto sub = mesh.comm(key);
    const auto expected = expected_members(mesh, names, sizes, key);
    ASSERT_EQ(sub->size(), static_cast<int>(expected.size())) << key;
    auto members = sub->all_gather(torch::tensor({static_cast<int64_t>(comm->rank())}));
    for (int i = 0; i < sub->size(); ++i) EXPECT_EQ(members[i].item<int64_t>(), expected[i]) << key;
    EXPECT_EQ(expected[sub->rank()], comm->rank()) << key;
  }
  // Each dimension: this rank's index in the group is its coordinate.
  for (size_t d = 0; d < names.size(); ++d) {
    EXPECT_EQ(mesh.comm(names[d])->rank(), mesh.coord(names[d]));
    EXPECT_EQ(mesh.size(names[d]), sizes[d]);
  }
  // Order of names does not matter.
  if (names.size() >= 2) {
    EXPECT_EQ(mesh.comm(names[0] + "+" + names[1]), mesh.comm(names[1] + "+" + names[0]));
  }
}

}  // namespace

TEST(DeviceMesh, MembershipForSeveralShapes) {
  const int n = world()->size();
  if (n == 16) {
    check_mesh({{"pp", 2}, {"dp", 2}, {"cp", 2}, {"tp", 2}});
    check_mesh({{"pp", 4}, {"dp", 1}, {"cp", 2}, {"tp", 2}});
    check_mesh({{"pp", 1}, {"dp", 4}, {"cp", 1}, {"tp", 4}});
  } else if (n == 8) {
    check_mesh({{"pp", 2}, {"dp", 2}, {"cp", 1}, {"tp", 2}});
    check_mesh({{"pp", 1}, {"dp", 2}, {"cp", 4}, {"tp", 1}});
    check_mesh({{"pp", 8}, {"dp", 1}, {"cp", 1}, {"tp", 1}});
  } else if (n == 4) {
    check_mesh({{"pp", 1}, {"dp", 2}, {"cp", 1}, {"tp", 2}});
    check_mesh({{"dp", 4}});
  } else {
    check_mesh({{"dp", n}});
  }
}

TEST(DeviceMesh, ExampleFromTheHeader) {
  if (world()->size() != 16) GTEST_SKIP() << "needs 16 ranks";
  DeviceMesh mesh(world(), {{"pp", 2}, {"dp", 2}, {"cp", 2}, {"tp", 2}});
  EXPECT_EQ(mesh.coords_of(13), (std::vector<int>{1, 1, 0, 1}));
  EXPECT_EQ(mesh.rank_of({1, 1, 0, 1}), 13);
}

TEST(DeviceMesh, BadShapesAreClearErrors) {
  const int n = world()->size();
  EXPECT_THROW(DeviceMesh(world(), {{"dp", n + 1}}), fivefold::Error);
  EXPECT_THROW(DeviceMesh(world(), {{"dp", n}, {"dp", 1}}), fivefold::Error);
  EXPECT_THROW(DeviceMesh(world(), {{"tp", 0}}), fivefold::Error);
  EXPECT_THROW(DeviceMesh(world(), {}), fivefold::Error);
  DeviceMesh mesh(world(), {{"dp", n}, {"tp", 1}});
  EXPECT_THROW(mesh.comm("ep"), fivefold::Error);
  EXPECT_THROW(mesh.comm("dp+dp"), fivefold::Error);
  EXPECT_THROW(mesh.coord("dp+tp"), fivefold::Error);
  EXPECT_THROW(mesh.rank_of({n, 0}), fivefold::Error);
}
