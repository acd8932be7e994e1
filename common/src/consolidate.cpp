#include "fivefold/consolidate.h"

#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <vector>

#include "fivefold/error.h"

namespace fivefold {

io::TensorMap gather_named_tensors(const io::TensorMap& mine, dist::Communicator& comm, int root) {
  FIVEFOLD_CHECK(root >= -1 && root < comm.size(), "gather_named_tensors: root ", root, " of ",
                 comm.size(), " ranks");
  // 1. What each rank holds: names, shapes, dtypes, as JSON bytes, all-gathered.
  nlohmann::json listing = nlohmann::json::array();
  for (const auto& [name, t] : mine)
    listing.push_back({name, t.sizes().vec(), static_cast<int>(t.scalar_type())});
  const auto listings = all_gather_json(listing, comm);
  // 2. Each name from the lowest rank that holds it, broadcast (or sent to root) in rank order,
  //    then name order: the same sequence of operations on every rank.
  io::TensorMap whole;
  std::set<std::string> given;
  const int me = comm.rank();
  for (int r = 0; r < comm.size(); ++r) {
    for (const auto& entry : listings[static_cast<size_t>(r)]) {
      const std::string name = entry[0];
      if (!given.insert(name).second) continue;  // a lower rank gave it already
      auto shape = entry[1].get<std::vector<int64_t>>();
      const auto dtype = static_cast<torch::ScalarType>(entry[2].get<int>());
      if (root < 0) {
        torch::Tensor t = r == me ? mine.at(name).detach().contiguous().clone()
                                  : torch::empty(shape, torch::TensorOptions(dtype));
        comm.broadcast(t, r);
        whole[name] = t;
      } else if (me == root) {
        torch::Tensor t =
            r == me ? mine.at(name).detach() : torch::empty(shape, torch::TensorOptions(dtype));
        if (r != me) comm.recv(t, r);
        whole[name] = t;
      } else if (me == r) {
        comm.send(mine.at(name).detach().contiguous(), root);
      }
    }
  }
  return whole;
}

std::vector<std::string> all_gather_strings(const std::string& mine, dist::Communicator& comm) {
  auto length = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong);
  const auto lengths = comm.all_gather(length);  // [ranks]
  std::vector<int64_t> sizes(lengths.data_ptr<int64_t>(),
                             lengths.data_ptr<int64_t>() + lengths.numel());
  auto bytes = torch::empty({static_cast<int64_t>(mine.size())}, torch::kUInt8);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<uint8_t>());
  const auto all = comm.all_gather(bytes, sizes);
  std::vector<std::string> out;
  int64_t offset = 0;
  for (const int64_t size : sizes) {
    const auto* begin = all.data_ptr<uint8_t>() + offset;
    out.emplace_back(begin, begin + size);
    offset += size;
  }
  return out;
}

std::string first_said(const std::string& mine, dist::Communicator& comm) {
  for (std::string& said : all_gather_strings(mine, comm))
    if (!said.empty()) return said;
  return "";
}

std::vector<nlohmann::json> all_gather_json(const nlohmann::json& mine, dist::Communicator& comm) {
  std::vector<nlohmann::json> out;
  for (const std::string& text : all_gather_strings(mine.dump(), comm))
    out.push_back(nlohmann::json::parse(text));
  return out;
}

io::TensorMap select_parameters(const io::TensorMap& map, const std::set<std::string>& names) {
  io::TensorMap out;
  for (const auto& [key, t] : map) {
    for (const std::string suffix : {"", ".exp_avg", ".exp_avg_sq", ".step"}) {
      if (key.size() < suffix.size() ||
          key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      if (names.count(key.substr(0, key.size() - suffix.size())) > 0) {
        out[key] = t;
        break;
      }
    }
  }
  return out;
}

}  // namespace fivefold
