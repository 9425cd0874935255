// Embedding example: speculative decoding of a Llama checkpoint in C++, on token ids, with the
// public API of an installed pyspec (find_package(pyspec), pyspec::core) and nothing else.
//
//   pyspec_speculate MODEL_DIR PROMPT_IDS MAX_NEW_TOKENS [MAX_DRAFT=5]
//     MODEL_DIR       a Hugging Face Llama / Mistral / Qwen2 folder: config.json and
//                     model.safetensors (or model.safetensors.index.json and its shards);
//                     F32, F16 and BF16 tensors, run in float32
//     PROMPT_IDS      comma-separated token ids, e.g. 1,15043,29892
//     MAX_NEW_TOKENS  tokens to generate (greedy; no stop token)
//     MAX_DRAFT       most n-gram draft tokens per step, 0..63 (0: plain decoding)
//   prints the generated ids space-separated on one line, then `steps=N accepted=M` (verification
//   steps, draft tokens accepted); timings go to stderr.
//
// What it does, as pyspec's engine does for one greedy request with draft="ngram":
//   * the prompt but its last token is prefilled as one causal chunk (PlanAttention with no tree,
//     DecoderLayers, MaterializeKV into the pages); the last prompt token is the first step's root;
//   * each step drafts a chain by prompt lookup (the longest n <= 3 token suffix of the context
//     that occurred before, its latest occurrence, the tokens that followed it), runs root + chain
//     as a token tree (chain parents) in one DecoderLayers call, the final RmsNorm and the lm_head
//     Linear on every row, and AcceptTrees' greedy walk straight from the logits (the longest
//     prefix of the chain whose tokens are the argmax of the row before, then the bonus token);
//   * the root's and the accepted nodes' K/V go from the step's scratch into the pages
//     (MaterializeKV); the emitted tokens join the context; the last one is the next root;
//   * matrices that are exactly 4-bit or 8-bit blocks (GGUF conversions) or 16-bit values
//     (checkpoints stored in float16 / bfloat16) are also held as codes and read through the
//     packed kernels, the same bits (PYSPEC_PACKED_WEIGHTS=0: float32 only).
// Tree rows are scored bit for bit as one-token decoding of their path would score them
// (attention.h), so the output is the target's greedy decoding whatever the drafts were.
//
// Agreement with pyspec.LLM(model_dir, draft="ngram") for the same prompt ids (greedy,
// ignore_eos): the same kernels in the same order, so the same logits, except where the bits of
// an input differ: the RoPE tables (computed here as pyspec computes them in float32, but with the
// C library's pow/cos/sin, where torch's vectorized float32 pow/cos/sin can differ in the last
// bit) and a prefill longer than the core's fast rows (Python runs those layers' matrices through
// torch's GEMM). A last-bit difference moves the logits by rounding noise, which changes a greedy
// token only where the top-2 logits are that close (a near-tie); the ids then diverge from there.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyspec/acceptance.h"
#include "pyspec/attention.h"
#include "pyspec/check.h"
#include "pyspec/decoder.h"
#include "pyspec/kv_ops.h"
#include "pyspec/layer_ops.h"
#include "pyspec/linear.h"
#include "pyspec/tensor_view.h"
#include "pyspec/thread_pool.h"
#include "pyspec/tree.h"

namespace {

using pyspec::DType;
using pyspec::TensorView;

[[noreturn]] void Fail(const std::string& msg) { throw std::runtime_error(msg); }

// ---- a small JSON reader (config.json, the safetensors header, the shard index) ---------------

struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  double number = 0;
  bool integral = false;  // a number written without fraction or exponent, within int64
  int64_t integer = 0;
  std::string str;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;  // in file order

  const Json* Get(const std::string& key) const {
    if (kind != kObject) return nullptr;
    for (const auto& m : members) {
      if (m.first == key) return &m.second;
    }
    return nullptr;
  }
};

class JsonParser {
 public:
  JsonParser(const char* begin, const char* end, std::string source)
      : begin_(begin), p_(begin), end_(end), source_(std::move(source)) {}

