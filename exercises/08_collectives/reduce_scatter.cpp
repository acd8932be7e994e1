// Chapter 08 exercise: ring reduce-scatter. Read chapters/08_collectives/README.md, section
// "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch08 &&
//   ctest --test-dir build -L loop_ch08 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch08 --output-on-failure

#include "08_collectives/ring.h"
#include "fivefold/error.h"

namespace fivefold::ch08 {

torch::Tensor ring_reduce_scatter(dist::Communicator& comm, const torch::Tensor& tensor) {
  // Contract: return chunk r (r = comm.rank()) of the element-wise sum of every rank's `tensor`,
  // the chunks being tensor.tensor_split(n) along dim 0 (n = comm.size(); their sizes may differ
  // by one, and may be 0). Leave `tensor` unchanged. Talk only to your ring neighbours, with
  // comm.send_recv (why not a send, then a receive?), n − 1 times, one chunk's running sum each
  // time. Which chunk does rank r pass on at step t, and which does it receive and add into, so
  // that chunk r ends on rank r with every contribution? (README, "Walk-through".)
  // The tests compare with the library's reduce-scatter bit for bit and count the bytes sent.
  throw NotImplemented(
      "ch08: ring_reduce_scatter (chapters/08_collectives/README.md, 'The exercise')");
}

}  // namespace fivefold::ch08
