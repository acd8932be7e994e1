#include "fivefold/mesh.h"

#include <set>
#include <sstream>

#include "fivefold/error.h"

namespace fivefold::dist {

DeviceMesh::DeviceMesh(CommunicatorPtr world, std::vector<std::pair<std::string, int>> dims)
    : world_(std::move(world)) {
  FIVEFOLD_CHECK(world_ != nullptr, "DeviceMesh: no world communicator");
  FIVEFOLD_CHECK(!dims.empty() && dims.size() <= 8, "DeviceMesh: between 1 and 8 dimensions, got ",
                 dims.size());
  int product = 1;
  std::set<std::string> seen;
  std::ostringstream layout;
  for (const auto& [name, size] : dims) {
    FIVEFOLD_CHECK(!name.empty() && name.find('+') == std::string::npos,
                   "DeviceMesh: bad dimension name '", name, "'");
    FIVEFOLD_CHECK(seen.insert(name).second, "DeviceMesh: dimension '", name, "' appears twice");
    FIVEFOLD_CHECK(size >= 1, "DeviceMesh: dimension '", name, "' has size ", size);
    names_.push_back(name);
    sizes_.push_back(size);
    product *= size;
    layout << (layout.tellp() > 0 ? " x " : "") << name << " " << size;
  }
  FIVEFOLD_CHECK(product == world_->size(), "DeviceMesh: ", layout.str(), " = ", product,
                 " ranks, but the world has ", world_->size());
  coords_ = coords_of(world_->rank());

  // One communicator per non-empty set of dimensions, created in the same order on every rank.
  const unsigned all = (1u << names_.size()) - 1;
  for (unsigned mask = 1; mask <= all; ++mask) {
    if (mask == all) {
      comms_[mask] = world_;
      continue;
    }
    // color: row-major index over the dimensions NOT in the set (ranks sharing them group
    // together); key: row-major index over the dimensions in the set (the rank order inside the
    // group).
    int color = 0, key = 0;
    std::string name;
    for (size_t d = 0; d < names_.size(); ++d) {
      if (mask & (1u << d)) {
        key = key * sizes_[d] + coords_[d];
        name += (name.empty() ? "" : "+") + names_[d];
      } else {
        color = color * sizes_[d] + coords_[d];
      }
    }
    comms_[mask] = world_->split(color, key, name);
  }
}

int DeviceMesh::size(const std::string& dim) const {
  return sizes_.at(__builtin_ctz(mask_of(dim)));
}

int DeviceMesh::coord(const std::string& dim) const {
  const unsigned mask = mask_of(dim);
  FIVEFOLD_CHECK((mask & (mask - 1)) == 0, "DeviceMesh::coord takes one dimension, got '", dim,
                 "'");
  return coords_[__builtin_ctz(mask)];
}

std::vector<std::string> DeviceMesh::dim_names() const { return names_; }

unsigned DeviceMesh::mask_of(const std::string& dims) const {
  unsigned mask = 0;
  std::stringstream in(dims);
  std::string part;
  while (std::getline(in, part, '+')) {
    auto it = std::find(names_.begin(), names_.end(), part);
    FIVEFOLD_CHECK(it != names_.end(), "DeviceMesh: no dimension '", part, "' in '", dims, "'");
    const unsigned bit = 1u << (it - names_.begin());
    FIVEFOLD_CHECK(!(mask & bit), "DeviceMesh: dimension '", part, "' repeated in '", dims, "'");
    mask |= bit;
  }
  FIVEFOLD_CHECK(mask != 0, "DeviceMesh: empty dimension list");
  return mask;
}

CommunicatorPtr DeviceMesh::comm(const std::string& dims) const { return comms_.at(mask_of(dims)); }

int DeviceMesh::rank_of(const std::vector<int>& coords) const {
  FIVEFOLD_CHECK(coords.size() == sizes_.size(), "DeviceMesh::rank_of: ", coords.size(),
                 " coordinates for ", sizes_.size(), " dimensions");
  int rank = 0;
  for (size_t d = 0; d < sizes_.size(); ++d) {
    FIVEFOLD_CHECK(coords[d] >= 0 && coords[d] < sizes_[d], "DeviceMesh::rank_of: coordinate ",
                   coords[d], " outside dimension '", names_[d], "' of size ", sizes_[d]);
    rank = rank * sizes_[d] + coords[d];
  }
  return rank;
}

std::vector<int> DeviceMesh::coords_of(int rank) const {
  std::vector<int> coords(sizes_.size());
  for (int d = static_cast<int>(sizes_.size()) - 1; d >= 0; --d) {
    coords[d] = rank % sizes_[d];
    rank /= sizes_[d];
  }
  return coords;
}

}  // namespace fivefold::dist
