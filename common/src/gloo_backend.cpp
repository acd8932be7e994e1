// The c10d/Gloo backend: each operation is one call on a c10d::ProcessGroupGloo, waited for.
// Gloo in LibTorch 1.13 has no reduce-scatter and gathers only equal-sized tensors, so:
// - reduce_scatter = all-reduce, then keep this rank's part (2x the traffic of a real one;
//   chapter 08 builds the ring version from send/recv that fills the gap properly);
// - all_gather of unequal parts pads every part to the largest, then drops the padding;
// - it has no bf16: a collective that only moves data moves a bf16 tensor's bits as fp16 (the
//   same two bytes, copied, never computed on), and an all-reduce of bf16 sums in fp32 and rounds
//   once.

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "fivefold/log.h"
#include "internal.h"

namespace fivefold::dist {
namespace {

c10d::ReduceOp gloo_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Average: break;
  }
  throw Error("Gloo backend: unexpected reduce op");
}

// Gloo's own timeout, 2 s past FIVEFOLD_COMM_TIMEOUT: the watchdog (which checks twice a second)
// reports a stuck operation first, with the message every backend gives (operation,
// communicator, size), instead of Gloo's "terminate ... Timed out waiting".
std::chrono::milliseconds gloo_timeout() {
  return std::chrono::milliseconds(static_cast<int64_t>(comm_timeout_seconds() * 1000) + 2000);
}

// Waits for an operation, then for Gloo's worker thread to let go of it. The worker drops its
// handle (and with it the operation's tensors) a moment after the operation completes, so a
// buffer the caller frees could outlive the call by that moment; memory must be free when the
// call returns (the chapters count it with MemoryTracker). Bounded: a second at most.
template <typename WorkPtr>
void finish(const WorkPtr& work) {
  work->wait();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (work.use_count() > 1 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::yield();
  }
}

// `t` as Gloo can move it: a bf16 tensor viewed as fp16 (its bits, the same storage).
torch::Tensor movable(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? t.view(torch::kHalf) : t;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int size,
                   std::shared_ptr<::gloo::transport::Device> device, std::string name)
      : Communicator(rank, size, std::move(name), Backend::Gloo),
        store_(std::move(store)),
        prefix_(std::move(prefix)),
        device_(std::move(device)) {
    auto options = c10d::ProcessGroupGloo::Options::create(gloo_timeout());
    options->devices.push_back(device_);
    options->threads = 1;  // every operation is waited for at once: one thread is enough
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(prefix_, store_);
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, rank, size, options);
    // Every rank's connections finished before any rank goes on. Without this, a rank whose
    // side of the connections was done could drop the group (a mesh's unused one, dropped as
    // the mesh is built) while its peer was still reading the handshake: the peer then failed
    // in its constructor with "Connection closed by peer", and so, a moment later, did this
    // rank (seen about once in six runs of a test that builds a mesh per layout, on a loaded
    // machine). Not counted as an operation of the communicator.
    if (size > 1) finish(group_->barrier());
  }

  ~GlooCommunicator() override { drain_and_stop(); }

 protected:
  void do_all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    if (tensor.scalar_type() == torch::kBFloat16) {
      auto wide = tensor.to(torch::kFloat);
      do_all_reduce(wide, op);
      tensor.copy_(wide);
      return;
    }
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = gloo_op(op);
    finish(group_->allreduce(tensors, options));
  }

  void do_all_gather(const torch::Tensor& in, torch::Tensor& out,
                     const std::vector<int64_t>& dim0_sizes) override {
    if (in.scalar_type() == torch::kBFloat16) {
      auto bits = movable(out);
      return do_all_gather(movable(in), bits, dim0_sizes);
    }
    const int64_t largest = *std::max_element(dim0_sizes.begin(), dim0_sizes.end());
    if (largest == 0) return;
    auto shape = out.sizes().vec();
    shape[0] = largest;
    torch::Tensor padded = torch::zeros(shape, in.options());
    padded.narrow(0, 0, in.size(0)).copy_(in);
    std::vector<at::Tensor> inputs{padded};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int i = 0; i < size(); ++i) outputs[0].push_back(torch::empty(shape, in.options()));
    finish(group_->allgather(outputs, inputs));
    int64_t offset = 0;
    for (int i = 0; i < size(); ++i) {
      out.narrow(0, offset, dim0_sizes[i]).copy_(outputs[0][i].narrow(0, 0, dim0_sizes[i]));
      offset += dim0_sizes[i];
    }
  }

  void do_reduce_scatter(const torch::Tensor& in, torch::Tensor& out,
                         const std::vector<int64_t>& dim0_sizes, ReduceOp op) override {
    if (in.numel() == 0) return;
    torch::Tensor reduced = in.clone();
    do_all_reduce(reduced, op);
    int64_t offset = 0;
    for (int i = 0; i < rank(); ++i) offset += dim0_sizes[i];
    out.copy_(reduced.narrow(0, offset, dim0_sizes[rank()]));
  }

  void do_all_to_all(const torch::Tensor& in, torch::Tensor& out,
                     const std::vector<int64_t>& send_sizes,
                     const std::vector<int64_t>& recv_sizes) override {
    at::Tensor input = movable(in), output = movable(out);
    std::vector<int64_t> in_splits = send_sizes, out_splits = recv_sizes;
    finish(group_->alltoall_base(output, input, out_splits, in_splits));
  }

  void do_broadcast(torch::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{movable(tensor)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    finish(group_->broadcast(tensors, options));
  }

  void do_send(const torch::Tensor& tensor, int dst, int tag) override {
    std::vector<at::Tensor> tensors{movable(tensor)};
    finish(group_->send(tensors, dst, tag));
  }

  void do_recv(torch::Tensor& tensor, int src, int tag) override {
    std::vector<at::Tensor> tensors{movable(tensor)};
    finish(group_->recv(tensors, src, tag));
  }

  void do_send_recv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor, int src,
                    int tag) override {
    std::vector<at::Tensor> outgoing{movable(send_tensor)}, incoming{movable(recv_tensor)};
    auto sent = group_->send(outgoing, dst, tag);
    auto received = group_->recv(incoming, src, tag);
    finish(sent);
    finish(received);
  }

  void do_barrier() override { finish(group_->barrier()); }

  std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int color,
                                         const std::string& name) override {
    const int new_rank =
        static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    // Each split gets its own key space in the store: "<parent>/split<k>/color<c>/".
    const std::string prefix =
        prefix_ + "split" + std::to_string(splits_++) + "/color" + std::to_string(color) + "/";
    return std::make_shared<GlooCommunicator>(store_, prefix, new_rank,
                                              static_cast<int>(members.size()), device_, name);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  std::shared_ptr<::gloo::transport::Device> device_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  int splits_ = 0;
};

}  // namespace

