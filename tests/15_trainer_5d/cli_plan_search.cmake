# `fivefold plan --search` as a user runs it, and what it prints run by the trainer:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> -DROOT=<source>
#         -P cli_plan_search.cmake
# A search over 4 devices for the byte-vocabulary model of 4 layers (8 rows of 16 tokens) prints
# its table; its JSON's best 3 layouts each train 2 steps under mpirun -np 4 with the flags the
# planner chose; so do the best 2 with experts split of DeepSeek-V3 in miniature, and the best 2
# with tp 2 (chapter 10's split of MLA and experts, with or without sequence parallelism). The
# refusals: no --cluster, a cluster file with an unknown key, a GPT-2 shape, --ep for a model
# without experts, an unknown --recompute, and a search option (--recompute) without --search. `fivefold calibrate` on 4 ranks writes a cluster
# file the search reads back; on one process it is refused.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(cluster ${WORK}/four.toml)
file(WRITE ${cluster} [=[
name = "four processes"
devices = 4
devices-per-node = 2
memory-gb = 1
peak-tflops-bf16 = 0.4
peak-tflops-fp32 = 0.2
matmul-tflops-bf16 = 0.2
matmul-tflops-fp32 = 0.1
adamw-ns-per-parameter = 1
intra-node-gbps = 5
intra-node-latency-us = 20
inter-node-gbps = 1
inter-node-latency-us = 50
]=])
set(model --d-model 64 --n-layers 4 --n-heads 4 --n-kv-heads 2 --d-ff 256 --vocab 259 --seq 16
    --batch 8)

execute_process(COMMAND ${FIVEFOLD} plan --search --cluster ${cluster} ${model} --top 3
                RESULT_VARIABLE rc OUTPUT_VARIABLE table ERROR_VARIABLE err)
message("${table}${err}")
if(NOT rc EQUAL 0 OR NOT table MATCHES "layouts the trainer accepts" OR
   NOT table MATCHES "\n +1  [0-9.e-]+ ")
  message(FATAL_ERROR "plan --search: no table (exit ${rc})")
endif()

execute_process(COMMAND ${FIVEFOLD} plan --search --cluster ${cluster} ${model} --top 3 --json
                RESULT_VARIABLE rc OUTPUT_VARIABLE json ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "plan --search --json: exit ${rc}\n${err}")
endif()
string(JSON kept LENGTH "${json}" best)
if(NOT kept EQUAL 3)
  message(FATAL_ERROR "plan --search --top 3 kept ${kept} layouts")
endif()
# Each of the JSON's best layouts trains 2 steps under mpirun -np 4 with the planner's flags.
function(train_best json model_flags)
  string(JSON kept LENGTH "${json}" best)
  math(EXPR last "${kept} - 1")
  foreach(i RANGE ${last})
    set(flags "")
    foreach(key dp tp pp cp ep zero schedule virtual_stages micro_batches recompute)
      string(JSON value GET "${json}" best ${i} ${key})
      set(flag ${key})
      if(key MATCHES "^micro_batches$")
        set(flag accum)
      endif()
      string(REPLACE "_" "-" flag "${flag}")
      list(APPEND flags --${flag} ${value})
    endforeach()
    string(JSON sp GET "${json}" best ${i} sequence_parallel)
    if(sp)
      list(APPEND flags --sequence-parallel)
    endif()
    string(JSON layout GET "${json}" best ${i} layout)
    string(MD5 run "${layout}${flags}")
    message("training the planner's layout ${i}: ${layout}: ${flags}")
    execute_process(
      COMMAND ${MPIRUN} -np 4 ${FIVEFOLD} train --out ${WORK}/${run} --steps 2 --batch 8 --seq 16
              ${model_flags} --synthetic-examples 300 --eval-every 0 --exact-match 0
              --save-every 0 --peak-gflops 100 --no-progress ${flags}
      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 OR NOT EXISTS ${WORK}/${run}/metrics.jsonl)
      message(FATAL_ERROR "the planner's layout ${layout} did not train (exit ${rc}):\n${out}${err}")
    endif()
  endforeach()
endfunction()
train_best("${json}" "--d-model;64;--n-layers;4;--n-heads;4;--n-kv-heads;2;--d-ff;256")

# DeepSeek-V3 in miniature (MLA, experts after a dense block): the search prices ep's
# all-to-alls; its best 2 layouts with the experts split over 2 ranks train as chosen.
set(moe_config ${ROOT}/tests/07_moe/configs/tiny-deepseek-v3-moe.json)
execute_process(COMMAND ${FIVEFOLD} plan --search --cluster ${cluster} --config ${moe_config}
                        --batch 8 --seq 16 --ep 2 --top 2 --json
                RESULT_VARIABLE rc OUTPUT_VARIABLE json ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT json MATCHES "\"ep\": 2" OR NOT json MATCHES "\"ep\": [0-9.e-]+")
  message(FATAL_ERROR "plan --search on a DeepSeek config: exit ${rc}\n${json}${err}")
endif()
train_best("${json}" "--model-config;${moe_config}")
execute_process(COMMAND ${FIVEFOLD} plan --search --cluster ${cluster} --config ${moe_config}
                        --batch 8 --seq 16 --tp 2 --top 2 --json
                RESULT_VARIABLE rc OUTPUT_VARIABLE json ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT json MATCHES "\"tp\": *2")
  message(FATAL_ERROR "plan --search on a DeepSeek config under tp 2: exit ${rc}\n${json}${err}")
endif()
train_best("${json}" "--model-config;${moe_config}")