  Json ParseDocument() {
    Json v = Value(0);
    Space();
    if (p_ != end_) Error("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void Error(const std::string& what) const {
    Fail(source_ + ": invalid JSON at byte " + std::to_string(p_ - begin_) + ": " + what);
  }
  void Space() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  bool Literal(const char* word) {
    const size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n) != 0) return false;
    p_ += n;
    return true;
  }

  Json Value(int depth) {
    if (depth > 64) Error("nested too deeply");
    Space();
    if (p_ == end_) Error("unexpected end of input");
    Json v;
    const char c = *p_;
    if (c == '{') {
      v.kind = Json::kObject;
      ++p_;
      Space();
      if (p_ != end_ && *p_ == '}') {
        ++p_;
        return v;
      }
      for (;;) {
        Space();
        if (p_ == end_ || *p_ != '"') Error("expected a string key");
        std::string key = String();
        Space();
        if (p_ == end_ || *p_ != ':') Error("expected ':'");
        ++p_;
        v.members.emplace_back(std::move(key), Value(depth + 1));
        Space();
        if (p_ != end_ && *p_ == ',') {
          ++p_;
          continue;
        }
        if (p_ != end_ && *p_ == '}') {
          ++p_;
          return v;
        }
        Error("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = Json::kArray;
      ++p_;
      Space();
      if (p_ != end_ && *p_ == ']') {
        ++p_;
        return v;
      }
      for (;;) {
        v.items.push_back(Value(depth + 1));
        Space();
        if (p_ != end_ && *p_ == ',') {
          ++p_;
          continue;
        }
        if (p_ != end_ && *p_ == ']') {
          ++p_;
          return v;
        }
        Error("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind = Json::kString;
      v.str = String();
      return v;
    }
    if (Literal("true")) {
      v.kind = Json::kBool;
      v.boolean = true;
      return v;
    }
    if (Literal("false")) {
      v.kind = Json::kBool;
      return v;
    }
    if (Literal("null")) return v;
    // Python's json module writes these for non-finite floats.
    if (Literal("NaN")) {
      v.kind = Json::kNumber;
      v.number = NAN;
      return v;
    }
    if (Literal("Infinity")) {
      v.kind = Json::kNumber;
      v.number = INFINITY;
      return v;
    }
    if (Literal("-Infinity")) {
      v.kind = Json::kNumber;
      v.number = -INFINITY;
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return Number();
    Error(std::string("unexpected character '") + c + "'");
  }

  Json Number() {
    const char* start = p_;
    bool integral = true;
    if (*p_ == '-') ++p_;
    auto digits = [&] {
      const char* d = p_;
      while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
      if (p_ == d) Error("expected a digit");
    };
    digits();
    if (p_ != end_ && *p_ == '.') {
      integral = false;
      ++p_;
      digits();
    }
    if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
      integral = false;
      ++p_;
      if (p_ != end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      digits();
    }
    const std::string text(start, p_);
    Json v;
    v.kind = Json::kNumber;
    v.number = std::strtod(text.c_str(), nullptr);
    if (integral) {
      errno = 0;
      const long long i = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == 0) {
        v.integral = true;
        v.integer = i;
      }
    }
    return v;
  }

  void AppendUtf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t Hex4() {
    if (end_ - p_ < 4) Error("truncated \\u escape");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i, ++p_) {
      const char h = *p_;
      cp <<= 4;
      if (h >= '0' && h <= '9') {
        cp |= static_cast<uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        cp |= static_cast<uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        cp |= static_cast<uint32_t>(h - 'A' + 10);
      } else {
        Error("bad \\u escape");
      }
    }
    return cp;
  }

  std::string String() {
    ++p_;  // the opening quote
    std::string s;
    for (;;) {
      if (p_ == end_) Error("unterminated string");
      const char c = *p_++;
      if (c == '"') return s;
      if (static_cast<unsigned char>(c) < 0x20) Error("control character in a string");
      if (c != '\\') {
        s += c;
        continue;
      }
      if (p_ == end_) Error("unterminated escape");
      const char e = *p_++;
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': {
          uint32_t cp = Hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && end_ - p_ >= 6 && p_[0] == '\\' && p_[1] == 'u') {
            p_ += 2;
            const uint32_t lo = Hex4();
            if (lo < 0xDC00 || lo >= 0xE000) Error("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          AppendUtf8(s, cp);
          break;
        }
        default: Error(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  std::string source_;
};

// ---- files --------------------------------------------------------------------------------------

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File OpenFile(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) Fail(path + ": cannot open (" + std::strerror(errno) + ")");
  return f;
}

bool FileExists(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  std::fclose(f);
  return true;
}

uint64_t FileSize(std::FILE* f, const std::string& path) {
  if (std::fseek(f, 0, SEEK_END) != 0) Fail(path + ": cannot seek");
  const long n = std::ftell(f);
  if (n < 0) Fail(path + ": cannot tell its size");
  return static_cast<uint64_t>(n);
}

void ReadAt(std::FILE* f, const std::string& path, uint64_t offset, void* out, size_t n) {
  if (std::fseek(f, static_cast<long>(offset), SEEK_SET) != 0 ||
      std::fread(out, 1, n, f) != n) {
    Fail(path + ": cannot read " + std::to_string(n) + " bytes at offset " +
         std::to_string(offset) + " (truncated file?)");
  }
}

Json ReadJsonFile(const std::string& path) {
  File f = OpenFile(path);
  const uint64_t n = FileSize(f.get(), path);
  std::string text(n, '\0');
  if (n > 0) ReadAt(f.get(), path, 0, text.data(), n);
  return JsonParser(text.data(), text.data() + text.size(), path).ParseDocument();
}

// ---- config.json --------------------------------------------------------------------------------

struct Config {
  int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0;
  int64_t head_dim = 0;
  double eps = 1e-6, rope_theta = 10000.0;
  bool tied = false;
  int64_t sliding_window = 0;  // 0: none
  int64_t max_positions = 2048;  // max_position_embeddings (pyspec's default when absent)
};

Config ReadConfig(const std::string& path) {
  const Json j = ReadJsonFile(path);
  if (j.kind != Json::kObject) Fail(path + ": must hold a JSON object");
  auto bad = [&](const std::string& key, const std::string& want) {
    Fail(path + ": '" + key + "' must be " + want);
  };
  // null means "not set", as in pyspec's config reader.
  auto find = [&](const Json& obj, const std::string& key) -> const Json* {
    const Json* v = obj.Get(key);
    return v != nullptr && v->kind != Json::kNull ? v : nullptr;
  };
  auto positive = [&](const std::string& key, const Json* v) -> int64_t {
    if (v == nullptr) Fail(path + ": missing required field '" + key + "'");
    if (v->kind != Json::kNumber || !v->integral || v->integer <= 0 || v->integer > INT32_MAX) {
      bad(key, "a positive integer");
    }
    return v->integer;
  };
  auto real = [&](const std::string& key, const Json* v, double fallback) -> double {
    if (v == nullptr) return fallback;
    if (v->kind != Json::kNumber || !std::isfinite(v->number) || v->number <= 0) {
      bad(key, "a finite number > 0");
    }
    return v->number;
  };
  Config c;
  c.vocab = positive("vocab_size", find(j, "vocab_size"));
  c.hidden = positive("hidden_size", find(j, "hidden_size"));
  c.intermediate = positive("intermediate_size", find(j, "intermediate_size"));
  c.layers = positive("num_hidden_layers", find(j, "num_hidden_layers"));
  c.heads = positive("num_attention_heads", find(j, "num_attention_heads"));
  const Json* kv = find(j, "num_key_value_heads");
  c.kv_heads = kv != nullptr ? positive("num_key_value_heads", kv) : c.heads;
  if (c.heads % c.kv_heads != 0) bad("num_key_value_heads", "a divisor of num_attention_heads");
  if (const Json* hd = find(j, "head_dim")) {
    c.head_dim = positive("head_dim", hd);
  } else {
    if (c.hidden % c.heads != 0) {
      bad("num_attention_heads", "a divisor of hidden_size when head_dim is not given");
    }
    c.head_dim = c.hidden / c.heads;
  }
  if (c.head_dim % 2 != 0) bad("head_dim", "even (RoPE rotates pairs of dimensions)");
  if (const Json* eps = find(j, "rms_norm_eps")) {
    if (eps->kind != Json::kNumber || !std::isfinite(eps->number) || eps->number < 0) {
      bad("rms_norm_eps", "a finite number >= 0");
    }
    c.eps = eps->number;
  }
  // transformers 4 writes rope_scaling (+ a top-level rope_theta); 5 writes rope_parameters,
  // which holds rope_theta too.
  const char* rs_key = find(j, "rope_parameters") != nullptr ? "rope_parameters" : "rope_scaling";
  const Json* rs = find(j, rs_key);
  if (rs != nullptr && rs->kind != Json::kObject) bad(rs_key, "an object or null");
  if (rs != nullptr) {
    const Json* type = find(*rs, "rope_type");
    if (type == nullptr) type = find(*rs, "type");
    if (type != nullptr && !(type->kind == Json::kString && type->str == "default")) {
      Fail(path + ": " + rs_key + " asks for a RoPE variant (" +
           (type->kind == Json::kString ? type->str : std::string("?")) +
           ") this example does not implement; only the default RoPE is");
    }
  }
  const Json* theta = rs != nullptr ? find(*rs, "rope_theta") : nullptr;
  c.rope_theta = theta != nullptr ? real(std::string(rs_key) + ".rope_theta", theta, 0)
                                  : real("rope_theta", find(j, "rope_theta"), 10000.0);
  if (const Json* tie = find(j, "tie_word_embeddings")) {
    if (tie->kind != Json::kBool) bad("tie_word_embeddings", "true or false");
    c.tied = tie->boolean;
  }
  // Sliding-window attention is not implemented (nor in pyspec): contexts must stay within the
  // window. Qwen2 configs carry a window that is off unless use_sliding_window is set.
  const Json* mt = find(j, "model_type");
  const bool qwen2 = mt != nullptr && mt->kind == Json::kString && mt->str == "qwen2";
  const Json* use = find(j, "use_sliding_window");
  if (use != nullptr && use->kind != Json::kBool) bad("use_sliding_window", "true or false");
  const Json* window = find(j, "sliding_window");
  if ((use != nullptr ? use->boolean : !qwen2) && window != nullptr) {
    c.sliding_window = positive("sliding_window", window);
  }
  if (const Json* mp = find(j, "max_position_embeddings")) {
    c.max_positions = positive("max_position_embeddings", mp);
  }
  if (const Json* act = find(j, "hidden_act")) {
    if (act->kind != Json::kString || (act->str != "silu" && act->str != "swish")) {
      bad("hidden_act", "\"silu\" (the only activation this example implements)");
    }
  }
  return c;
}

// ---- safetensors --------------------------------------------------------------------------------
// A file: 8 bytes little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}
// then the tensors' bytes, row-major, offsets relative to the end of the header.

struct TensorEntry {
  std::string file;  // index into Checkpoint::files_
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // absolute file offsets
};

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: normalize
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir) {
    const std::string single = dir + "/model.safetensors";
    const std::string index = dir + "/model.safetensors.index.json";
    if (FileExists(single)) {
      AddFile(single);
    } else if (FileExists(index)) {
      const Json j = ReadJsonFile(index);
      const Json* map = j.Get("weight_map");
      if (map == nullptr || map->kind != Json::kObject) Fail(index + ": no 'weight_map' object");
      std::vector<std::string> shards;
      for (const auto& m : map->members) {
        if (m.second.kind != Json::kString) {
          Fail(index + ": weight_map['" + m.first + "'] is not a file name");
        }
        if (std::find(shards.begin(), shards.end(), m.second.str) == shards.end()) {
          shards.push_back(m.second.str);
        }
      }
      for (const std::string& s : shards) AddFile(dir + "/" + s);
    } else {
      Fail(dir + ": no model.safetensors (nor model.safetensors.index.json)");
    }
  }

  bool Has(const std::string& name) const { return tensors_.count(name) != 0; }

  // The tensor as float32, checked against `shape`.
  std::vector<float> Load(const std::string& name, const std::vector<int64_t>& shape) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) Fail("the checkpoint has no tensor '" + name + "'");
    const TensorEntry& t = it->second;
    if (t.shape != shape) {
      Fail(t.file + ": tensor '" + name + "' has shape " + ShapeText(t.shape) + "; expected " +
           ShapeText(shape));
    }
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> out(static_cast<size_t>(n));
    std::FILE* f = files_.at(t.file).get();
    if (t.dtype == "F32") {
      ReadAt(f, t.file, t.begin, out.data(), out.size() * 4);
    } else {
      std::vector<uint16_t> raw(out.size());
      ReadAt(f, t.file, t.begin, raw.data(), raw.size() * 2);
      const bool half = t.dtype == "F16";
      for (size_t i = 0; i < raw.size(); ++i) {
        out[i] = half ? HalfToFloat(raw[i]) : BFloat16ToFloat(raw[i]);
      }
    }
    return out;
  }

 private:
  void AddFile(const std::string& path) {
    File f = OpenFile(path);
    const uint64_t size = FileSize(f.get(), path);
    if (size < 8) {
      Fail(path + ": too short for a safetensors file (" + std::to_string(size) + " bytes)");
    }
    unsigned char len_bytes[8];
    ReadAt(f.get(), path, 0, len_bytes, 8);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];  // little-endian
    if (header_len > size - 8 || header_len > (uint64_t{100} << 20)) {
      Fail(path + ": header length " + std::to_string(header_len) + " does not fit the file (" +
           std::to_string(size) + " bytes): not a safetensors file?");
    }
    std::string header(header_len, '\0');
    ReadAt(f.get(), path, 8, header.data(), header_len);
    const Json j = JsonParser(header.data(), header.data() + header.size(), path + " (header)")
                       .ParseDocument();
    if (j.kind != Json::kObject) Fail(path + ": the header is not a JSON object");
    const uint64_t data_start = 8 + header_len, data_size = size - data_start;
    for (const auto& m : j.members) {
      const std::string& name = m.first;
      if (name == "__metadata__") continue;
      const Json& e = m.second;
      const std::string what = path + ": tensor '" + name + "'";
      const Json* dtype = e.Get("dtype");
      const Json* shape = e.Get("shape");
      const Json* offs = e.Get("data_offsets");
      if (dtype == nullptr || dtype->kind != Json::kString || shape == nullptr ||
          shape->kind != Json::kArray || offs == nullptr || offs->kind != Json::kArray ||
          offs->items.size() != 2) {
        Fail(what + ": needs 'dtype', 'shape' and 'data_offsets' [begin, end]");
      }
      TensorEntry t;
      t.file = path;
      t.dtype = dtype->str;
      int elem;
      if (t.dtype == "F32") {
        elem = 4;
      } else if (t.dtype == "F16" || t.dtype == "BF16") {
        elem = 2;
      } else {
        Fail(what + " has dtype " + t.dtype + "; this example reads F32, F16 and BF16");
      }
      uint64_t numel = 1;
      for (const Json& d : shape->items) {
        if (d.kind != Json::kNumber || !d.integral || d.integer < 0) Fail(what + ": bad shape");
        t.shape.push_back(d.integer);
        numel *= static_cast<uint64_t>(d.integer);
      }
      for (const Json& o : offs->items) {
        if (o.kind != Json::kNumber || !o.integral || o.integer < 0) {
          Fail(what + ": bad data_offsets");
        }
      }
      const uint64_t b = static_cast<uint64_t>(offs->items[0].integer);
      const uint64_t en = static_cast<uint64_t>(offs->items[1].integer);
      if (b > en || en > data_size || en - b != numel * static_cast<uint64_t>(elem)) {
        Fail(what + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
             "] do not hold " + std::to_string(numel) + " " + t.dtype + " values within the " +
             std::to_string(data_size) + " data bytes");
      }
      t.begin = data_start + b;
      t.end = data_start + en;
      if (tensors_.count(name) != 0) Fail(what + " is also in " + tensors_[name].file);
      tensors_[name] = std::move(t);
    }
    files_[path] = std::move(f);
  }

  std::map<std::string, File> files_;
  std::map<std::string, TensorEntry> tensors_;
};