namespace detail {

namespace {
// Ends the process with `message` if it is still alive `seconds` from now (unless dismissed by
// then). LibTorch 1.13's TCPStore client waits for each reply without a timeout: a rank whose
// MASTER_PORT is held by a process that accepts connections but never answers (not a store, or a
// store whose process is stopped) would wait forever inside a store call, where no deadline of
// ours can reach it.
class Deadline {
 public:
  Deadline(double seconds, std::string message)
      : thread_([this, seconds, message = std::move(message)] {
          std::unique_lock<std::mutex> lock(mutex_);
          const auto limit = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
          if (wake_.wait_for(lock, limit, [this] { return dismissed_; })) return;
          const std::string line = "fivefold: error: " + message + "\n";
          std::fputs(line.c_str(), stderr);
          std::fflush(stderr);
          std::_Exit(1);
        }) {}
  ~Deadline() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dismissed_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  Deadline(const Deadline&) = delete;
  Deadline& operator=(const Deadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool dismissed_ = false;
  std::thread thread_;  // last: starts once the members it uses exist
};

// Every rank announces itself in the store before Gloo connects the ranks, so that a rendezvous
// that cannot complete says why: more arrivals than ranks (a second job on the same
// MASTER_PORT), or, after FIVEFOLD_COMM_TIMEOUT, which ranks never came.
void meet(c10d::Store& store, int rank, int size, const std::string& where) {
  const double timeout = comm_timeout_seconds();
  // Past its own deadline (below) and the store's, a rank still in a store call is waiting for
  // a reply that will not come.
  const Deadline stuck(timeout + 8.0,
                       "Gloo rendezvous at " + where + " as rank " + std::to_string(rank) +
                           ": no reply from the rendezvous store within " +
                           std::to_string(static_cast<int>(timeout + 8.0)) +
                           " s; is the port held by a process that is not this job's rank 0 "
                           "(or is rank 0 stopped)?");
  std::ostringstream seconds;
  seconds << timeout;
  try {
    const int64_t arrived = store.add("fivefold/arrivals", 1);
    FIVEFOLD_CHECK(arrived <= size, "Gloo rendezvous at ", where, ": ", arrived,
                   " processes joined a job of ", size,
                   " ranks: another job uses the same rendezvous (MASTER_PORT); give each job "
                   "its own");
    store.set("fivefold/arrived/" + std::to_string(rank), std::vector<uint8_t>{1});
    // Rank 0 serves a TCPStore: it waits 3 s longer, so that the others (which may have arrived
    // later) can still ask it who is missing when they give up.
    const double wait = timeout + (rank == 0 ? 3.0 : 0.0);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(wait * 1000));
    while (store.add("fivefold/arrivals", 0) < size) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::string missing;
        for (int r = 0; r < size; ++r) {
          if (!store.check({"fivefold/arrived/" + std::to_string(r)}))
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        throw Error("Gloo rendezvous at " + where + ": rank(s) " + missing + " of " +
                    std::to_string(size) + " never arrived within " + seconds.str() +
                    " s (FIVEFOLD_COMM_TIMEOUT); were they started, with the same WORLD_SIZE "
                    "and MASTER_ADDR/MASTER_PORT?");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // the store itself failed (rank 0 gave up or died)
    throw Error("Gloo rendezvous at " + where + ": the rendezvous store failed while rank " +
                std::to_string(rank) + " waited for the " + std::to_string(size) +
                " ranks (rank 0, which serves it, gave up or died): " + e.what());
  }
}

// When process `pid` started, in clock ticks after boot (/proc/<pid>/stat, field 22); -1 when
// it does not exist or cannot be read. With the pid it names one process for good: a pid the
// kernel hands out again belongs to a process with a later start.
long long process_start_time(long pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return -1;
  const auto name_end = stat.rfind(')');  // field 2, the command, may hold spaces and ')'
  if (name_end == std::string::npos) return -1;
  std::istringstream fields(stat.substr(name_end + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return std::atoll(field.c_str());
  }
  return -1;
}

// Rendezvous files of jobs whose launcher is gone (a job that crashed never removes its own): the
// name ends in the launcher's pid and start time, so a file whose pid no longer runs, or runs a
// later process that was given the same pid, belongs to no running job.
void remove_stale_rendezvous_files(const std::filesystem::path& dir) {
  const std::string prefix = "fivefold-rendezvous-";
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const auto last = name.rfind('-');
    const auto before =
        last == std::string::npos || last == 0 ? std::string::npos : name.rfind('-', last - 1);
    if (before == std::string::npos || before < prefix.size()) continue;  // not one of ours
    long pid = 0;
    long long start = 0;
    try {
      pid = std::stol(name.substr(before + 1, last - before - 1));
      start = std::stoll(name.substr(last + 1));
    } catch (const std::exception&) {
      continue;  // not one of ours
    }
    if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) continue;
    const bool running = ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH;
    const long long started = process_start_time(pid);
    // A pid that runs but whose start cannot be read (another user's /proc hidden) is kept.
    if (running && (started < 0 || started == start)) continue;
    if (std::filesystem::remove(entry.path(), error))
      fivefold::log(LogLevel::Info)
          << "removed the rendezvous file of a finished job: " << entry.path();
  }
}

std::string address_text(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw =
      address->sa_family == AF_INET
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  return ::inet_ntop(address->sa_family, raw, text, sizeof(text)) != nullptr ? text : "";
}

bool is_loopback(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "::1";
}

// The address a machine of a job that spans several machines listens on for Gloo: the source
// address of its route to rank 0's machine (a UDP socket "connected" there: no packet is sent),
// found for MASTER_ADDR's first address that is not a loopback. On rank 0's own machine the
// route may be the loopback (Debian's /etc/hosts names the host 127.0.1.1, and MASTER_ADDR may
// name nothing else there): then the first interface that is up and not a loopback, said in the
// log. GLOO_SOCKET_IFNAME chooses the interface instead of either.
std::string gloo_listen_address(const std::string& master, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int status =
      ::getaddrinfo(master.c_str(), std::to_string(port > 0 ? port : 9).c_str(), &hints, &found);
  FIVEFOLD_CHECK(status == 0 && found != nullptr, "Gloo: cannot resolve MASTER_ADDR '", master,
                 "': ", ::gai_strerror(status));
  std::string address;
  for (addrinfo* a = found; a != nullptr && address.empty(); a = a->ai_next) {
    if (is_loopback(address_text(a->ai_addr))) continue;
    const int fd = ::socket(a->ai_family, a->ai_socktype, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      address = address_text(reinterpret_cast<const sockaddr*>(&local));
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (!address.empty()) return address;  // a route to another address leaves from no loopback
  ifaddrs* interfaces = nullptr;
  std::string name;
  if (::getifaddrs(&interfaces) == 0) {
    for (ifaddrs* i = interfaces; i != nullptr && name.empty(); i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
      address = address_text(i->ifa_addr);
      name = i->ifa_name;
    }
    ::freeifaddrs(interfaces);
  }
  FIVEFOLD_CHECK(!name.empty(), "Gloo: MASTER_ADDR '", master, "' is a loopback address here ",
                 "and this machine has no other interface up, yet the job spans several machines");
  fivefold::log(LogLevel::Info) << "Gloo listens on " << address << " (" << name
                                << "): MASTER_ADDR '" << master << "' is a loopback address on "
                                << "this machine; set GLOO_SOCKET_IFNAME to choose the interface";
  return address;
}

}  // namespace

namespace {
char g_rendezvous_path[4096];  // the job's FileStore file, if any (fixed storage: see below)
}  // namespace

void forget_rendezvous() {
  if (g_rendezvous_path[0] != '\0') ::unlink(g_rendezvous_path);
}

CommunicatorPtr start_gloo_world(const LaunchInfo& launch) {
  c10::intrusive_ptr<c10d::Store> store;
  std::string where;
  if (!launch.master_addr.empty() && launch.master_port > 0) {
    // torchrun: rank 0 serves a TCPStore at MASTER_ADDR:MASTER_PORT (the launcher chose the port).
    // The server does not wait for the others here: meet() does, and can say who is missing.
    where = launch.master_addr + ":" + std::to_string(launch.master_port);
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(launch.master_port);
    // torchrun's agent may already serve a store there (TORCHELASTIC_USE_AGENT_STORE=True, as
    // PyTorch's own workers check): then every rank is a client of it.
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    options.isServer = launch.rank == 0 && !(agent_store && std::string(agent_store) == "True");
    options.numWorkers = c10::nullopt;
    options.timeout = gloo_timeout();
    try {
      store = c10::make_intrusive<c10d::TCPStore>(launch.master_addr, options);
    } catch (const std::exception& e) {
      throw Error("Gloo rendezvous at " + where + " as rank " + std::to_string(launch.rank) +
                  " of " + std::to_string(launch.size) +
                  (options.isServer ? " (serving it)" : " (connecting to rank 0)") + ": " +
                  e.what());
    }
  } else if (!launch.job_id.empty()) {
    // A file in one machine's /tmp is no meeting place for ranks on several machines: each
    // machine's ranks would wait on their own file until the timeout. Say so at once instead.
    FIVEFOLD_CHECK(launch.local_size == launch.size, "Gloo under ", launch.launcher, ": this job",
                   " spans several machines (", launch.local_size, " of its ", launch.size,
                   " ranks run on this one), and without MASTER_ADDR the ranks meet through a ",
                   "file, which works on one machine only. Give every rank rank 0's machine and a ",
                   "free port: ",
                   launch.launcher == "mpirun"
                       ? "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ..."
                       : "export MASTER_ADDR=<host of rank 0> MASTER_PORT=29500");
    // mpirun/srun without MASTER_ADDR: a store in a file named after the job and its launcher
    // (the ranks' parent process: pid and start time), so two jobs on one machine never meet (no
    // port to collide on), not even a job whose launcher got the pid of a crashed job's, whose
    // file is still there. Single machine only.
    const auto dir = std::filesystem::temp_directory_path();
    const long launcher = static_cast<long>(::getppid());
    if (launch.local_rank == 0) remove_stale_rendezvous_files(dir);
    const std::string path =
        (dir / ("fivefold-rendezvous-" + launch.job_id + "-" + std::to_string(launcher) + "-" +
                std::to_string(process_start_time(launcher))))
            .string();
    where = "'" + path + "'";
    store = c10::make_intrusive<c10d::FileStore>(path, launch.size);
    if (path.size() < sizeof(g_rendezvous_path))
      std::memcpy(g_rendezvous_path, path.c_str(), path.size() + 1);
  } else if (launch.size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    throw Error(
        "Gloo backend: no rendezvous. Set MASTER_ADDR and MASTER_PORT (torchrun does), "
        "or launch with mpirun/srun");
  }
  if (launch.size > 1) meet(*store, launch.rank, launch.size, where);
  std::shared_ptr<::gloo::transport::Device> device;
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
    device = c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  } else if (launch.local_size == launch.size) {
    device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");  // all on this machine
  } else {
    // Several machines, so the rendezvous above was MASTER_ADDR's (a file is refused there).
    // Gloo's default (this machine's hostname) is a loopback address on many systems (Debian
    // maps the hostname to 127.0.1.1), which the other machines cannot reach.
    device = c10d::ProcessGroupGloo::createDeviceForHostname(
        gloo_listen_address(launch.master_addr, launch.master_port));
  }
  return std::make_shared<GlooCommunicator>(store, "world/", launch.rank, launch.size, device,
                                            "world");
}

}  // namespace detail
}  // namespace fivefold::dist
