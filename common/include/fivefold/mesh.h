#pragma once
/// @file mesh.h
/// @brief DeviceMesh: the ranks of the world laid out on named dimensions, with one
/// sub-communicator for every set of dimensions.
///
/// The rank is the row-major index of its coordinates, the last dimension fastest. With the dense
/// order `pp, dp, cp, tp` (tp last), tensor-parallel peers are neighbouring ranks, so on one
/// machine they share memory and across machines they stay inside a node.
///
/// Example, pp=2 dp=2 cp=2 tp=2 (16 ranks): rank 13 = 1·8 + 1·4 + 0·2 + 1 has coordinates
/// {pp 1, dp 1, cp 0, tp 1}; its "tp" group is {12, 13}, its "dp" group {9, 13}, its "dp+cp"
/// group {9, 11, 13, 15}.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fivefold/dist.h"

namespace fivefold::dist {

/// Ranks laid out on named dimensions; every set of dimensions has its sub-communicator.
class DeviceMesh {
 public:
  /// Builds the mesh over `world` (its size must equal the product of the sizes). Collective over
  /// `world`: every rank constructs the same mesh. All 2^d - 1 sub-communicators are created here,
  /// in one fixed order, so that later lookups never need a collective.
  /// @param world the communicator of all ranks.
  /// @param dims (name, size) pairs, slowest first, e.g. {{"pp",2},{"dp",2},{"cp",1},{"tp",2}}.
  DeviceMesh(CommunicatorPtr world, std::vector<std::pair<std::string, int>> dims);

  /// Size of the named dimension.
  int size(const std::string& dim) const;
  /// This rank's coordinate along the named dimension.
  int coord(const std::string& dim) const;
  /// This rank's coordinates, in dimension order.
  const std::vector<int>& coords() const { return coords_; }
  /// Dimension names, slowest first.
  std::vector<std::string> dim_names() const;

  /// The communicator of the ranks that differ from this one only along `dims` (one name, or
  /// several joined by '+', in mesh order or not: "dp+cp" == "cp+dp"). Its rank order is the
  /// row-major order of those coordinates. Its statistics name is the canonical "dp+cp".
  CommunicatorPtr comm(const std::string& dims) const;
  /// The world communicator the mesh was built on.
  CommunicatorPtr world() const { return world_; }

  /// World rank of the given coordinates (one per dimension, in order).
  int rank_of(const std::vector<int>& coords) const;
  /// Coordinates of a world rank.
  std::vector<int> coords_of(int rank) const;

 private:
  unsigned mask_of(const std::string& dims) const;
  CommunicatorPtr world_;
  std::vector<std::string> names_;
  std::vector<int> sizes_;
  std::vector<int> coords_;
  std::map<unsigned, CommunicatorPtr> comms_;  // bit set of dimensions -> communicator
};

}  // namespace fivefold::dist