// ---- packed codes -------------------------------------------------------------------------------
// A float32 matrix whose values are exactly a 4-bit block format (per group of 32 along K:
// w = d * q + m, q in 0..15, m the group's minimum, d a float16 value) or an 8-bit one (w = d * q,
// q in -128..127), or else float16 / bfloat16 values, is also held as those codes, as pyspec.LLM
// does (packed_weights="auto", pyspec/linear.py pack_exact): LinearPacked then reads 4.5, 8.5 or 16
// bits per weight instead of 32, with the same results bit for bit. Checkpoints converted from GGUF
// (the default model) and checkpoints stored in 16 bits are such matrices;
// PYSPEC_PACKED_WEIGHTS=0 in the environment keeps float32 only. Every value is compared, so a
// matrix is packed only where the codes rebuild it exactly.

struct Packed {
  int bits = 0;            // 4, 8 or 16 (0: not packed)
  DType half = DType::kFloat16;  // 16-bit codes: float16 or bfloat16 values
  std::vector<uint8_t> q;  // 4-bit: [N, K / 2] (byte j of a group: element j low, j + 16 high);
                           // 8-bit: [N, K]; 16-bit: [N, K] values of 2 bytes
  std::vector<float> d, m;  // [N, K / 32] each (4-bit, 8-bit; m: 4-bit only)

