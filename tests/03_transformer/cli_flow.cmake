# `fivefold train / generate / eval` as a user runs them, end to end:
#   cmake -DFIVEFOLD=<program> -DWORK=<scratch folder> -P cli_flow.cmake
# Trains a tiny model for a few steps, resumes it, generates from it (ids and text), writes the
# logits of a sequence, evaluates it (both splits), does the same for a 300-token vocabulary, and
# checks that bad input fails with a clear message.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(model --d-model 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --d-ff 64 --seq 16 --batch 4)

include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)

# `fivefold train` restarts itself with malloc on transparent huge pages where glibc has the
# tunable (2.35 and later), and not with FIVEFOLD_HUGE_PAGES=0; `fivefold info` says which, and
# the training run says so when it starts (the first run below).
execute_process(COMMAND getconf GNU_LIBC_VERSION OUTPUT_VARIABLE glibc)
string(REGEX MATCH "[0-9]+\\.[0-9]+" glibc "${glibc}")
foreach(setting 1 0)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env FIVEFOLD_HUGE_PAGES=${setting} ${FIVEFOLD} info
                  OUTPUT_VARIABLE said ERROR_VARIABLE said)
  set(want "on")
  if(setting EQUAL 0 OR glibc VERSION_LESS 2.35)
    set(want "off")
  endif()
  if(NOT said MATCHES "train's malloc on huge pages ${want}")
    message(FATAL_ERROR "FIVEFOLD_HUGE_PAGES=${setting}, glibc ${glibc}: expected 'train's malloc "
                        "on huge pages ${want}', got:\n${said}")
  endif()
endforeach()
foreach(setting 1 0)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env FIVEFOLD_HUGE_PAGES=${setting} ${FIVEFOLD} train
                          --out ${WORK}/huge-pages-${setting} --steps 1 --eval-batches 1
                          --exact-match 0 --peak-gflops 100 --no-progress ${model}
                  RESULT_VARIABLE status OUTPUT_VARIABLE said ERROR_VARIABLE said)
  string(FIND "${said}" "; malloc on huge pages" at)
  set(found TRUE)
  if(at EQUAL -1)
    set(found FALSE)
  endif()
  set(expected FALSE)
  if(setting EQUAL 1 AND glibc VERSION_GREATER_EQUAL 2.35)
    set(expected TRUE)
  endif()
  if(NOT status EQUAL 0 OR NOT found STREQUAL expected)
    message(FATAL_ERROR "FIVEFOLD_HUGE_PAGES=${setting}, glibc ${glibc}: the training line says "
                        "huge pages where it should not, or not where it should:\n${said}")
  endif()
endforeach()

set(out ${WORK}/run)
run("" train --out ${out} --steps 4 --save-every 2 --eval-every 2 --exact-match 4
    --synthetic-examples 300 --peak-gflops 100 --no-progress ${model})
run("" train --out ${out} --resume --steps 6 --peak-gflops 100 --no-progress)
file(READ ${out}/latest latest)
if(NOT latest STREQUAL "step-00000006\n")
  message(FATAL_ERROR "latest is '${latest}' after resuming to step 6")
endif()
file(STRINGS ${out}/metrics.jsonl lines REGEX "\"kind\":\"train\"")
list(LENGTH lines count)
if(NOT count EQUAL 6)
  message(FATAL_ERROR "metrics.jsonl has ${count} training lines, expected 6")
endif()

# The lesson's code (--lesson-kernels) trains the run the fast paths (the default) train: the
# same loss and gradient norm at each of its 4 steps, within 1e-5.
run("" train --out ${WORK}/lesson --steps 4 --save-every 2 --eval-every 2 --exact-match 4
    --synthetic-examples 300 --peak-gflops 100 --no-progress --lesson-kernels ${model})
execute_process(COMMAND ${FIVEFOLD} compare --runs ${out},${WORK}/lesson --tolerance 1e-5
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "the fast paths' curve differs from the lesson's code's:\n${text}")
endif()

# The interop flags: new ids on one line, comma-separated; logits as one F32 tensor [seq, vocab].
run("^[0-9]+(,[0-9]+)*\n$" generate --checkpoint ${out} --prompt-ids 3,1,4 --max-new-tokens 5
    --greedy)
string(REPLACE "," ";" ids "${output}")
list(LENGTH ids count)
if(NOT count EQUAL 5)
  message(FATAL_ERROR "generate printed ${count} ids, expected 5")
endif()
run("^12\\+35=" generate --checkpoint ${out}/step-00000006 --prompt "12+35=" --max-new-tokens 4
    --temperature 0.8 --top-k 5 --seed 1)
run("" eval --checkpoint ${out} --ids 3,1,4,1,5 --logits-out ${WORK}/logits.safetensors)
file(READ ${WORK}/logits.safetensors header OFFSET 8 LIMIT 80)  # after the 8-byte length
if(NOT header MATCHES "\"logits\":{\"data_offsets\":\\[0,5180\\],\"dtype\":\"F32\",\"shape\":\\[5,259\\]}")
  message(FATAL_ERROR "logits.safetensors header: ${header}")
endif()
file(SIZE ${WORK}/logits.safetensors size)
if(size LESS 5188)  # 8-byte length + header + 5 x 259 floats
  message(FATAL_ERROR "logits.safetensors has ${size} bytes")
