#pragma once
/// @file io.h
/// @brief Checkpoint files: safetensors (Hugging Face's tensor format) and config.json.
///
/// safetensors layout: an 8-byte little-endian header length N, then N bytes of JSON mapping each
/// tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to the data
/// section; an optional "__metadata__" maps strings to strings), then the raw little-endian data.
/// Readers reject truncated files, offsets outside the data, overlapping or unused bytes, unknown
/// dtypes and shape/size mismatches, with a message naming the file and the problem.
///
/// Every write is atomic: the file is written to `<path>.tmp.<pid>`, flushed, then renamed over
/// `<path>`, so a crash never leaves a half-written file where a good one was.

#include <torch/torch.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace fivefold::io {

/// Named tensors in a stable (sorted) order.
using TensorMap = std::map<std::string, torch::Tensor>;

/// Writes `tensors` (CPU; any of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL) and optional string
/// metadata to `path` atomically.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Reads every tensor of a safetensors file. Throws fivefold::Error on a malformed file.
TensorMap load_safetensors(const std::string& path);

/// Reads the "__metadata__" entry of a safetensors file (empty if absent).
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

/// Parses safetensors bytes already in memory (`what` names them in errors).
TensorMap parse_safetensors(const std::string& bytes, const std::string& what);

/// Reads a JSON file (e.g. config.json). Throws fivefold::Error naming the file on a parse error.
nlohmann::json read_json(const std::string& path);

/// Writes JSON, indented, atomically.
void write_json(const std::string& path, const nlohmann::json& value);

/// Writes `contents` to `path` atomically (temporary file + rename).
void write_file_atomic(const std::string& path, const std::string& contents);

/// Reads a whole file. Throws fivefold::Error if it cannot be opened.
std::string read_file(const std::string& path);

/// A file's size and a 64-bit FNV-1a hash of its bytes, as "N bytes, fnv1a 0123456789abcdef":
/// whether two machines hold the same file, without sending it. Read in pieces of 1 MiB. Throws
/// fivefold::Error if it cannot be opened.
std::string file_fingerprint(const std::string& path);

/// This machine's host name (gethostname).
std::string host_name();

/// Puts the complete folder `from` at `to` in one atomic step: when `to` exists the two are
/// exchanged (Linux renameat2 RENAME_EXCHANGE) and the old contents, now at `from`, are deleted;
/// at every instant `to` is either the old folder or the new one, never missing or half written.
void replace_directory(const std::string& from, const std::string& to);

/// A folder owned by one process while the object lives: `dir`/.lock holds the owner's pid and
/// host, created exclusively (O_EXCL), so of two processes only one can own the folder. The
/// owner's thread refreshes the file's modification time every `refresh_seconds`: its heartbeat.
/// A lock left by a dead process is taken over with a warning: on this host, one whose pid no
/// longer exists; on another (whose processes cannot be seen from here), one not refreshed for
/// `stale_seconds`, measured by the clock of the file system that holds it (a file made beside
/// it), so that the machines' clocks need not agree. A live owner, or another host's lock
/// refreshed more recently, is a fivefold::Error naming it. The lock file is removed when the
/// object goes away, or by release_held_locks_now.
class DirectoryLock {
 public:
  /// The heartbeat's period: how often the owner refreshes its lock file's time.
  static constexpr double kRefreshSeconds = 10;
  /// How long another host's lock may go without a refresh before its run counts as gone.
  static constexpr double kStaleSeconds = 120;
  /// Takes the lock of `dir` (which must exist).
  explicit DirectoryLock(const std::string& dir, double refresh_seconds = kRefreshSeconds,
                         double stale_seconds = kStaleSeconds);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  struct Heartbeat;  // the refreshing thread
  std::string path_;
  std::unique_ptr<Heartbeat> heartbeat_;
};

/// Removes the lock files this process holds, using only async-signal-safe calls: what a signal
/// handler does before the process ends (the runtime's SIGINT/SIGTERM handler).
void release_held_locks_now();

}  // namespace fivefold::io