  bool four() const { return bits == 4; }
  int64_t row_bytes(int64_t K) const { return bits == 4 ? K / 2 : bits == 8 ? K : 2 * K; }
  DType code_dtype() const {
    return bits == 4 ? DType::kUInt8 : bits == 8 ? DType::kInt8 : half;
  }
};

// float32 -> nearest float16 (ties to even) -> float32, as torch's .half().float().
float RoundToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = x & 0x80000000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return f;                       // inf, nan
  if (ax >= 0x477FF000u) return sign ? -INFINITY : INFINITY;  // >= 65520: past float16's range
  float r;
  if (ax < 0x38800000u) {  // below 2^-14: float16 subnormals, steps of 2^-24
    r = std::nearbyint(std::fabs(f) * 16777216.0f) / 16777216.0f;
  } else {  // keep 10 of the 23 mantissa bits, ties to even
    const uint32_t y = (ax + 0xFFFu + ((ax >> 13) & 1u)) & 0xFFFFE000u;
    std::memcpy(&r, &y, 4);
  }
  return sign ? -r : r;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Rows [r0, r1) of a 4-bit packing of w [N, K] into p (sized for N rows); false where a group is
// not exactly that format.
bool Pack4Rows(const float* w, int64_t K, int64_t r0, int64_t r1, Packed& p) {
  const int64_t G = K / 32;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = w + r * K + g * 32;
      float lo = v[0], hi = v[0];
      for (int i = 1; i < 32; ++i) {
        lo = std::min(lo, v[i]);
        hi = std::max(hi, v[i]);
      }
      const float d = RoundToHalf((hi - lo) / 15.0f);
      if (!std::isfinite(d) || !std::isfinite(lo)) return false;
      uint8_t q[32];
      for (int i = 0; i < 32; ++i) {
        const float c =
            std::min(15.0f, std::max(0.0f, std::nearbyint((v[i] - lo) / (d == 0 ? 1.0f : d))));
        q[i] = static_cast<uint8_t>(c);
        if (!SameBits(static_cast<float>(q[i]) * d + lo, v[i])) return false;
      }
      uint8_t* out = p.q.data() + r * (K / 2) + g * 16;
      for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
      p.d[r * G + g] = d;
      p.m[r * G + g] = lo;
    }
  }
  return true;
}

// The same for the 8-bit format (d = amax / 127, else amax / 128, as a float16 value).
bool Pack8Rows(const float* w, int64_t K, int64_t r0, int64_t r1, Packed& p) {
  const int64_t G = K / 32;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = w + r * K + g * 32;
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      bool ok = false;
      for (float div : {127.0f, 128.0f}) {
        const float d = RoundToHalf(amax / div);
        if (!std::isfinite(d)) return false;
        int8_t q[32];
        ok = true;
        for (int i = 0; i < 32 && ok; ++i) {
          const float c = std::nearbyint(v[i] / (d == 0 ? 1.0f : d));
          ok = c >= -128.0f && c <= 127.0f;
          if (ok) {
            q[i] = static_cast<int8_t>(c);
            ok = SameBits(static_cast<float>(q[i]) * d, v[i]);  // a -0.0 weight fails here
          }
        }
        if (ok) {
          std::memcpy(p.q.data() + r * K + g * 32, q, 32);
          p.d[r * G + g] = d;
          break;
        }
      }
      if (!ok) return false;
    }
  }
  return true;
}

// The float16 bits of f, when f is exactly a finite float16 value.
bool HalfBits(float f, uint16_t* out) {
  if (!std::isfinite(f) || !SameBits(RoundToHalf(f), f)) return false;
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax < 0x38800000u) {  // zero or a float16 subnormal: a multiple of 2^-24
    float a;
    std::memcpy(&a, &ax, 4);
    *out = static_cast<uint16_t>(sign | static_cast<uint16_t>(a * 16777216.0f));
  } else {  // rebias the exponent (127 -> 15), keep the top 10 mantissa bits
    *out = static_cast<uint16_t>(sign | (((ax >> 23) - 112) << 10) | ((ax >> 13) & 0x3FFu));
  }
  return true;
}

// Rows [r0, r1) as float16 (p.half) or bfloat16 values; false where a value is not exactly one.
bool Pack16Rows(const float* w, int64_t K, int64_t r0, int64_t r1, Packed& p) {
  uint16_t* out = reinterpret_cast<uint16_t*>(p.q.data());
  for (int64_t i = r0 * K; i < r1 * K; ++i) {
    uint32_t x;
    std::memcpy(&x, &w[i], 4);
    if (p.half == DType::kBFloat16) {
      if ((x & 0xFFFFu) != 0 || !std::isfinite(w[i])) return false;
      out[i] = static_cast<uint16_t>(x >> 16);
    } else if (!HalfBits(w[i], &out[i])) {
      return false;
    }
  }
  return true;
}

