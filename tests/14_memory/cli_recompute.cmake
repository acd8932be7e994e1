# `fivefold train --recompute` as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> -P cli_recompute.cmake
# A bad mode or --recompute-every is refused on every rank before anything is written; a run
# saved without recomputation resumes with it (and with full on every 2nd block on 2 ranks of
# tp), says so, and continues the curve of the run that never recomputed.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)

set(small --d-model 32 --n-layers 3 --n-heads 4 --n-kv-heads 2 --d-ff 64 --seq 16 --batch 8
    --synthetic-examples 300 --warmup 1 --grad-clip 0 --eval-every 0 --exact-match 0
    --eval-batches 1 --peak-gflops 100 --no-progress)

refused_on_every_rank(2 ${WORK}/bad-mode "recompute: 'some' is not one of none, full, selective"
                      --recompute some ${small})
refused_on_every_rank(2 ${WORK}/bad-every "--recompute-every must be >= 1, got 0"
                      --recompute full --recompute-every 0 ${small})

# The reference: 4 steps, no recomputation, a checkpoint at step 2.
train(1 ${WORK}/plain --steps 4 --save-every 2 ${small})
curve(${WORK}/plain plain)

# Resumes the reference's step-2 checkpoint on `np` ranks with the flags that follow: the curve
# goes on as the reference's, and the run says that its recomputation changed.
function(resume_with_recompute name np)
  expect_resumed(${np} ${WORK}/plain ${WORK}/resumed-${name} plain "resumed with ${ARGN}" ${ARGN})
  if(NOT train_output MATCHES "activation recomputation: [^\n]*\\(the run trained with none until now\\)")
    message(FATAL_ERROR "${name}: the resumed run did not say that its recomputation changed")
  endif()
endfunction()

resume_with_recompute(selective 1 --recompute selective)
resume_with_recompute(full-every-2 2 --tp 2 --recompute full --recompute-every 2)
