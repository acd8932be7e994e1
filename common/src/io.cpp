#include "fivefold/io.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "fivefold/error.h"
#include "fivefold/log.h"

namespace fivefold::io {
namespace {

struct DtypeName {
  torch::ScalarType type;
  const char* name;
};

constexpr DtypeName kDtypes[] = {
    {torch::kDouble, "F64"},    {torch::kFloat, "F32"}, {torch::kHalf, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kLong, "I64"},  {torch::kInt, "I32"},
    {torch::kShort, "I16"},     {torch::kChar, "I8"},   {torch::kByte, "U8"},
    {torch::kBool, "BOOL"},
};

const char* dtype_name(torch::ScalarType type, const std::string& tensor) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
  throw Error("safetensors: tensor '" + tensor + "' has dtype " + c10::toString(type) +
              ", which safetensors files here do not store");
}

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

}  // namespace

namespace {
// `path` opened to read its bytes; a folder or a file that cannot be opened is an error.
std::ifstream open_to_read(const std::string& path) {
  FIVEFOLD_CHECK(!std::filesystem::is_directory(path), "'", path, "' is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  FIVEFOLD_CHECK(in.good(), "cannot open '", path, "': ", std::strerror(errno));
  return in;
}
}  // namespace

std::string read_file(const std::string& path) {
  std::ifstream in = open_to_read(path);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  const std::string temporary = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  FIVEFOLD_CHECK(fd >= 0, "cannot write '", path, "': ", std::strerror(errno));
  size_t written = 0;
  while (written < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      ::unlink(temporary.c_str());
      throw Error("writing '" + path + "' failed: " + std::strerror(error));
    }
    written += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || ::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    throw Error("writing '" + path + "' failed: " + std::strerror(error));
  }
}

void replace_directory(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) == 0) return;  // `to` did not exist (or was empty)
  FIVEFOLD_CHECK(errno == EEXIST || errno == ENOTEMPTY, "cannot move '", from, "' to '", to,
                 "': ", std::strerror(errno));
  FIVEFOLD_CHECK(::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0,
                 "cannot replace '", to, "' with '", from, "': ", std::strerror(errno));
  std::filesystem::remove_all(from);  // the old contents
}

std::string file_fingerprint(const std::string& path) {
  std::ifstream in = open_to_read(path);
  uint64_t hash = 14695981039346656037ull;  // FNV-1a's offset basis
  int64_t bytes = 0;
  std::vector<char> piece(1 << 20);
  while (in.read(piece.data(), static_cast<std::streamsize>(piece.size())) || in.gcount() > 0) {
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      hash ^= static_cast<unsigned char>(piece[static_cast<size_t>(i)]);
      hash *= 1099511628211ull;
    }
    bytes += in.gcount();
  }
  FIVEFOLD_CHECK(in.eof(), "cannot read '", path, "': ", std::strerror(errno));
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));
  return std::to_string(bytes) + " bytes, fnv1a " + hex;
}

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

namespace {
// The lock files this process holds: fixed storage, so that a signal handler can read the paths
// without allocating.
struct HeldLock {
  char path[4096];
  bool held;  // false: a free slot
};
HeldLock g_held[16];
std::mutex g_held_mutex;

HeldLock* find_held(const std::string& path) {
  for (auto& h : g_held)
    if (h.held && path == h.path) return &h;
  return nullptr;
}

// Seconds since `path` was last modified, by the clock of the file system that holds it (the
// modification time of a file made now in `dir`); 0 when either cannot be read.
double seconds_since_modified(const std::string& path, const std::string& dir) {
  struct stat lock_stat {};
  if (::stat(path.c_str(), &lock_stat) != 0) return 0;
  const std::string probe = dir + "/.lock.probe." + std::to_string(::getpid());
  struct stat now_stat {};
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const bool made = fd >= 0 && ::fstat(fd, &now_stat) == 0;
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  if (!made) return 0;
  return static_cast<double>(now_stat.st_mtim.tv_sec - lock_stat.st_mtim.tv_sec) +
         1e-9 * static_cast<double>(now_stat.st_mtim.tv_nsec - lock_stat.st_mtim.tv_nsec);
}
}  // namespace

struct DirectoryLock::Heartbeat {
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  std::thread thread;
};