// The codes of `w` [N, K] when it is exactly a 4-bit (tried first) or 8-bit block format, or else
// float16 (then bfloat16) values. Rows are checked in parallel on the core's thread pool.
bool PackExact(const std::vector<float>& w, int64_t N, int64_t K, Packed& p) {
  if (K % 32 != 0 || K == 0 || N == 0) return false;
  // (bits, the 16-bit codes' float type), in the order tried.
  const std::pair<int, DType> formats[] = {{4, DType::kFloat16}, {8, DType::kFloat16},
                                           {16, DType::kFloat16}, {16, DType::kBFloat16}};
  for (const auto& [bits, half] : formats) {
    auto rows = bits == 4 ? &Pack4Rows : bits == 8 ? &Pack8Rows : &Pack16Rows;
    p.bits = bits;
    p.half = half;
    p.q.assign(static_cast<size_t>(N * p.row_bytes(K)), 0);
    p.d.assign(bits != 16 ? static_cast<size_t>(N * K / 32) : 0, 0.f);
    p.m.assign(bits == 4 ? static_cast<size_t>(N * K / 32) : 0, 0.f);
    // A few rows first: a matrix of another format (or none) fails there, cheaply.
    if (!rows(w.data(), K, 0, std::min<int64_t>(N, 16), p)) continue;
    std::atomic<bool> ok{true};
    pyspec::ThreadPool::Default().ParallelFor(N, 16, [&](int64_t r0, int64_t r1) {
      if (ok.load(std::memory_order_relaxed) && !rows(w.data(), K, r0, r1, p)) ok = false;
    });
    if (ok) return true;
  }
  p = Packed();
  return false;
}

// ---- the model ----------------------------------------------------------------------------------

struct Layer {
  std::vector<float> ln1, ln2, wqkv, bqkv, wo, bo, wgu, wd;
  Packed pqkv, po, pgu, pd;  // codes where the matrix is exactly a block format (q empty: none)
};

struct Model {
  Config cfg;
  std::vector<float> embed, lm_head, norm;  // lm_head empty when tied to embed
  Packed lm_packed;
  std::vector<Layer> layers;
  std::vector<pyspec::DecoderLayerWeights> views;  // into `layers`
  pyspec::DecoderConfig dcfg;
  int packed_matrices = 0;

  const float* lm() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
};

// A DecoderMatrix over a float32 matrix [N, K] and, where it has them, its codes.
pyspec::DecoderMatrix Matrix(std::vector<float>& w, Packed& p, int64_t N, int64_t K) {
  pyspec::DecoderMatrix m;
  m.w = TensorView::Contiguous(w.data(), DType::kFloat32, {N, K});
  if (!p.q.empty()) {
    m.packed = true;
    m.q = TensorView::Contiguous(p.q.data(), p.code_dtype(), {N, p.bits == 4 ? K / 2 : K});
    if (p.bits != 16) m.d = TensorView::Contiguous(p.d.data(), DType::kFloat32, {N, K / 32});
    if (p.four()) m.m = TensorView::Contiguous(p.m.data(), DType::kFloat32, {N, K / 32});
  }
  return m;
}

std::vector<float> Concat(std::vector<std::vector<float>> parts) {
  std::vector<float> out;
  for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

Model LoadModel(const std::string& dir) {
  Model m;
  m.cfg = ReadConfig(dir + "/config.json");
  const Config& c = m.cfg;
  Checkpoint ck(dir);
  const int64_t H = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  const int64_t I = c.intermediate;
  m.embed = ck.Load("model.embed_tokens.weight", {c.vocab, H});
  m.norm = ck.Load("model.norm.weight", {H});
  if (!c.tied) m.lm_head = ck.Load("lm_head.weight", {c.vocab, H});
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer w;
    w.ln1 = ck.Load(p + "input_layernorm.weight", {H});
    w.ln2 = ck.Load(p + "post_attention_layernorm.weight", {H});
    // Fused projections, as pyspec holds them: q; k; v rows and gate; up rows.
    w.wqkv = Concat({ck.Load(p + "self_attn.q_proj.weight", {q, H}),
                     ck.Load(p + "self_attn.k_proj.weight", {kv, H}),
                     ck.Load(p + "self_attn.v_proj.weight", {kv, H})});
    if (ck.Has(p + "self_attn.q_proj.bias")) {  // Qwen2 (attention_bias)
      w.bqkv = Concat({ck.Load(p + "self_attn.q_proj.bias", {q}),
                       ck.Load(p + "self_attn.k_proj.bias", {kv}),
                       ck.Load(p + "self_attn.v_proj.bias", {kv})});
    }
    w.wo = ck.Load(p + "self_attn.o_proj.weight", {H, q});
    if (ck.Has(p + "self_attn.o_proj.bias")) w.bo = ck.Load(p + "self_attn.o_proj.bias", {H});
    w.wgu = Concat({ck.Load(p + "mlp.gate_proj.weight", {I, H}),
                    ck.Load(p + "mlp.up_proj.weight", {I, H})});
    w.wd = ck.Load(p + "mlp.down_proj.weight", {H, I});
    m.layers.push_back(std::move(w));
  }
  const char* env = std::getenv("PYSPEC_PACKED_WEIGHTS");
  const bool pack = pyspec::LinearKernels::Default().PackedAvailable() &&
                    !(env != nullptr && std::string(env) == "0");
  auto try_pack = [&](const std::vector<float>& w, int64_t N, int64_t K, Packed& p) {
    if (pack && PackExact(w, N, K, p)) ++m.packed_matrices;
  };
  try_pack(c.tied ? m.embed : m.lm_head, c.vocab, H, m.lm_packed);
  for (Layer& w : m.layers) {
    try_pack(w.wqkv, q + 2 * kv, H, w.pqkv);
    try_pack(w.wo, H, q, w.po);
    try_pack(w.wgu, 2 * I, H, w.pgu);
    try_pack(w.wd, H, I, w.pd);
    pyspec::DecoderLayerWeights v;
    v.ln1 = TensorView::Contiguous(w.ln1.data(), DType::kFloat32, {H});
    v.ln2 = TensorView::Contiguous(w.ln2.data(), DType::kFloat32, {H});
    v.wqkv = Matrix(w.wqkv, w.pqkv, q + 2 * kv, H);
    v.wo = Matrix(w.wo, w.po, H, q);
    v.wgu = Matrix(w.wgu, w.pgu, 2 * I, H);
    v.wd = Matrix(w.wd, w.pd, H, I);
    if (!w.bqkv.empty()) {
      v.bqkv = TensorView::Contiguous(w.bqkv.data(), DType::kFloat32, {q + 2 * kv});
    }
    if (!w.bo.empty()) v.bo = TensorView::Contiguous(w.bo.data(), DType::kFloat32, {H});
    m.views.push_back(v);
  }
  m.dcfg.num_heads = c.heads;
  m.dcfg.num_kv_heads = c.kv_heads;
  m.dcfg.head_dim = c.head_dim;
  m.dcfg.intermediate = I;
  m.dcfg.eps = static_cast<float>(c.eps);
  // Every shape once, up front (DecoderLayers checks them on each call too).
  pyspec::CheckDecoderLayers(m.dcfg, m.views, H, DType::kFloat32);
  return m;
}

