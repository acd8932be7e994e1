// The heart of chapter 08: ring reduce-scatter from send/recv.

#include "08_collectives/ring.h"

namespace fivefold::ch08 {

torch::Tensor ring_reduce_scatter(dist::Communicator& comm, const torch::Tensor& tensor) {
  const int n = comm.size(), r = comm.rank();
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  // The running sums, chunk by chunk (views into one working copy of this rank's tensor).
  torch::Tensor sums = tensor.clone();
  const std::vector<torch::Tensor> chunks = sums.tensor_split(n);
  auto mod = [n](int i) { return ((i % n) + n) % n; };
  for (int t = 0; t < n - 1; ++t) {
    const int send = mod(r - t - 1), receive = mod(r - t - 2);
    torch::Tensor incoming = torch::empty_like(chunks[receive]);
    comm.send_recv(chunks[send], right, incoming, left);
    chunks[receive].add_(incoming);  // the left neighbour's partial sum of that chunk, plus ours
  }
  return chunks[r].clone();  // complete: all n contributions
}

}  // namespace fivefold::ch08