DirectoryLock::DirectoryLock(const std::string& dir, double refresh_seconds, double stale_seconds)
    : path_(dir + "/.lock") {
  std::lock_guard<std::mutex> held(g_held_mutex);
  HeldLock* slot = nullptr;
  for (auto& h : g_held)
    if (!h.held && slot == nullptr) slot = &h;
  FIVEFOLD_CHECK(slot != nullptr && path_.size() < sizeof(slot->path), "cannot lock '", dir,
                 "': too many folders locked, or too long a name");
  const std::string me = std::to_string(::getpid()) + " " + host_name() + "\n";
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd >= 0) {
      const bool written = ::write(fd, me.data(), me.size()) == static_cast<ssize_t>(me.size());
      ::close(fd);
      FIVEFOLD_CHECK(written, "cannot write '", path_, "'");
      std::memcpy(slot->path, path_.c_str(), path_.size() + 1);
      slot->held = true;
      heartbeat_ = std::make_unique<Heartbeat>();
      const auto period = std::chrono::duration<double>(refresh_seconds);
      heartbeat_->thread = std::thread([beat = heartbeat_.get(), path = path_, period] {
        std::unique_lock<std::mutex> lock(beat->mutex);
        while (!beat->wake.wait_for(lock, period, [beat] { return beat->stop; }))
          ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);  // now, by the file system's clock
      });
      return;
    }
    FIVEFOLD_CHECK(errno == EEXIST, "cannot create '", path_, "': ", std::strerror(errno));
    std::istringstream owner(read_file(path_));
    long pid = 0;
    std::string host;
    owner >> pid >> host;
    std::string why;  // why the owner's run is gone
    if (host == host_name()) {
      FIVEFOLD_CHECK(pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH, "'", dir,
                     "' is in use by process ", pid, " on ", host, " (its lock file '", path_,
                     "'); choose another folder, or delete the lock file if that run is "
                     "gone");
      why = "which no longer exists";
    } else {
      const double age = seconds_since_modified(path_, dir);
      FIVEFOLD_CHECK(age > stale_seconds, "'", dir, "' is in use by process ", pid, " on ", host,
                     " (its lock file '", path_, "', refreshed ", static_cast<int64_t>(age),
                     " s ago); choose another folder. A run refreshes its lock every ",
                     refresh_seconds, " s: one another machine has not refreshed for ",
                     stale_seconds, " s is taken over (that run is gone), or delete it now");
      why = "not refreshed for " + std::to_string(static_cast<int64_t>(age)) + " s";
    }
    log(LogLevel::Warn) << "'" << dir << "': taking over the lock of process " << pid << " on "
                        << host << ", " << why;
    ::unlink(path_.c_str());
  }
  throw Error("cannot lock '" + dir + "': another process took it over at the same time");
}

DirectoryLock::~DirectoryLock() {
  if (heartbeat_) {
    {
      std::lock_guard<std::mutex> lock(heartbeat_->mutex);
      heartbeat_->stop = true;
    }
    heartbeat_->wake.notify_all();
    heartbeat_->thread.join();
  }
  std::lock_guard<std::mutex> held(g_held_mutex);
  HeldLock* mine = find_held(path_);
  if (mine == nullptr) return;
  mine->held = false;
  ::unlink(path_.c_str());
}

