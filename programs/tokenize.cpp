// fivefold-tokenize (run as `fivefold tokenize`): a UTF-8 text file into a nanoGPT-style .bin of
// uint16 token ids with a SentencePiece model, or a SentencePiece model trained on the text.
//
//   fivefold tokenize --tokenizer tokenizer.model --input corpus.txt --output corpus.bin
//   fivefold tokenize --train-tokenizer my.model --vocab-size 2000 --input corpus.txt [--output ..]
//
// A program of its own, linked with SentencePiece and CLI11 only: libsentencepiece carries its
// own protobuf, which cannot share a process with LibTorch's (the two crash at load).

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::runtime_error(message); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Little-endian uint16 ids, as numpy's tofile writes them (what `fivefold train --data` reads),
// written under a temporary name and renamed, so a failed run leaves no half file.
void write_bin(const std::string& path, const std::vector<int>& ids) {
  std::string bytes;
  bytes.reserve(2 * ids.size());
  for (int id : ids) {
    if (id < 0 || id > 65535) fail("token id " + std::to_string(id) + " does not fit in uint16");
    bytes.push_back(static_cast<char>(id & 0xff));
    bytes.push_back(static_cast<char>(id >> 8));
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write '" + tmp + "'");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);  // a full disk leaves no part of the file
      fail("cannot write '" + path + "' (disk full?)");
    }
  }
  std::filesystem::rename(tmp, path);
}

int run(int argc, char** argv) {
  CLI::App app{
      "Turns a UTF-8 text file into a nanoGPT-style .bin of uint16 token ids with a SentencePiece "
      "model (a Llama-2 tokenizer.model, or one trained here with --train-tokenizer), for "
      "`fivefold train --data FILE.bin --vocab N`.",
      "fivefold tokenize"};
  std::string input, output, tokenizer, train_tokenizer;
  int vocab_size = 2000;
  bool no_bos = false;
  app.add_option("--input", input, "the UTF-8 text file")->required()->check(CLI::ExistingFile);
  app.add_option("--output", output, "the .bin to write (default: the input's name with .bin)");
  app.add_option("--tokenizer", tokenizer, "a SentencePiece model file (.model)");
  app.add_option("--train-tokenizer", train_tokenizer,
                 "instead: train a SentencePiece model (BPE, byte fallback) on --input and write "
                 "it to this file (ends in .model)");
  app.add_option("--vocab-size", vocab_size, "with --train-tokenizer: the vocabulary")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  app.add_flag("--no-bos", no_bos,
               "do not start each line with the tokenizer's beginning-of-sequence id");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    fail(std::string(e.what()) + " (see --help)");   // as every other command says it, exit 1
  }
  if (tokenizer.empty() == train_tokenizer.empty())
    fail("give exactly one of --tokenizer and --train-tokenizer");

  if (!train_tokenizer.empty()) {
    const std::string suffix = ".model";
    if (train_tokenizer.size() <= suffix.size() ||
        train_tokenizer.compare(train_tokenizer.size() - suffix.size(), suffix.size(), suffix) != 0)
      fail("--train-tokenizer names the model file to write; it must end in .model");
    const std::string prefix = train_tokenizer.substr(0, train_tokenizer.size() - suffix.size());
    // byte_fallback: text the pieces do not cover still encodes (as bytes), never as <unk>.
    const std::string spec = "--input=" + input + " --model_prefix=" + prefix +
                             " --vocab_size=" + std::to_string(vocab_size) +
                             " --model_type=bpe --byte_fallback=true --character_coverage=1.0"
                             " --minloglevel=1";
    const auto status = sentencepiece::SentencePieceTrainer::Train(spec);
    if (!status.ok()) fail("SentencePiece could not train on '" + input + "': " + status.ToString());
    std::printf("wrote %s (and %s.vocab): %d pieces\n", train_tokenizer.c_str(), prefix.c_str(),
                vocab_size);
    if (output.empty()) return 0;
    tokenizer = train_tokenizer;
  }

  sentencepiece::SentencePieceProcessor processor;
  const auto loaded = processor.Load(tokenizer);
  if (!loaded.ok()) fail("'" + tokenizer + "' is not a SentencePiece model: " + loaded.ToString());
  const int vocab = processor.GetPieceSize();
  if (vocab > 65536) fail("the tokenizer has " + std::to_string(vocab) + " pieces, more than a "
                          "uint16 .bin can hold");
  if (output.empty()) output = std::filesystem::path(input).replace_extension(".bin").string();

  const std::string text = read_file(input);
  std::vector<int> tokens;
  std::stringstream lines(text);
  std::string line;
  const bool bos = !no_bos && processor.bos_id() >= 0;
  long long n_lines = 0;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    std::vector<int> ids;
    const auto status = processor.Encode(line, &ids);
    if (!status.ok()) fail("line " + std::to_string(n_lines + 1) + ": " + status.ToString());
    if (bos) tokens.push_back(processor.bos_id());
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    ++n_lines;
  }
  if (tokens.empty()) fail("'" + input + "' has no text to tokenize");
  write_bin(output, tokens);
  std::printf("wrote %s: %zu tokens from %lld lines (%zu bytes of text, %.2f bytes a token); "
              "train with --data %s --vocab %d\n",
              output.c_str(), tokens.size(), n_lines, text.size(),
              static_cast<double>(text.size()) / static_cast<double>(tokens.size()),
              output.c_str(), vocab);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fivefold tokenize: error: %s\n", e.what());
    return 1;
  }
}