// ---- RoPE ---------------------------------------------------------------------------------------
// pyspec (models/llama.py rope_inv_freq / rope_tables), all float32:
//   inv_freq = 1 / (theta ** (arange(0, D, 2).float() / D)); angle = float(pos) * inv_freq;
//   cos/sin [T, D] = cos/sin of [angle, angle].
// The exponent, the reciprocal and the product are single correctly rounded float32 operations,
// the same bits here. pow, cos and sin are computed in double and rounded once to float32 (the
// correctly rounded result in all but rare cases); torch's vectorized float32 versions are
// accurate to about 1 ulp and can differ from it in the last bit.

std::vector<float> RopeInvFreq(const Config& c) {
  const int64_t D = c.head_dim;
  const float base = static_cast<float>(c.rope_theta);
  std::vector<float> inv(D / 2);
  for (int64_t i = 0; i < D / 2; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(D);
    const float p = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(e)));
    inv[i] = 1.0f / p;
  }
  return inv;
}

void RopeTables(const std::vector<float>& inv, const std::vector<int64_t>& positions,
                std::vector<float>& cos, std::vector<float>& sin) {
  const size_t half = inv.size(), D = 2 * half;
  cos.resize(positions.size() * D);
  sin.resize(positions.size() * D);
  for (size_t t = 0; t < positions.size(); ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (size_t i = 0; i < half; ++i) {
      const float a = pos * inv[i];
      const float cv = static_cast<float>(std::cos(static_cast<double>(a)));
      const float sv = static_cast<float>(std::sin(static_cast<double>(a)));
      cos[t * D + i] = cos[t * D + half + i] = cv;
      sin[t * D + i] = sin[t * D + half + i] = sv;
    }
  }
}

// ---- the engine: one greedy request -------------------------------------------------------------

// Prompt lookup (pyspec/drafters/ngram.py): the longest n in [1, 3] whose last-n-token suffix
// occurred earlier in the context with a token after it; the chain is up to `budget` tokens that
// followed its latest occurrence. Empty when nothing matched.
std::vector<int32_t> NgramDraft(const std::vector<int32_t>& ctx, int64_t budget) {
  const int64_t n_ctx = static_cast<int64_t>(ctx.size());
  for (int64_t n = std::min<int64_t>(3, n_ctx - 1); n >= 1; --n) {
    const int32_t* tail = ctx.data() + n_ctx - n;
    for (int64_t start = n_ctx - n - 1; start >= 0; --start) {
      if (std::equal(tail, tail + n, ctx.data() + start)) {
        const int64_t where = start + n;
        const int64_t stop = std::min(n_ctx, where + budget);
        return std::vector<int32_t>(ctx.begin() + where, ctx.begin() + stop);
      }
    }
  }
  return {};
}

class Engine {
 public:
  Engine(const Model& m, int64_t max_tokens, int64_t block_size = 16)
      : m_(m), bs_(block_size), inv_freq_(RopeInvFreq(m.cfg)) {
    const Config& c = m.cfg;
    num_blocks_ = (max_tokens + bs_ - 1) / bs_ + 1;
    const size_t pool = static_cast<size_t>(c.layers * num_blocks_ * bs_ * c.kv_heads * c.head_dim);
    k_pages_.assign(pool, 0.f);
    v_pages_.assign(pool, 0.f);
    // One request owning every page in order: position p lives in slot p.
    for (int64_t b = 0; b < num_blocks_; ++b) table_.push_back(static_cast<int32_t>(b));
  }

  // Runs `ids` at positions start + depth (parents empty: a causal chunk at start, start + 1,
  // ...; else a token tree) over the committed prefix [0, start). Leaves the final hidden states
  // in x_ and the rows' K/V in k_new_ / v_new_.
  void Forward(const std::vector<int32_t>& ids, int64_t start,
               const std::vector<int32_t>& parents) {
    const Config& c = m_.cfg;
    const int64_t T = static_cast<int64_t>(ids.size()), H = c.hidden;
    const bool tree = !parents.empty();
    // A chunk's row j sits at start + j; a tree node at start + its depth (parents come first).
    std::vector<int64_t> positions(T);
    for (int64_t j = 0; j < T; ++j) {
      positions[j] = !tree ? start + j : parents[j] < 0 ? start : positions[parents[j]] + 1;
    }
    std::vector<float> cos, sin;
    RopeTables(inv_freq_, positions, cos, sin);
    x_.resize(static_cast<size_t>(T * H));
    for (int64_t j = 0; j < T; ++j) {
      std::copy_n(m_.embed.data() + static_cast<int64_t>(ids[j]) * H, H, x_.data() + j * H);
    }
    const size_t kv = static_cast<size_t>(c.layers * T * c.kv_heads * c.head_dim);
    k_new_.resize(kv);
    v_new_.resize(kv);

    // The step's plan: one request, its prefix in the pages, T new rows (a tree or a chunk).
    int64_t q_indptr[2] = {0, T}, prefix[1] = {start}, tree_indptr[2] = {0, tree ? T : 0};
    int32_t no_parents[1] = {-1};
    pyspec::AttentionPlanOptions opt;
    opt.num_q_heads = c.heads;
    opt.num_kv_heads = c.kv_heads;
    const pyspec::AttentionPlan plan = pyspec::PlanAttention(
        TensorView::Contiguous(q_indptr, DType::kInt64, {2}),
        TensorView::Contiguous(prefix, DType::kInt64, {1}),
        TensorView::Contiguous(table_.data(), DType::kInt32, {1, num_blocks_}),
        bs_,
        TensorView::Contiguous(tree ? const_cast<int32_t*>(parents.data()) : no_parents,
                               DType::kInt32, {tree ? T : 0}),
        TensorView::Contiguous(tree_indptr, DType::kInt64, {2}), num_blocks_, opt);

    const int64_t L = c.layers, Hkv = c.kv_heads, D = c.head_dim;
    pyspec::DecoderLayers(
        m_.dcfg, m_.views, TensorView::Contiguous(x_.data(), DType::kFloat32, {T, H}),
        TensorView::Contiguous(cos.data(), DType::kFloat32, {T, D}),
        TensorView::Contiguous(sin.data(), DType::kFloat32, {T, D}), plan, Pages(k_pages_),
        Pages(v_pages_), TensorView::Contiguous(k_new_.data(), DType::kFloat32, {L, T, Hkv, D}),
        TensorView::Contiguous(v_new_.data(), DType::kFloat32, {L, T, Hkv, D}));
  }

