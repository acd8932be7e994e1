# `fivefold train / generate / eval` with a DeepSeek-V3-style MLA model, end to end:
#   cmake -DFIVEFOLD=<program> -DCONFIG=<config.json> -DWORK=<scratch folder> -P cli_mla.cmake
# Trains from a Hugging Face config.json (MLA, YaRN), resumes (AdamW state by MLA's names),
# generates through the latent cache and evaluates; the checkpoint keeps DeepSeek-V3's keys.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)

set(out ${WORK}/run)
run("" train --out ${out} --model-config ${CONFIG} --steps 4 --save-every 2 --eval-every 2
    --exact-match 4 --synthetic-examples 300 --seq 16 --batch 4 --peak-gflops 100 --no-progress)
run("" train --out ${out} --resume --steps 6 --peak-gflops 100 --no-progress)
file(READ ${out}/step-00000006/config.json config)
foreach(key "\"model_type\": \"deepseek_v3\"" "\"kv_lora_rank\": 16" "\"q_lora_rank\": 24"
        "\"mscale_all_dim\": 1.0")
  string(FIND "${config}" "${key}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "the checkpoint's config.json lacks ${key}:\n${config}")
  endif()
endforeach()
run("^[0-9]+(,[0-9]+)*\n$" generate --checkpoint ${out} --prompt-ids 3,1,4 --max-new-tokens 5
    --greedy)
run("^12\\+35=" generate --checkpoint ${out} --prompt "12+35=" --max-new-tokens 4 --temperature
    0.8 --top-k 5 --seed 1)
run("perplexity" eval --checkpoint ${out})
