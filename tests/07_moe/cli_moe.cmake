# `fivefold train / generate / eval` with a DeepSeek-V3 in miniature (MLA and experts):
#   cmake -DFIVEFOLD=<program> -DCONFIG=<config.json> -DWORK=<scratch folder> -P cli_moe.cmake
# Trains from the config, resumes, and checks that every step's metrics report the expert load,
# and that the checkpoint generates and evaluates.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)

set(out ${WORK}/run)
run("" train --out ${out} --model-config ${CONFIG} --steps 4 --save-every 2
    --eval-every 2 --exact-match 4 --synthetic-examples 300 --seq 16 --batch 4 --peak-gflops 100
    --no-progress)
run("" train --out ${out} --resume --steps 6 --peak-gflops 100 --no-progress)
file(STRINGS ${out}/metrics.jsonl lines REGEX "\"kind\":\"train\".*\"moe_load\":\\[\\[")
list(LENGTH lines count)
if(NOT count EQUAL 6)
  message(FATAL_ERROR "metrics.jsonl has ${count} training lines with the expert load, expected 6")
endif()
run("^[0-9]+(,[0-9]+)*\n$" generate --checkpoint ${out} --prompt-ids 3,1,4 --max-new-tokens 5
    --greedy)
run("perplexity" eval --checkpoint ${out})