# `fivefold calibrate` on 4 ranks writes a cluster file that the search reads back, its links
# timed at 2 and 4 ranks, the step's products alone on both kernels (45 a step: 2 blocks of 4
# attention and 3 MLP matrices and the head, each forward and backward twice) and the memory.
# Five timed steps: at two, the median of a step of 4 ranks on 2 cores once came out shorter than
# its attention timed alone, which calibrate refuses (a noisy machine) and the test then failed.
execute_process(COMMAND ${MPIRUN} -np 4 ${FIVEFOLD} calibrate --cluster-out ${WORK}/here.toml
                        --d-model 64 --n-layers 2 --n-heads 4 --seq 16 --batch 4 --timed-steps 5
                        --sizes 4096,65536
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT EXISTS ${WORK}/here.toml)
  message(FATAL_ERROR "fivefold calibrate failed (exit ${rc}):\n${out}${err}")
endif()
file(READ ${WORK}/here.toml here)
message("${here}")
if(NOT here MATCHES "devices = 4\n" OR NOT here MATCHES "matmul-tflops-bf16 = [0-9]" OR
   NOT here MATCHES "attention-tflops-fp32 = [0-9]")
  message(FATAL_ERROR "the calibrated cluster file lacks its devices or rates")
endif()
if(NOT here MATCHES "memory-gbps = [0-9]" OR NOT here MATCHES "\"kernel\":\"oneDNN\"" OR
   NOT here MATCHES "\"kernel\":\"at::mm\"" OR NOT here MATCHES "\"products_a_step\":45")
  message(FATAL_ERROR "calibrate did not time the step's products on both kernels, the memory")
endif()
if(NOT here MATCHES "\"ranks\":2" OR NOT here MATCHES "\"ranks\":4")
  message(FATAL_ERROR "calibrate did not time its collectives at 2 and at 4 ranks")
endif()
foreach(op all-reduce all-gather reduce-scatter all-to-all send-recv)
  if(NOT here MATCHES "intra-node-${op}-gbps = [0-9]")
    message(FATAL_ERROR "the calibrated cluster file lacks ${op}'s own line")
  endif()
endforeach()
execute_process(COMMAND ${FIVEFOLD} plan --search --cluster ${WORK}/here.toml ${model} --top 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE table ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT table MATCHES "this machine, 4 ranks")
  message(FATAL_ERROR "plan --search did not read the calibrated file (exit ${rc}):\n${table}${err}")
endif()
# Where the file cannot go, and sizes no line fits, are refused on every rank before the
# measuring (the folder's was found only when the file was written, after it).
foreach(case "--cluster-out;${WORK}/absent/x.toml|the folder '${WORK}/absent' does not exist"
             "--cluster-out;${WORK}|is a folder: give a file"
             "--cluster-out;${WORK}/one.toml;--sizes;4096|--sizes needs two message sizes or more")
  string(REPLACE "|" ";" parts "${case}")
  list(POP_BACK parts expect)
  execute_process(COMMAND ${MPIRUN} -np 2 ${FIVEFOLD} calibrate ${parts} --d-model 64
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX MATCHALL "fivefold calibrate: error: [^\n]*${expect}" said
         "${out}${err}")
  list(LENGTH said ranks)
  if(rc EQUAL 0 OR NOT ranks EQUAL 2 OR "${out}${err}" MATCHES "wrote ")
    message(FATAL_ERROR "calibrate ${parts}: expected a refusal on both ranks mentioning "
                        "'${expect}', got exit ${rc}:\n${out}${err}")
  endif()
endforeach()
execute_process(COMMAND ${FIVEFOLD} calibrate --cluster-out ${WORK}/alone.toml --d-model 64
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "a link needs two ranks" OR EXISTS ${WORK}/alone.toml)
  message(FATAL_ERROR "calibrate on one process: expected a refusal, got exit ${rc}:\n${out}${err}")
endif()

function(expect_refused what expect)
  execute_process(COMMAND ${FIVEFOLD} plan --search ${ARGN} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "${expect}")
    message(FATAL_ERROR "${what}: expected a refusal matching '${expect}', got exit ${rc}:\n"
                        "${out}${err}")
  endif()
endfunction()
expect_refused("no cluster" "give --cluster FILE" ${model})
file(WRITE ${WORK}/typo.toml "name = \"x\"\ndevice = 4\n")
expect_refused("a cluster file's typo" "--cluster '[^']*typo.toml' line 2: 'device': unknown setting 'device'"
               --cluster ${WORK}/typo.toml ${model})
expect_refused("a missing cluster file" "--cluster '[^']*absent.toml': not readable"
               --cluster ${WORK}/absent.toml ${model})
expect_refused("GPT-2" "Llama-shaped" --cluster ${cluster} ${model} --gpt2)
expect_refused("ep without experts" "no routed experts" --cluster ${cluster} ${model} --ep 2)
expect_refused("an unknown recomputation" "'some' is not one of none, full, selective"
               --cluster ${cluster} ${model} --recompute some)
# A tp the heads do not split over: the trainer's refusal, not a formula's internal one.
execute_process(COMMAND ${FIVEFOLD} plan --d-model 64 --n-layers 4 --n-heads 4 --tp 3
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "--tp 3: the model's 4 attention heads do not split")
  message(FATAL_ERROR "plan --tp 3 on 4 heads: expected the trainer's refusal, got exit ${rc}:\n"
                      "${out}${err}")
endif()
# The planner's options without --search would be ignored: refused, naming it.
execute_process(COMMAND ${FIVEFOLD} plan --d-model 64 --n-layers 4 --n-heads 4 --recompute full
                RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "--recompute is an option of --search")
  message(FATAL_ERROR "plan --recompute without --search: expected a refusal, got exit ${rc}:\n"
                      "${out}${err}")
endif()