void release_held_locks_now() {
  for (auto& h : g_held)
    if (h.held) ::unlink(h.path);
}

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    FIVEFOLD_CHECK(name != "__metadata__", "safetensors: '__metadata__' is reserved");
    FIVEFOLD_CHECK(tensor.defined(), "safetensors: tensor '", name, "' is undefined");
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(cpu.numel()) * cpu.element_size();
    header[name] = {{"dtype", dtype_name(cpu.scalar_type(), name)},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(cpu);
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // pad so the data starts 8-byte aligned
  std::string contents(8, '\0');
  uint64_t length = json.size();
  for (int i = 0; i < 8; ++i) contents[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  contents += json;
  contents.reserve(contents.size() + offset);
  for (const auto& t : data) {
    contents.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
  write_file_atomic(path, contents);
}

namespace {

struct Header {
  nlohmann::json json;
  uint64_t data_start;
};

Header parse_header(const std::string& bytes, const std::string& what) {
  FIVEFOLD_CHECK(bytes.size() >= 8, what, ": not a safetensors file: ", bytes.size(),
                 " bytes, shorter than the 8-byte header length");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(bytes[i]);
  FIVEFOLD_CHECK(length <= kMaxHeaderBytes, what, ": header length ", length,
                 " is implausible (limit 100 MiB): not a safetensors file?");
  FIVEFOLD_CHECK(length <= bytes.size() - 8, what, ": truncated: header says ", length,
                 " bytes but only ", bytes.size() - 8, " follow");
  Header header;
  header.data_start = 8 + length;
  try {
    header.json =
        nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(length));
  } catch (const nlohmann::json::exception& e) {
    throw Error(what + ": header is not valid JSON: " + e.what());
  }
  FIVEFOLD_CHECK(header.json.is_object(), what, ": header is not a JSON object");
  return header;
}

}  // namespace

TensorMap parse_safetensors(const std::string& bytes, const std::string& what) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");
  const Header header = parse_header(bytes, what);
  const uint64_t data_size = bytes.size() - header.data_start;

  struct Entry {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Entry> entries;
  TensorMap tensors;
  for (const auto& [name, info] : header.json.items()) {
    if (name == "__metadata__") {
      FIVEFOLD_CHECK(info.is_object(), what, ": __metadata__ must be an object of strings");
      for (const auto& [key, value] : info.items()) {
        FIVEFOLD_CHECK(value.is_string(), what, ": __metadata__ value for '", key,
                       "' is not a string");
      }
      continue;
    }
    const std::string where = what + ": tensor '" + name + "'";
    FIVEFOLD_CHECK(info.is_object() && info.contains("dtype") && info.contains("shape") &&
                       info.contains("data_offsets"),
                   where, " needs dtype, shape and data_offsets");
    FIVEFOLD_CHECK(info["dtype"].is_string(), where, ": dtype is not a string");
    const std::string dtype = info["dtype"];
    const DtypeName* found = nullptr;
    for (const auto& d : kDtypes) {
      if (dtype == d.name) found = &d;
    }
    FIVEFOLD_CHECK(found != nullptr, where, ": unsupported dtype '", dtype, "'");
    FIVEFOLD_CHECK(info["shape"].is_array(), where, ": shape is not a list");
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    for (const auto& dim : info["shape"]) {
      FIVEFOLD_CHECK(dim.is_number_unsigned(), where,
                     ": shape entries must be non-negative integers");
      shape.push_back(dim.get<int64_t>());
      numel *= dim.get<uint64_t>();
    }
    const auto& offsets = info["data_offsets"];
    FIVEFOLD_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                       offsets[1].is_number_unsigned(),
                   where, ": data_offsets must be [begin, end]");
    const uint64_t begin = offsets[0], end = offsets[1];
    FIVEFOLD_CHECK(begin <= end, where, ": data_offsets [", begin, ", ", end, "] are reversed");
    FIVEFOLD_CHECK(end <= data_size, where, ": data [", begin, ", ", end,
                   ") runs past the end of the file (", data_size, " data bytes): truncated?");
    const uint64_t element = c10::elementSize(found->type);
    FIVEFOLD_CHECK(end - begin == numel * element, where, ": shape and ", dtype, " need ",
                   numel * element, " bytes but data_offsets span ", end - begin);
    torch::Tensor tensor = torch::empty(shape, torch::TensorOptions().dtype(found->type));
    if (end > begin)
      std::memcpy(tensor.data_ptr(), bytes.data() + header.data_start + begin, end - begin);
    tensors[name] = tensor;
    entries.push_back({begin, end, name});
  }
  // The tensors must tile the data section exactly: no overlap, no unused bytes.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const auto& e : entries) {
    FIVEFOLD_CHECK(e.begin == covered, what, ": tensor '", e.name, "' starts at byte ", e.begin,
                   " but the previous one ends at ", covered, " (overlapping or unused bytes)");
    covered = e.end;
  }
  FIVEFOLD_CHECK(covered == data_size, what, ": ", data_size - covered,
                 " bytes after the last tensor belong to none (corrupt or truncated file)");
  return tensors;
}

TensorMap load_safetensors(const std::string& path) {
  return parse_safetensors(read_file(path), path);
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  const Header header = parse_header(read_file(path), path);
  std::map<std::string, std::string> metadata;
  if (header.json.contains("__metadata__")) {
    for (const auto& [key, value] : header.json["__metadata__"].items()) {
      FIVEFOLD_CHECK(value.is_string(), path, ": __metadata__ value for '", key,
                     "' is not a string");
      metadata[key] = value.get<std::string>();
    }
  }
  return metadata;
}

nlohmann::json read_json(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

void write_json(const std::string& path, const nlohmann::json& value) {
  write_file_atomic(path, value.dump(2) + "\n");
}

}  // namespace fivefold::io