endif()
run("held-out loss [0-9.]+  perplexity [0-9.]+.*exact match [0-9.]+ over 20 held-out prompts"
    eval --checkpoint ${out} --seq 16 --batch 4 --batches 2 --exact-match 20)

run("train loss [0-9.]+.*exact match [0-9.]+ over 10 train prompts" eval --checkpoint ${out}
    --split train --seq 16 --batch 4 --batches 2 --exact-match 10)

# Any vocabulary size in config.json: a model with 300 tokens (byte data uses 0..258 of them).
run("" train --out ${WORK}/v300 --vocab 300 --steps 1 --synthetic-examples 300 --peak-gflops 100
    --no-progress --exact-match 0 ${model})
run("^[0-9]+(,[0-9]+)*\n$" generate --checkpoint ${WORK}/v300 --prompt-ids 299,0,280
    --max-new-tokens 3 --greedy)
run("" eval --checkpoint ${WORK}/v300 --ids 299,1 --logits-out ${WORK}/logits300.safetensors)
file(READ ${WORK}/logits300.safetensors header OFFSET 8 LIMIT 80)
if(NOT header MATCHES "\"shape\":\[2,300\]")
  message(FATAL_ERROR "logits300.safetensors header: ${header}")
endif()

# Past the context the model was trained for (max_position_embeddings 2048), generate warns; the
# tokens stream as they come (the ids line is the same as when printed at the end).
execute_process(COMMAND ${FIVEFOLD} generate --checkpoint ${WORK}/v300 --prompt-ids 1
                --max-new-tokens 2100 --greedy RESULT_VARIABLE status OUTPUT_VARIABLE ids
                ERROR_VARIABLE err TIMEOUT 120)
if(NOT status EQUAL 0 OR NOT err MATCHES "beyond the 2048 the model was trained for"
   OR NOT ids MATCHES "^[0-9]+(,[0-9]+)*\n$")
  message(FATAL_ERROR "generate past max_position_embeddings: exit ${status}, ${err}")
endif()

# Bad input: clear errors, non-zero exit, nothing written.
refused("'${WORK}/absent.txt'" train --out ${WORK}/never --data ${WORK}/absent.txt)
refused("does not divide d_model" train --out ${WORK}/never --d-model 30 --n-heads 4)
refused("is a folder, not a file" train --out ${WORK}/never --data ${WORK})
# Sizes that cannot fit are refused from chapter 02's count, before anything is allocated.
refused("GB available \\(activations not counted\\)" train --out ${WORK}/never
        --n-layers 1000000000)
refused("GB available" train --out ${WORK}/never --vocab 1000000000000)
# In bf16 the state it prices is chapter 14's: bf16 weights and gradients, fp32 master weights.
refused("bf16, with fp32 master weights\\) take" train --out ${WORK}/never --n-layers 1000000000
        --precision bf16)
# ... and then with the activations the blocks keep (chapter 14's formulas, the rank that keeps
# the most): a sequence of 16M tokens needs terabytes (it was refused only by the OOM killer).
refused("and the blocks' activations [0-9.e+]+ GB more \\(chapter 14's formulas: 64 rows of 16777216 tokens"
        train --out ${WORK}/never --seq 16777216 --batch 64)
# A count out of range is refused naming its flag and value (it named five fields at once).
refused("--keep must be >= 1, got 0" train --out ${WORK}/never --keep 0)
refused("--steps must be >= 1, got 0" train --out ${WORK}/never --steps 0)
refused("--warmup must be >= 0, got -1" train --out ${WORK}/never --warmup -1)
refused("--eval-batches must be >= 1, got 0" train --out ${WORK}/never --eval-batches 0)
refused("already holds a training run" train --out ${out} --steps 8 ${model})
if(EXISTS ${WORK}/never)
  message(FATAL_ERROR "a refused run created its output folder")
endif()
refused("neither a checkpoint folder" generate --checkpoint ${WORK} --prompt-ids 1)
refused("outside the checkpoint's vocabulary" generate --checkpoint ${out} --prompt-ids 3,259)
refused("expects integers" generate --checkpoint ${out} --prompt-ids 3,x)
refused("exactly one of --prompt and --prompt-ids" generate --checkpoint ${out})
# Bad sampling settings are refused before the prompt is echoed: nothing on stdout.
foreach(case "--max-new-tokens;-1;--max-new-tokens must be >= 0"
             "--temperature;0;temperature must be positive" "--top-k;-2;top_k must be >= 0")
  list(GET case 0 flag)
  list(GET case 1 value)
  list(GET case 2 expect)
  execute_process(COMMAND ${FIVEFOLD} generate --checkpoint ${out} --prompt "12+" ${flag} ${value}
                  RESULT_VARIABLE status OUTPUT_VARIABLE printed ERROR_VARIABLE err TIMEOUT 120)
  if(status EQUAL 0 OR NOT err MATCHES "${expect}" OR NOT printed STREQUAL "")
    message(FATAL_ERROR "generate ${flag} ${value}: exit ${status}, stdout '${printed}', ${err}")
  endif()
endforeach()
refused("go together" eval --checkpoint ${out} --ids 1,2)
file(WRITE ${WORK}/bad/config.json "{\"model_type\": \"llama\", \"hidden_size\": 32")
refused("not valid JSON" eval --checkpoint ${WORK}/bad)
refused("--split must be held-out or train" eval --checkpoint ${out} --split test)
refused("--exact-match must be >= 0, got -5" eval --checkpoint ${out} --exact-match -5)
