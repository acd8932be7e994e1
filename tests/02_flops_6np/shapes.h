#pragma once
// Shapes and published configs shared by chapter 02's tests.

#include <nlohmann/json.hpp>

#include "02_flops_6np/flops.h"

namespace ch02_test {

// Small shapes of each kind the chapter counts: multi-head, grouped-query, tied, GPT-2 style.
inline std::vector<fivefold::ch02::TransformerShape> small_shapes() {
  fivefold::ch02::TransformerShape mha{/*vocab*/ 96, /*d*/ 32, /*layers*/ 2,
                                       /*heads*/ 4,  /*kv*/ 4, /*head_dim*/ 8,
                                       /*ff*/ 80};
  auto gqa = mha;
  gqa.n_kv_heads = 2;
  gqa.tied_embeddings = true;
  auto wide_heads = mha;  // head_dim * heads != d_model, as some Llama-family configs have
  wide_heads.head_dim = 12;
  wide_heads.n_kv_heads = 1;
  fivefold::ch02::TransformerShape gpt2{64,
                                        24,
                                        3,
                                        3,
                                        3,
                                        8,
                                        96,
                                        /*gated*/ false,
                                        /*biases*/ true,
                                        /*layer_norm*/ true,
                                        /*positions*/ 64,
                                        /*tied*/ true};
  return {mha, gqa, wide_heads, gpt2};
}

// Published configs, as their config.json files have them (informational keys included).
inline nlohmann::json llama2_7b() {
  return nlohmann::json::parse(R"({"architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": true,
    "vocab_size": 32000})");
}

inline nlohmann::json gpt2_small() {
  return nlohmann::json::parse(R"({"activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
    "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
    "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true,
    "max_length": 50}}, "vocab_size": 50257})");
}

}  // namespace ch02_test