  // Logits [T, vocab] of every row of the last Forward: final RmsNorm, then lm_head.
  const std::vector<float>& Logits() {
    const Config& c = m_.cfg;
    const int64_t H = c.hidden, T = static_cast<int64_t>(x_.size()) / H;
    std::vector<float> h(x_.size());
    pyspec::RmsNorm(TensorView::Contiguous(x_.data(), DType::kFloat32, {T, H}),
                    TensorView::Contiguous(const_cast<float*>(m_.norm.data()), DType::kFloat32,
                                           {H}),
                    static_cast<float>(c.eps),
                    TensorView::Contiguous(h.data(), DType::kFloat32, {T, H}));
    logits_.resize(static_cast<size_t>(T * c.vocab));
    const TensorView hv = TensorView::Contiguous(h.data(), DType::kFloat32, {T, H});
    const TensorView out = TensorView::Contiguous(logits_.data(), DType::kFloat32, {T, c.vocab});
    const pyspec::LinearKernels& lk = pyspec::LinearKernels::Default();
    const Packed& p = m_.lm_packed;
    if (!p.q.empty() && T <= lk.PackedRowsLimit(/*has_dense=*/true)) {
      // The codes where they are the faster read (the same bits as the float32 matrix).
      const TensorView mv = p.four() ? TensorView::Contiguous(const_cast<float*>(p.m.data()),
                                                              DType::kFloat32, {c.vocab, H / 32})
                                     : TensorView();
      const TensorView qv = TensorView::Contiguous(const_cast<uint8_t*>(p.q.data()),
                                                   p.code_dtype(),
                                                   {c.vocab, p.four() ? H / 2 : H});
      const TensorView dv = p.bits == 16 ? TensorView()  // 16-bit codes: no scales
                                         : TensorView::Contiguous(const_cast<float*>(p.d.data()),
                                                                  DType::kFloat32, {c.vocab, H / 32});
      pyspec::LinearPacked(hv, qv, dv, p.four() ? &mv : nullptr, nullptr, out);
    } else {
      pyspec::Linear(
          hv, TensorView::Contiguous(const_cast<float*>(m_.lm()), DType::kFloat32, {c.vocab, H}),
          nullptr, out);
    }
    return logits_;
  }

  // Copies rows `rows` of the last Forward's K/V into the pages at `positions` (every layer).
  void Commit(const std::vector<int64_t>& rows, const std::vector<int64_t>& positions) {
    const Config& c = m_.cfg;
    const int64_t n = static_cast<int64_t>(rows.size());
    const int64_t T = static_cast<int64_t>(k_new_.size()) / (c.layers * c.kv_heads * c.head_dim);
    std::vector<int64_t> slots(n);
    for (int64_t i = 0; i < n; ++i) {
      slots[i] = table_[positions[i] / bs_] * bs_ + positions[i] % bs_;
    }
    const TensorView src =
        TensorView::Contiguous(const_cast<int64_t*>(rows.data()), DType::kInt64, {n});
    const TensorView dst = TensorView::Contiguous(slots.data(), DType::kInt64, {n});
    for (auto* pair : {&k_new_, &v_new_}) {
      std::vector<float>& pages = pair == &k_new_ ? k_pages_ : v_pages_;
      pyspec::MaterializeKV(
          TensorView::Contiguous(pair->data(), DType::kFloat32,
                                 {c.layers, T, c.kv_heads, c.head_dim}),
          Pages(pages), src, dst);
    }
  }

  // Greedy acceptance of a chain (root + drafts, chain parents) from the last Logits(): the
  // accepted draft count and the emitted tokens (accepted drafts, then the bonus token).
  int32_t Accept(const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                 std::vector<int32_t>& emitted) {
    const int64_t N = static_cast<int64_t>(tokens.size()), V = m_.cfg.vocab;
    const int64_t W = N;  // >= depth + 1
    int64_t indptr[2] = {0, N}, seeds[1] = {0}, offsets[1] = {0};
    bool greedy[1] = {true}, sampled[1] = {false};
    std::vector<int32_t> nodes(W), out(W);
    int32_t num_accepted = 0;
    pyspec::AcceptTreesArgs a;
    a.target = TensorView::Contiguous(logits_.data(), DType::kFloat32, {N, V});
    a.tokens = TensorView::Contiguous(const_cast<int32_t*>(tokens.data()), DType::kInt32, {N});
    a.parents = TensorView::Contiguous(const_cast<int32_t*>(parents.data()), DType::kInt32, {N});
    a.tree_indptr = TensorView::Contiguous(indptr, DType::kInt64, {2});
    a.greedy = TensorView::Contiguous(greedy, DType::kBool, {1});
    a.sampled_children = TensorView::Contiguous(sampled, DType::kBool, {1});
    a.seeds = TensorView::Contiguous(seeds, DType::kInt64, {1});
    a.offsets = TensorView::Contiguous(offsets, DType::kInt64, {1});
    a.accepted_nodes = TensorView::Contiguous(nodes.data(), DType::kInt32, {1, W});
    a.emitted_tokens = TensorView::Contiguous(out.data(), DType::kInt32, {1, W});
    a.num_accepted = TensorView::Contiguous(&num_accepted, DType::kInt32, {1});
    a.options.target_is_logits = true;  // the argmax of each row, without probability rows
    pyspec::AcceptTrees(a);
    emitted.assign(out.begin(), out.begin() + num_accepted + 1);
    // A chain's accepted path is nodes 0..num_accepted; checked, as a tree's would be read.
    for (int32_t i = 0; i <= num_accepted; ++i) {
      if (nodes[i] != i) Fail("internal error: a chain's accepted path skips a node");
    }
    return num_accepted;
  }

