// Chapter 08 exercise: ring reduce-scatter. Read chapters/08_collectives/README.md, section
// "The exercise", then run: ctest --test-dir build -L ch08

#include "08_collectives/ring.h"
#include "fivefold/error.h"

namespace fivefold::ch08 {

torch::Tensor ring_reduce_scatter(dist::Communicator& comm, const torch::Tensor& tensor) {
  // n = comm.size(), r = comm.rank(); right = (r + 1) % n, left = (r − 1 + n) % n.
  // 1. Work on a copy of `tensor`, split into n chunks along dim 0 (tensor_split: views).
  // 2. For t = 0 .. n − 2: send your running sum of chunk (r − t − 1) mod n to the right while
  //    receiving the left neighbour's running sum of chunk (r − t − 2) mod n (comm.send_recv:
  //    never a plain send then recv, which can deadlock); add what you received into that chunk.
  // 3. Chunk r now holds every rank's contribution: return a copy of it.
  throw NotImplemented(
      "ch08: ring_reduce_scatter (chapters/08_collectives/README.md, 'The exercise')");
}

}  // namespace fivefold::ch08