 private:
  TensorView Pages(std::vector<float>& pages) const {
    const Config& c = m_.cfg;
    return TensorView::Contiguous(pages.data(), DType::kFloat32,
                                  {c.layers, num_blocks_, bs_, c.kv_heads, c.head_dim});
  }

  const Model& m_;
  int64_t bs_, num_blocks_ = 0;
  std::vector<float> inv_freq_;
  std::vector<int32_t> table_;
  std::vector<float> k_pages_, v_pages_;        // [L, num_blocks, block_size, Hkv, D]
  std::vector<float> x_, k_new_, v_new_, logits_;  // the last step's rows
};

// ---- command line -------------------------------------------------------------------------------

int64_t ParseInt(const std::string& s, const char* what) {
  if (s.empty()) Fail(std::string(what) + ": empty");
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') {
    Fail(std::string(what) + ": '" + s + "' is not an integer");
  }
  return v;
}

std::vector<int32_t> ParseIds(const std::string& s, int64_t vocab) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    const int64_t v = ParseInt(s.substr(pos, comma - pos), "a prompt id");
    if (v < 0 || v >= vocab) {
      Fail("prompt id " + std::to_string(v) + " is outside the vocabulary [0, " +
           std::to_string(vocab) + ")");
    }
    ids.push_back(static_cast<int32_t>(v));
    pos = comma + 1;
  }
  return ids;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

int Run(int argc, char** argv) {
  if (argc < 4 || argc > 5) {
    std::fprintf(stderr,
                 "usage: %s MODEL_DIR PROMPT_IDS MAX_NEW_TOKENS [MAX_DRAFT=5]\n"
                 "  PROMPT_IDS: comma-separated token ids; MAX_DRAFT: 0..63 (0: no drafting)\n",
                 argc > 0 ? argv[0] : "pyspec_speculate");
    return 2;
  }
  const std::string dir = argv[1];
  const int64_t max_new = ParseInt(argv[3], "MAX_NEW_TOKENS");
  const int64_t max_draft = argc > 4 ? ParseInt(argv[4], "MAX_DRAFT") : 5;
  if (max_new < 0) Fail("MAX_NEW_TOKENS must be >= 0");
  if (max_draft < 0 || max_draft > pyspec::TokenTree::kMaxDepth - 1) {
    Fail("MAX_DRAFT must be in [0, " + std::to_string(pyspec::TokenTree::kMaxDepth - 1) + "]");
  }

  auto t0 = std::chrono::steady_clock::now();
  const Model model = LoadModel(dir);
  const std::vector<int32_t> prompt = ParseIds(argv[2], model.cfg.vocab);
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (model.cfg.sliding_window > 0 && n + max_new > model.cfg.sliding_window) {
    Fail("the prompt (" + std::to_string(n) + " tokens) + MAX_NEW_TOKENS (" +
         std::to_string(max_new) + ") exceed the model's sliding window (" +
         std::to_string(model.cfg.sliding_window) + "); sliding-window attention is not "
         "implemented, so contexts must stay within it");
  }
  if (n + max_new > model.cfg.max_positions) {
    Fail("the prompt (" + std::to_string(n) + " tokens) + MAX_NEW_TOKENS (" +
         std::to_string(max_new) + ") exceed the model's context of " +
         std::to_string(model.cfg.max_positions) + " tokens (max_position_embeddings)");
  }
  std::fprintf(stderr, "loaded %s: %lld layers, hidden %lld, vocab %lld, %d matrices also as "
               "packed codes (%.2f s)\n", dir.c_str(), static_cast<long long>(model.cfg.layers),
               static_cast<long long>(model.cfg.hidden), static_cast<long long>(model.cfg.vocab),
               model.packed_matrices, Seconds(t0));

  Engine eng(model, n + max_new + 1);
  std::vector<int32_t> ctx = prompt;
  int64_t committed = 0;  // positions whose K/V are in the pages
  t0 = std::chrono::steady_clock::now();
  if (n > 1) {
    // Prefill: every prompt token but the last, one causal chunk; the last is the first root.
    const std::vector<int32_t> chunk(prompt.begin(), prompt.end() - 1);
    eng.Forward(chunk, 0, {});
    std::vector<int64_t> rows(n - 1);
    for (int64_t i = 0; i < n - 1; ++i) rows[i] = i;
    eng.Commit(rows, rows);
    committed = n - 1;
  }
  const double prefill_s = Seconds(t0);

  t0 = std::chrono::steady_clock::now();
  int64_t generated = 0, steps = 0, accepted = 0;
  std::vector<int32_t> tokens, parents, emitted;
  while (generated < max_new) {
    // Never draft past max_new_tokens (as the scheduler's draft budget does).
    const int64_t budget = std::min(max_draft, max_new - generated - 1);
    const std::vector<int32_t> chain =
        budget > 0 ? NgramDraft(ctx, budget) : std::vector<int32_t>();
    tokens.assign(1, ctx.back());
    tokens.insert(tokens.end(), chain.begin(), chain.end());
    parents.resize(tokens.size());
    for (size_t i = 0; i < parents.size(); ++i) parents[i] = static_cast<int32_t>(i) - 1;

    eng.Forward(tokens, committed, parents);
    eng.Logits();
    const int32_t a = eng.Accept(tokens, parents, emitted);

    // The root and the accepted drafts (nodes 0..a of the chain) enter the pages.
    std::vector<int64_t> rows(a + 1), positions(a + 1);
    for (int32_t i = 0; i <= a; ++i) {
      rows[i] = i;
      positions[i] = committed + i;
    }
    eng.Commit(rows, positions);
    committed += a + 1;
    ctx.insert(ctx.end(), emitted.begin(), emitted.end());
    generated += a + 1;
    accepted += a;
    ++steps;
  }
  const double decode_s = Seconds(t0);

  std::string line;
  for (int64_t i = n; i < static_cast<int64_t>(ctx.size()); ++i) {
    if (i > n) line += ' ';
    line += std::to_string(ctx[i]);
  }
  std::printf("%s\nsteps=%lld accepted=%lld\n", line.c_str(), static_cast<long long>(steps),
              static_cast<long long>(accepted));
  std::fprintf(stderr,
               "prefill %lld tokens %.3f s; %lld tokens in %lld steps %.3f s (%.1f tok/s)\n",
               static_cast<long long>(std::max<int64_t>(n - 1, 0)), prefill_s,
               static_cast<long long>(generated), static_cast<long long>(steps), decode_s,
               decode_s > 0 ? generated / decode_s : 0.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const pyspec::ValueError& e) {
    std::fprintf(stderr, "error (pyspec): %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
